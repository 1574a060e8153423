"""A target's own multi-token-prediction (MTP) layers, as a draft: vLLM's MiMo MTP in plain PyTorch.

Layer i (vLLM ``mimo_mtp.py``, ``MiMoMultiTokenPredictorLayer``; docs/design.md, "MTP"):

    e      = token_layernorm(embed(x_{t+1}))        # embedding zeroed at position 0
    h      = hidden_layernorm(h_t)                   # the body's residual stream after its last
                                                     # layer, before the final norm (aux id L)
    x      = input_proj([h ; e])                     # hidden FIRST (DeepSeek puts the embedding first)
    x      = qwen2_decoder_layer(x)                  # q/k/v with bias, RoPE, SwiGLU MLP
    out    = final_layernorm(x)                      # the hidden fed to the next draft step
    logits = lm_head(out)                            # the target's own lm_head, full vocabulary

Checkpoint names (the target's ``model.safetensors``, and our MTP draft directories):
``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm,
input_layernorm,post_attention_layernorm}.weight``, ``...self_attn.{q,k,v}_proj.{weight,bias}``,
``...self_attn.o_proj.weight``, ``...mlp.{gate,up,down}_proj.weight``. vLLM runs layer 0 for every
draft step (``MiMoMTP.forward`` asserts ``spec_step_idx == 0``), chained on its own output, so only
layer 0 is trained, unrolled like an Eagle-3 head (``eagle3.ttt_unroll``); layers 1.. are kept as
they are so the served tensor set never changes shape.

``embed_tokens`` and ``lm_head`` are the target's (vLLM shares them with the drafter
unconditionally): here frozen copies, refreshed from the policy before training, never exported.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftadapt.drafts.eagle3 import MLP, Attention, RMSNorm, ttt_unroll

PREFIX = "model.mtp_layers."  # checkpoint prefix of MTP layer tensors, as vLLM loads them
MTP_ARCH = "MiMoForCausalLM"  # the target architecture vLLM serves with method="mtp"


@dataclass
class MTPConfig:
    hidden_size: int  # the target's hidden size (MTP layers work in the target's width)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (lm_head is the target's)
    num_layers: int = 1  # MTP layers the target stores (num_nextn_predict_layers); layer 0 serves
    target_num_layers: int = 0  # L: layer 0 reads the residual stream after the body's L layers
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target_model_type: str = "qwen2"

    @property
    def aux_layer_ids(self) -> list[int]:
        """The one hidden state MTP reads, in draftadapt's aux indexing (the pre-norm stream at L)."""
        return [self.target_num_layers]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MTPConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "MTPConfig":
        """From a MiMo-style target's config.json (a Qwen2 config + ``num_nextn_predict_layers``)."""
        n = int(hf.get("num_nextn_predict_layers") or 0)
        if n < 1 or MTP_ARCH not in (hf.get("architectures") or []):
            raise ValueError(
                f"the target config has architectures {hf.get('architectures')} and num_nextn_predict_layers "
                f"{hf.get('num_nextn_predict_layers')}; MTP needs a {MTP_ARCH} target with >= 1 MTP layer "
                "(`draftadapt toy build --mtp 1` writes one)"
            )
        rope = hf.get("rope_parameters") or {}
        return cls(
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            vocab_size=hf["vocab_size"], num_layers=n, target_num_layers=hf["num_hidden_layers"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), target_model_type=hf.get("model_type", "qwen2"),
        )


class MTPAttention(Attention):
    """Qwen2 attention: q/k/v with bias, on the hidden width (Eagle-3's reads 2x it)."""

    def __init__(self, cfg: MTPConfig):
        nn.Module.__init__(self)
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, cfg.rope_theta
        self.q_proj = nn.Linear(h, nh * hd, bias=True)
        self.k_proj = nn.Linear(h, nkv * hd, bias=True)
        self.v_proj = nn.Linear(h, nkv * hd, bias=True)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)


class MTPLayer(nn.Module):
    """One MTP layer; parameter names are the checkpoint's after ``model.mtp_layers.{i}.``."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = MTPAttention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.final_layernorm = RMSNorm(h, eps)

    # the two halves ``eagle3.ttt_unroll`` calls around the attention
    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """embeds, hidden: [B, T, H] -> attention input [B, T, H] and residual [B, T, H]."""
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1))
        return self.input_layernorm(x), x

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """-> final_layernorm(mlp(norm(a + r)) + a + r): the logits' input and the next step's hidden."""
        x = attn_out + residual
        return self.final_layernorm(self.mlp(self.post_attention_layernorm(x)) + x)


class MTPHead(nn.Module):
    """The target's MTP layers with frozen copies of its embed_tokens and lm_head."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        if cfg.num_layers < 1:
            raise ValueError("MTPConfig.num_layers is 0; an MTP draft needs the target's MTP layers")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_layers))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the full vocabulary: draft id == target id (what ttt_unroll maps argmaxes through)
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.int64))
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Fresh MTP layers (norms 1, biases 0, the rest N(0, std)); embed/lm_head are untouched."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.layers.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            elif name.endswith(".bias"):
                p.data.zero_()
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) * std)

    @property
    def feature_dtype(self) -> torch.dtype:
        return self.layers[0].input_proj.weight.dtype

    def embed_inputs(self, ids: torch.Tensor, step: int, starts: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] -> [B, T, H]; at step 0 index t is position t, and vLLM zeroes position 0's embedding
        (``starts`` [B, T] bool: where each sequence of a packed row begins, for its position 0)."""
        e = self.embed_tokens(ids)
        if step == 0:
            if starts is None:
                e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)
            else:
                e = e.masked_fill(starts[..., None], 0.0)
        return e

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return aux  # the one pre-norm hidden state, as it is

    def lm_input(self, x: torch.Tensor) -> torch.Tensor:
        return x  # final_layernorm's output already

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.lm_input(x))

    def carried(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the next MTP step reads this step's output as it is

    def unroll(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int, feed_ids=None,
               slots: torch.Tensor | None = None, segments: torch.Tensor | None = None,
               features: bool = False) -> list[torch.Tensor]:
        """Layer 0 run ``steps`` draft steps deep, as vLLM chains it (see ``eagle3.ttt_unroll``)."""
        return ttt_unroll(self, input_ids, aux, steps, feed_ids, slots, segments, features)

    # ------------------------------------------------------------------ checkpoint names

    def mtp_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Only the MTP layers' tensors, under the checkpoint names vLLM loads."""
        return {f"{PREFIX}{k}": (v if dtype is None else v.to(dtype)).detach().contiguous()
                for k, v in self.layers.state_dict().items()}

    def load_mtp_state_dict(self, sd: dict[str, torch.Tensor], where: str) -> None:
        mine = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
        own = self.layers.state_dict()
        missing, extra = sorted(set(own) - set(mine)), sorted(set(mine) - set(own))
        wrong = sorted(k for k in set(own) & set(mine) if own[k].shape != mine[k].shape)
        if missing or extra or wrong:
            raise ValueError(f"{where}: MTP tensors do not fit (missing {missing[:4]}, unexpected {extra[:4]}, "
                             f"wrong shape {wrong[:4]}); the draft was made for another MTP target")
        self.layers.load_state_dict({k: v.float() for k, v in mine.items()})

    def copy_shared(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The target's (policy's) embed_tokens and lm_head, copied in (no graph to them)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(lm_head)


def target_tensors(target_dir: str | Path, want) -> dict[str, torch.Tensor]:
    """The tensors of a target directory's safetensors files whose names pass ``want``."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if want(k)})
    return out


def head_from_target(target_dir: str | Path, fresh_seed: int | None = None) -> MTPHead:
    """The target's own MTP layers (``fresh_seed``: freshly initialised ones instead), with its
    embed_tokens and lm_head."""
    hf = json.loads((Path(target_dir) / "config.json").read_text())
    head = MTPHead(MTPConfig.from_hf(hf))
    sd = target_tensors(target_dir, lambda k: k.startswith(PREFIX) or k in ("model.embed_tokens.weight", "lm_head.weight"))
    if "lm_head.weight" not in sd:
        raise ValueError(f"{target_dir} has no separate lm_head.weight; the MTP toy keeps embeddings untied")
    head.copy_shared(sd["model.embed_tokens.weight"].float(), sd["lm_head.weight"].float())
    if fresh_seed is None:
        head.load_mtp_state_dict(sd, str(target_dir))
    else:
        head.init_weights(fresh_seed)
    return head
