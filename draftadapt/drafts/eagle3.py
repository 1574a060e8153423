"""Eagle-3 draft head in plain PyTorch, parameter for parameter what vLLM's Eagle-3 loader expects.

Architecture (Li et al., EAGLE-3, arXiv 2503.01840; vLLM ``llama_eagle3.py``):

    g      = fc([h_l1 ; h_l2 ; h_l3])              # 3 target aux hidden states -> hidden
    x      = layer0(embed(next_token), g)          # attention input is [norm(embed) ; norm(g)]
    logits = lm_head(norm(x))                      # over the reduced draft vocabulary
    the pre-norm ``x`` is the hidden state fed to the next speculative step.

Three variants from speculators (the Eagle 3.1 and gpt-oss heads; vLLM reads the same config keys),
each off in the original: ``norm_before_fc`` (one RMSNorm over the concatenated aux states before
fc), ``fc_norm`` (one RMSNorm per aux state) and ``norm_output`` (the next step reads ``norm(x)``).

Parameter names (no ``model.`` prefix, as vLLM's ``Eagle3LlamaForCausalLM.load_weights`` wants):
``embed_tokens.weight``, ``fc.weight``, ``layers.0.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``,
buffers ``d2t`` [Vd] int64 offsets and ``t2d`` [Vt] bool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Eagle3Config:
    hidden_size: int  # draft hidden size; equals the embedding width
    intermediate_size: int  # MLP width of the single decoder layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int  # width of each target aux hidden state (fc input is 3x this)
    target_vocab_size: int  # the verifier's vocabulary; embed_tokens covers all of it
    draft_vocab_size: int  # lm_head rows; d2t maps them into the target vocabulary
    aux_layer_ids: list[int] = field(default_factory=list)  # residual stream after k target layers
    max_position_embeddings: int = 2048  # never below the target's (RoPE would clamp)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # False: the residual is the raw fc output (original EAGLE-3). speculators' exports default
    # to True, so the flag is always written explicitly on export.
    norm_before_residual: bool = False
    # speculators 0.9 trains Eagle-3 heads with norm_before_fc and norm_output on by default; a head
    # imported from it keeps them, so they are served (vLLM llama_eagle3.py) and trained as written.
    norm_before_fc: bool = False  # RMSNorm over [h_l1 ; h_l2 ; h_l3] before fc (tensor input_norm.weight)
    fc_norm: bool = False  # an RMSNorm per aux state before fc (fc_norm.{i}.weight); excludes norm_before_fc
    norm_output: bool = False  # the next speculative step reads norm(x) instead of x (Eagle 3.1: no drift in scale)
    # True: the head uses the target's own embed_tokens (not exported; vLLM shares the target's
    # module and it follows every policy update). False: the head ships its own, distinct copy.
    share_embeddings: bool = True
    target_model_type: str = "llama"  # which target family this head was built for
    target_num_layers: int = 0

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Eagle3Config":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# The decoder layer's sizes, named as an HF Llama config names them: a head is sized from its
# target's config by these names, and exported under them.
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "rms_norm_eps", "rope_theta")


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high layers, all distinct, all below the last layer.

    vLLM's default (2, L//2, L-3) repeats a layer for small L (L=6 gives 3 twice; docs/design.md,
    "Eagle-3 aux layers"), so for small targets we spread three distinct ids over 1..L-1 instead
    (0, the embeddings, only for L=3). Id L is avoided: vLLM captures it before the final norm, HF's hidden_states[L] after.
    """
    if num_layers < 3:
        raise ValueError(f"an Eagle-3 head needs a target with >= 3 layers, got {num_layers}")
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    if num_layers == 3:
        return [0, 1, 2]
    lo, hi = 1, num_layers - 1
    return [lo, (lo + hi) // 2, hi]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama (neox-style, half split) rotary tables: positions [B, T] int -> cos, sin [B, 1, T, D]
    (float32), computed once for the queries and the keys of a pass."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    ang = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    ang = torch.cat([ang, ang], -1)[:, None]
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D] -> x rotated by the tables of :func:`rope_tables` (in float32)."""
    d = x.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, cfg.rope_theta
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [B, T, 2H] -> q [B, nh, T, hd], k and v [B, nkv, T, hd] (RoPE applied)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rope_tables(positions, self.hd, self.theta)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def attend(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """q: [B, nh, T, hd]; k, v: [B, nkv, S, hd]; mask: [T, S] or [B, 1, T, S] bool (True = may attend)."""
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """embeds, hidden: [B, T, H] -> attention input [B, T, 2H] and residual [B, T, H]."""
        e = self.input_layernorm(embeds)
        if self.cfg.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        return torch.cat([e, hidden], dim=-1), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Post-attention half; returns the pre-norm output x = mlp(norm(a + r)) + (a + r)."""
        x = attn_out + residual
        return self.mlp(self.post_attention_layernorm(x)) + x


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        if cfg.num_aux < 1:
            raise ValueError("Eagle3Config.aux_layer_ids is empty; pass the target layers to read")
        if cfg.norm_before_fc and cfg.fc_norm:
            raise ValueError("Eagle3Config: norm_before_fc and fc_norm exclude each other (vLLM applies one); set one")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
        # registered last and only when on, so a head without them has the same tensors and init as before
        width = cfg.num_aux * cfg.target_hidden_size
        self.input_norm = RMSNorm(width, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
                        if cfg.fc_norm else None)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) * std)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [B, T, num_aux * Ht] concatenated target aux hidden states -> [B, T, H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def lm_input(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] pre-norm output -> what lm_head reads [B, T, H]."""
        return self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] pre-norm output -> [B, T, Vd] draft-vocab logits."""
        return self.lm_head(self.lm_input(x))

    def carried(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] pre-norm output -> the hidden state the next speculative step reads [B, T, H]."""
        return self.norm(x) if self.cfg.norm_output else x

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One causal pass (the first speculative step, as vLLM runs it over a prefix).

        input_ids: [B, T] token t+1 at index t; hidden: [B, T, H] (fc output or the previous
        step's ``carried`` output) for position t; positions: [B, T] -> pre-norm output x [B, T, H].
        """
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        layer = self.layers[0]
        a_in, residual = layer.attn_input(self.embed_tokens(input_ids), hidden)
        q, k, v = layer.self_attn.qkv(a_in, positions)
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        return layer.finish(layer.self_attn.attend(q, k, v, mask), residual)

    @property
    def feature_dtype(self) -> torch.dtype:
        """The dtype the aux hidden states are cast to on the way in."""
        return self.fc.weight.dtype

    def embed_inputs(self, ids: torch.Tensor, step: int, starts: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] token ids fed at draft step ``step`` -> [B, T, H] (``starts``: where the
        sequences of a packed row begin; an Eagle-3 head embeds every position alike)."""
        return self.embed_tokens(ids)

    def unroll(
        self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int, feed_ids=None,
        slots: torch.Tensor | None = None, segments: torch.Tensor | None = None, features: bool = False,
    ) -> list[torch.Tensor]:
        """Training-time test; see :func:`ttt_unroll`."""
        return ttt_unroll(self, input_ids, aux, steps, feed_ids, slots, segments, features)


def ttt_unroll(
    head, input_ids: torch.Tensor, aux: torch.Tensor, steps: int, feed_ids=None,
    slots: torch.Tensor | None = None, segments: torch.Tensor | None = None, features: bool = False,
) -> list[torch.Tensor]:
    """Training-time test (EAGLE-3 section 3.2): run ``steps`` speculative steps of ``head`` in parallel.

    ``head``: an :class:`Eagle3Head` or an MTP head (drafts/mtp.py); both have the same step
    structure: ``combine`` the target features, ``layers[0]``'s ``attn_input``, attention and
    ``finish``, ``lm_input`` and ``lm_head`` (``logits``), ``carried`` (what the next step reads),
    ``d2t`` and ``embed_inputs``.

    Step 0 is a causal pass from the target's hidden states. At step j the query for original
    position t stands for position t + j: it attends to step-0 keys at positions <= t and to
    its own earlier speculative keys at t (steps 1..j), exactly the keys vLLM's draft KV cache
    holds when it speculates j tokens past an accepted prefix ending at t.

    input_ids: [B, T] (token t+1 at index t); aux: [B, T, num_aux*Ht];
    feed_ids(j, logits_j) -> [B, T] ids fed at step j+1 (default: the draft's own argmax,
    mapped to target ids). ``slots``: [B, M] positions at which steps >= 1 run (None: all T);
    a query at a slot sees the same keys as above, so the result there is the full unroll's,
    at M/T of the cost of each step >= 1 (docs/design.md, "Adapter cost"). Returns per step
    the draft-vocab logits: [B, T, Vd] for step 0, [B, M or T, Vd] for the others.
    ``segments``: [B, T] sequence ids of a packed batch (``CapturedBatch.packed``): a query sees
    only keys of its own sequence. RoPE scores depend on the distance between positions only, so
    a sequence placed further along a row attends as it would at the start of its own.
    ``features``: return per step what lm_head reads ([B, T or M, H]) instead of the logits, for a
    loss that applies lm_head itself in chunks (``train.losses.ttt_loss_chunked``): no
    [tokens, Vd] tensor is kept for backward here.
    """
    b, t = input_ids.shape
    dev = input_ids.device
    layer = head.layers[0]
    hidden = head.combine(aux)
    ids = input_ids
    keys, values, out = [], [], []
    positions = torch.arange(t, device=dev).expand(b, t)
    base = positions if slots is None else slots
    masks, starts = _ttt_masks(b, t, steps, slots, segments, dev)
    for j in range(steps):
        a_in, residual = layer.attn_input(head.embed_inputs(ids, j, starts), hidden)
        q, k, v = layer.self_attn.qkv(a_in, positions if j == 0 else base + j)
        keys.append(k)
        values.append(v)
        x = layer.finish(layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), masks[j]), residual)
        feat = head.lm_input(x)
        logits = None if features else head.lm_head(feat)
        out.append(feat if features else logits)
        if j + 1 < steps:
            ids = _shifted_ids(head, j, feat, logits, feed_ids, slots).detach()
            carry = head.carried(x)
            hidden = carry if slots is None or j > 0 else _at_slots(carry, slots)
    return out


def _ttt_masks(b: int, t: int, steps: int, slots: torch.Tensor | None, segments: torch.Tensor | None,
               dev: torch.device) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Each step's attention mask over [step-0 keys, steps 1..j's keys], and where each packed
    sequence starts ([B, T] bool; None unpacked). Without slots step j's is [(B, 1,) T, (j+1)T];
    at ``slots`` [B, M] step 0 stays causal over T and step j >= 1's is [B, 1, M, T + jM]."""
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    starts = None
    if segments is not None:
        causal = (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]  # [B, 1, T, T]
        starts = segments != torch.cat([segments.new_full((b, 1), -2), segments[:, :-1]], dim=1)
    if slots is None:
        diag = torch.eye(t, dtype=torch.bool, device=dev).expand(causal.shape)
        return [torch.cat([causal] + [diag] * j, dim=-1) for j in range(steps)], starts  # [(B, 1,) T, (j+1)T]
    m = slots.shape[1]
    seen = (torch.arange(t, device=dev) <= slots[..., None])[:, None]  # [B, 1, M, T]
    if segments is not None:
        seen = seen & (segments.gather(1, slots)[..., None] == segments[:, None, :])[:, None]
    diag = torch.eye(m, dtype=torch.bool, device=dev).expand(b, 1, m, m)
    return [causal] + [torch.cat([seen] + [diag] * j, dim=-1) for j in range(1, steps)], starts


def _at_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] by position -> [B, M, ...] at the slots."""
    return x.gather(1, slots if x.dim() == 2 else slots[..., None].expand(-1, -1, x.shape[-1]))


def _shifted_ids(head, j: int, feat: torch.Tensor, logits: torch.Tensor | None, feed_ids,
                 slots: torch.Tensor | None) -> torch.Tensor:
    """The ids step j + 1 reads. Shift: the step-(j+1) query at t consumes the token predicted for
    t + j + 2 (``feed_ids``' choice, or the draft's own argmax mapped to target ids)."""
    if feed_ids is not None:
        nxt = feed_ids(j, logits)  # by position
        return nxt if slots is None else _at_slots(nxt, slots)
    if logits is None:
        with torch.no_grad():  # the argmax only: nothing of it is kept for backward
            top = head.lm_head(feat.detach()).argmax(-1)
    else:
        top = logits.argmax(-1)
    nxt = top + head.d2t[top]
    return nxt if slots is None or j > 0 else _at_slots(nxt, slots)


def init_from_target(target, aux_layer_ids: list[int] | None, draft_vocab: int | None,
                     counts: torch.Tensor | None, seed: int) -> Eagle3Head:
    """A fresh head sized for an HF target: embeddings copied from the target, not random.

    Random ``embed_tokens`` in an exported draft was a shipped failure elsewhere (docs/design.md,
    "Failures other systems shipped"); we copy the target's embeddings so the head starts from the
    target's token geometry.
    """
    from draftadapt.drafts.vocab import build_vocab_map

    tc = target.config
    # one of the target's decoder layers (a config may leave out the kv heads and head_dim, and
    # newer ones keep rope_theta in rope_parameters)
    optional = ("num_key_value_heads", "head_dim", "rope_theta")
    missing = [name for name in LAYER_FIELDS if name not in optional and getattr(tc, name, None) is None]
    if missing:
        raise ValueError(f"the target's config has no {', '.join(missing)}; an Eagle-3 head copies its decoder "
                         "layer's sizes from them: pass a decoder-only HF causal LM's config")
    layer = {name: getattr(tc, name, None) for name in LAYER_FIELDS}
    layer["num_key_value_heads"] = layer["num_key_value_heads"] or tc.num_attention_heads
    layer["head_dim"] = layer["head_dim"] or tc.hidden_size // tc.num_attention_heads
    layer["rope_theta"] = _rope_theta(tc)
    layers = aux_layer_ids or default_aux_layers(tc.num_hidden_layers)
    for k in layers:
        if not 0 <= k <= tc.num_hidden_layers:
            raise ValueError(
                f"aux layer id {k} is outside 0..{tc.num_hidden_layers} for this "
                f"{tc.num_hidden_layers}-layer target"
            )
    vt = tc.vocab_size
    vd = draft_vocab or vt
    cfg = Eagle3Config(**layer, target_hidden_size=tc.hidden_size, target_vocab_size=vt, draft_vocab_size=vd,
                       aux_layer_ids=list(layers), target_model_type=tc.model_type,
                       target_num_layers=tc.num_hidden_layers)
    head = Eagle3Head(cfg)
    head.init_weights(seed)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        if counts is None:
            counts = torch.ones(vt)
        d2t, t2d = build_vocab_map(counts, vd)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    # Shared with the target (vLLM serves the target's module): frozen here, refreshed from the
    # policy before training, never exported.
    head.embed_tokens.weight.requires_grad_(not cfg.share_embeddings)
    return head


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    return float(theta) if theta is not None else 10000.0



def with_layout(head: Eagle3Head, seed: int, **changes) -> Eagle3Head:
    """The same head with other ``Eagle3Config`` layer settings (an MLP width, speculators' norms):
    fresh weights for each tensor that is new or changed shape, every other tensor kept."""
    cfg = dataclasses.replace(head.cfg, **changes)
    if cfg == head.cfg:
        return head
    out = Eagle3Head(cfg)
    out.init_weights(seed)
    own = out.state_dict()
    kept = {k: v for k, v in head.state_dict().items() if k in own and own[k].shape == v.shape}
    out.load_state_dict({**own, **kept})
    frozen = {name for name, p in head.named_parameters() if not p.requires_grad}
    for name, p in out.named_parameters():  # frozen stays frozen (shared embeddings)
        p.requires_grad_(name not in frozen)
    return out


def with_intermediate_size(head: Eagle3Head, intermediate_size: int, seed: int) -> Eagle3Head:
    """The same head with an MLP of another width: fresh MLP weights, every other tensor kept.

    A narrower MLP makes every speculative step cheaper; on the CPU toy a 256-wide MLP learned as
    well as the target's 768 and cut the drafter's share of a step (scripts/bench_pretrain.py at
    commit 0b04f9e; docs/results.md, "Measured on a 2-core CPU").
    """
    if intermediate_size < 1:
        raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
    return with_layout(head, seed, intermediate_size=intermediate_size)
