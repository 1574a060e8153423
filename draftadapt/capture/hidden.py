"""What a draft learns from: the target's aux hidden states and next-token distributions.

Computed from an HF transformers copy of the target (the policy), one batch at a time: callers
stream batches through :func:`iter_captured` and drop each after use, so memory is bounded by
one batch however large the dataset.

Aux layer indexing matches vLLM (docs/design.md, "Eagle-3 aux layers"): aux id k is the residual
stream after k decoder layers, 0 being the embeddings. For k < L that is HF's ``hidden_states[k]``;
for k = L vLLM takes the stream *before* the final norm while HF's ``hidden_states[L]`` is after
it, so we read every id with forward hooks on the embedding and on decoder layer k - 1 instead of
trusting ``output_hidden_states``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn


@dataclass
class CapturedBatch:
    """One padded batch with everything the losses and the acceptance estimate need.

    Slot u: ``target_logp[:, u]`` = log p_T(token u + 1 = v | tokens <= u) for v in the draft
    vocabulary (normalised over the full target vocabulary), ``aux[:, u]`` the target's aux
    hidden states at position u, ``loss_mask[:, u]`` token u + 1 is a response token.
    """

    input_ids: torch.Tensor  # [B, T] long, right padded
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    target_logp: torch.Tensor  # [B, T, Vd] float
    aux: torch.Tensor | None = None  # [B, T, num_aux * H] (Eagle-3 only)
    # packed (:meth:`packed`): [B, T] long, which of the batch's sequences (in their order before
    # packing) each position holds, -1 on padding; None: one sequence a row
    segments: torch.Tensor | None = None
    seqs: int = 0  # packed: how many sequences (segment ids 0..seqs-1)

    def to(self, device) -> "CapturedBatch":
        return CapturedBatch(**{f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                for f in fields(self) for v in [getattr(self, f.name)]})

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def packed(self) -> "CapturedBatch":
        """The same sequences laid end to end, several to a row, so the rows carry little padding
        (an Eagle-3 or MTP training step costs per padded position; a batch drawn for priority
        mixes short and long sequences). Rows are filled first-fit, longest first, at the width
        of the widest sequence or up to twice it, whichever pads least; ``segments`` says which
        sequence each position holds. The losses mask attention and targets at the segment
        boundaries, so a packed batch gives the same loss as the padded one (docs/design.md,
        "Packed batches")."""
        if self.segments is not None:
            return self
        lengths = self.attention_mask.sum(1).tolist()
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        widest = max(lengths)
        best = None
        for width in sorted({widest, int(widest * 1.25), int(widest * 1.5), 2 * widest}):
            rows: list[list[int]] = []
            room: list[int] = []
            for i in order:
                r = next((r for r, left in enumerate(room) if left >= lengths[i]), None)
                if r is None:
                    rows.append([i])
                    room.append(width - lengths[i])
                else:
                    rows[r].append(i)
                    room[r] -= lengths[i]
            filled = max(width - left for left in room)  # the widest row as filled
            if best is None or len(rows) * filled < best[0] * best[1]:
                best = (len(rows), filled, rows)
        n_rows, width, rows = best
        if n_rows == len(lengths):
            return self  # nothing pairs up: packing would only add masks
        out = {name: None if t is None else t.new_zeros((n_rows, width, *t.shape[2:]))
               for name in ("input_ids", "attention_mask", "loss_mask", "target_logp", "aux")
               for t in [getattr(self, name)]}
        segments = self.input_ids.new_full((n_rows, width), -1, dtype=torch.long)
        for r, members in enumerate(rows):
            at = 0
            for i in sorted(members):
                n = lengths[i]
                for name, t in out.items():
                    if t is not None:
                        t[r, at: at + n] = getattr(self, name)[i, :n]
                segments[r, at: at + n] = i
                at += n
        return CapturedBatch(**out, segments=segments, seqs=len(lengths))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (``model.model.layers`` for Llama/Qwen)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder layer list at .get_decoder().layers; "
            "aux hidden-state capture supports Llama-style HF models (Llama, Qwen, Mistral)"
        )
    return layers


class _AuxHooks:
    """Forward hooks that keep the aux layers' outputs of the last forward (detached).

    Aux id k is read at the output of the embedding (k = 0) or of decoder layer k - 1: the
    residual stream after k layers, before any final norm, as vLLM captures it.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.grabbed: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def __enter__(self) -> "_AuxHooks":
        layers = decoder_layers(self.model) if self.aux_layer_ids else None
        for k in self.aux_layer_ids:
            module = self.model.get_input_embeddings() if k == 0 else layers[k - 1]
            self._hooks.append(module.register_forward_hook(self._keep(k)))
        return self

    def _keep(self, k: int):
        def hook(_module, _inputs, output):
            self.grabbed[k] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.grabbed.clear()

    def aux(self) -> torch.Tensor | None:
        """[B, T, n*H] of the last forward, or None without aux layers."""
        if not self.aux_layer_ids:
            return None
        missing = [k for k in self.aux_layer_ids if k not in self.grabbed]
        if missing:
            raise RuntimeError(f"no forward of the policy ran inside the hand-over since the last add() "
                               f"(aux layers {missing} produced nothing); call add() after each forward")
        return torch.cat([self.grabbed[k] for k in self.aux_layer_ids], dim=-1)


def _subset_or_none(model: nn.Module, draft_to_target: torch.Tensor | None) -> torch.Tensor | None:
    """The draft vocabulary's target ids, or None when they are the whole vocabulary in order
    (an index_select that copies every logit would change nothing)."""
    if draft_to_target is None:
        return None
    vt = model.config.vocab_size
    if draft_to_target.numel() == vt and torch.equal(draft_to_target.cpu(), torch.arange(vt)):
        return None
    return draft_to_target


# What a hand-over keeps per token besides the aux states: "logp", the log-probs over the draft
# vocabulary (Vd floats); "hidden", the output head's input and the log-normaliser (H + 1 values),
# the log-probs recomputed from the forward's own head rows when a batch is built: 16x less at
# 8B widths (docs/design.md, "On a GPU").
HANDOVER_STORES = ("logp", "hidden")


def handed_logp(lm_input: torch.Tensor, lse: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor | None],
                temperature: float) -> torch.Tensor:
    """[n, H] head inputs, [n, 1] log-normalisers of logits / T over the full vocabulary, and the
    head's draft-vocabulary rows (weight [Vd, H], bias [Vd] or None) -> [n, Vd] log-probs, as
    :func:`restricted_logp` gives them from the logits."""
    weight, bias = head
    logits = lm_input.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    return logits / temperature - lse.float()


def restricted_logp(logits: torch.Tensor, temperature: float, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """[..., Vt] target logits -> [..., Vd] log softmax(logits / T), normalised over the full
    vocabulary, at the draft vocabulary's target ids (all of them when ``draft_to_target`` is None)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if draft_to_target is not None:
        logp = logp.index_select(-1, draft_to_target.to(logp.device))
    return logp


class HostCopies:
    """Copies of device tensors in host memory, made without holding up the caller on a GPU.

    On CUDA each copy goes into a pinned host buffer, non-blocking, on a side stream that first
    waits for the work that produced its source (the RL trainer's stream goes on with its
    backward while the copies cross the host link); the source is kept alive for that stream
    (``record_stream``), so the trainer may free it at once. :meth:`mark` closes a batch of
    copies with an event; :meth:`wait` returns once every batch marked has landed. A dtype change
    runs on the side stream too. On the CPU a copy is a plain one, done when it returns.
    """

    def __init__(self):
        self._stream = None  # created on the first CUDA copy, on that tensor's device
        self._events: list = []

    def copy(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = t.dtype if dtype is None else dtype
        if t.device.type != "cuda":
            return t.to("cpu", dtype, copy=True)
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))
        out = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        with torch.cuda.stream(self._stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self._stream)
        return out

    def mark(self) -> None:
        """The copies made so far form a batch: :meth:`wait` waits for it."""
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._events.append(event)

    @property
    def pending(self) -> int:
        """Batches marked and not waited for."""
        return len(self._events)

    def wait(self) -> None:
        for event in self._events:
            event.synchronize()
        self._events.clear()


class HandedOver:
    """The rows a :class:`HandOver` took, without its hooks: what an adapter in another process
    (a Ray actor) is given. Picklable; ``observe(handover=...)`` takes it as it takes a HandOver."""

    def __init__(self, rows: dict[int, dict[str, torch.Tensor]] | None = None, seconds: float = 0.0,
                 lm_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 subset: Sequence[int] | None = None, shared: dict[str, torch.Tensor] | None = None):
        self.rows: dict[int, dict[str, torch.Tensor]] = dict(rows or {})
        self.seconds = seconds  # spent in add(): what the hand-over adds to the trainer's pass
        # store="hidden": the forward's output head at the draft vocabulary's rows (weight, bias)
        self.lm_head = lm_head
        # the rollouts it keeps, when chosen up front (None: all): observe takes only these
        self.subset = None if subset is None else sorted({int(i) for i in subset})
        # the forward's own policy tensors a draft shares with it (e.g. the embeddings an Eagle-3
        # head reads, under their HF state-dict names), for a trainer whose policy the adapter
        # sees no other way (verl's actor): observe loads them into the adapter's copy
        self.shared: dict[str, torch.Tensor] = dict(shared or {})

    def wait_copies(self) -> None:
        """Until the rows' copies to host memory have landed (at once off a GPU); :meth:`tensors`
        and :meth:`detach` wait for them."""

    def detach(self) -> "HandedOver":
        """The rows alone (no hooks), to send to an adapter elsewhere."""
        self.wait_copies()
        return HandedOver(self.rows, self.seconds, self.lm_head, self.subset, self.shared)

    def chosen(self, n: int) -> list[int]:
        """The rollout indices (of a step's ``n``) this hand-over is for, in order."""
        if self.subset is None:
            return list(range(n))
        bad = [i for i in self.subset if not 0 <= i < n]
        if bad:
            raise ValueError(f"hand-over subset names rollouts {bad[:8]} of a step of {n}; choose among 0..{n - 1}")
        return self.subset

    def keep(self, indices: Sequence[int]) -> "HandedOver":
        """Keep only rollouts ``indices``, renumbered 0..len-1 in that order (to observe a subset
        of a step's rollouts, e.g. those a trainer's forward covered). ``observe`` then takes
        exactly those rollouts, in that order (a subset chosen up front is spent). Returns self."""
        self.rows = {j: self.rows[int(i)] for j, i in enumerate(indices)}
        self.subset = None
        return self

    def tensors(self, n: int) -> list[dict[str, torch.Tensor]]:
        """Per rollout of :meth:`chosen` (0..n-1 without a subset), in order; every one must have
        been added."""
        self.wait_copies()
        chosen = self.chosen(n)
        missing = [i for i in chosen if i not in self.rows]
        if missing:
            raise ValueError(f"hand-over holds no forward output for rollouts {missing[:8]} "
                             f"({len(missing)} of {len(chosen)}); add() every micro-batch of the trainer's pass")
        return [self.rows[i] for i in chosen]


class HandOver(HandedOver):
    """The aux hidden states and next-token log-probs of the RL trainer's own forward over its
    rollouts, taken over for the draft: the adapter then runs no policy forward of its own.

        with adapter.handover(policy) as ho:          # forward hooks on the policy's aux layers
            for idx in micro_batches:                 # rollout indices of this micro-batch
                batch = collate([seqs[i] for i in idx], pad_id)
                logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                ho.add(idx, logits, batch["attention_mask"])   # before the next forward of policy
                ...                                   # the trainer's loss and backward, unchanged
        adapter.observe(rollouts, policy_version=v, handover=ho)

    ``subset``: the rollout indices to keep (say 64 of a step's 512, chosen at random): the others'
    rows are not copied, and ``observe`` takes only these rollouts. Batches are right padded
    (``data.sequences.collate``); rows may come in any order and any micro-batch size. Per
    rollout it keeps the aux states [T, n*H] (``aux_dtype``, bf16 halves memory) and (``store``
    "logp") the log-probs [T, Vd] at the engine's sampling temperature over the draft's
    vocabulary: the distribution the policy *sampled these rollouts from*, which is the one the
    draft should match while the engine serves that version (docs/design.md, "Hand-over").
    On a GPU add() returns before its rows are in host memory (:class:`HostCopies`: pinned
    buffers, a side stream); :meth:`tensors` and :meth:`detach` wait for them.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None, draft_to_target: torch.Tensor | None,
                 temperature: float, aux_dtype: torch.dtype = torch.bfloat16, store: str = "logp",
                 subset: Sequence[int] | None = None):
        super().__init__(subset=subset)
        if store not in HANDOVER_STORES:
            raise ValueError(f"hand-over store {store!r}: use 'logp' (log-probs over the draft vocabulary) or "
                             "'hidden' (the output head's input; 16x less at 8B widths)")
        self._hooks = _AuxHooks(model, list(aux_layer_ids or []))
        self.draft_to_target = _subset_or_none(model, draft_to_target)
        self.temperature = temperature
        self.aux_dtype = aux_dtype
        self.store = store
        self._model = model
        self._head_hook = None
        self._head_input: torch.Tensor | None = None
        self._copies = HostCopies()

    def __enter__(self) -> "HandOver":
        self._hooks.__enter__()
        if self.store == "hidden":
            def keep_input(_module, inputs):
                self._head_input = inputs[0].detach()
            self._head_hook = self._model.get_output_embeddings().register_forward_pre_hook(keep_input)
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        if self._head_hook is not None:
            self._head_hook.remove()
            self._head_hook = None
        self._head_input = None

    def wait_copies(self) -> None:
        self._copies.wait()

    def _head_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head at the draft vocabulary's rows, in host memory (once per hand-over:
        the forward's policy is the same for every micro-batch)."""
        head = self._model.get_output_embeddings()
        d2t = self.draft_to_target
        weight = head.weight.detach()
        bias = getattr(head, "bias", None)
        if d2t is not None:
            weight = weight.index_select(0, d2t.to(weight.device))
            bias = None if bias is None else bias.detach().index_select(0, d2t.to(bias.device))
        return weight.to("cpu", copy=True), None if bias is None else bias.detach().to("cpu", copy=True)

    def _check_head(self, head_input: torch.Tensor, logits: torch.Tensor, row: int, lo: int, hi: int) -> None:
        """The logits must be the head applied to its input (no soft-capping or scaling after it),
        or the log-probs recomputed from the head would not be the policy's: checked on the first
        tokens of the first row handed over."""
        hi = min(hi, lo + 8)
        logits_t = logits[row, lo:hi].detach().float() / self.temperature
        lse = torch.logsumexp(logits_t, -1, keepdim=True)
        weight, bias = self.lm_head
        head = (weight.to(head_input.device), None if bias is None else bias.to(head_input.device))
        got = handed_logp(head_input[row, lo:hi], lse, head, self.temperature)
        want = restricted_logp(logits[row, lo:hi].detach(), self.temperature, self.draft_to_target)
        # the logits' own rounding: a bf16 forward's logits are exact to about 2^-8 of their size
        tol = 1e-3 + 4 * torch.finfo(logits.dtype).eps * float(logits_t.abs().max())
        err = float((got - want).abs().max())
        if err > tol:
            raise ValueError(f"hand-over store='hidden': these logits are not the output head applied to its input "
                             f"(largest log-prob difference {err:.3g} > {tol:.3g} on the first tokens; a soft-capped "
                             "or scaled output?); use AdapterConfig.handover_store='logp'")

    @torch.no_grad()
    def add(self, index: Sequence[int], logits: torch.Tensor, attention_mask: torch.Tensor,
            rows: Sequence[int] | None = None, forward_rows: Sequence[int] | None = None) -> None:
        """Keep rows ``index`` (rollout positions) of the forward that just produced ``logits``.

        logits: [B, T, Vt]; attention_mask: [B, T], each row's tokens one contiguous run (right
        padded as ``collate`` does, or left padded prompts followed by right padded completions as
        TRL does). ``rows``: which batch rows ``index`` refers to (default: all, in order; a row
        may be named twice when two rollouts are the same tokens). ``forward_rows``: the row of
        the policy's forward each row of ``logits`` came from (default: the same row), for logits
        projected from some of the forward's rows only (a subset hand-over: the others' output
        head is never run). Detached; the trainer's graph is not touched."""
        index = list(index)
        rows = list(range(logits.shape[0])) if rows is None else list(rows)
        if len(rows) != len(index) or attention_mask.shape[:2] != logits.shape[:2] or \
                (forward_rows is not None and len(forward_rows) != logits.shape[0]):
            raise ValueError(f"hand-over: {len(index)} rollout indices for rows {rows[:8]} of logits "
                             f"{tuple(logits.shape)} and attention mask {tuple(attention_mask.shape)}"
                             f"{'' if forward_rows is None else f' from forward rows {list(forward_rows)[:8]}'}; "
                             "pass one index per row and one forward row per row of logits")
        mask = attention_mask.bool()
        lengths = mask.sum(-1).tolist()
        starts = mask.int().argmax(-1).tolist()  # first token of each row (0 when right padded)
        self._take(index, logits, [(r, starts[r], starts[r] + lengths[r]) for r in rows],
                   None if forward_rows is None else [int(f) for f in forward_rows])

    @torch.no_grad()
    def add_packed(self, index: Sequence[int], logits: torch.Tensor, offsets: Sequence[int],
                   rows: Sequence[int] | None = None) -> None:
        """As :meth:`add`, for a forward over sequences laid end to end in one row (padding
        removed, as verl's and TRL's packed forwards run): logits [1, N, Vt], sequence j at
        positions ``offsets[j]:offsets[j + 1]`` (cumulative lengths from 0; padding after the
        last is allowed). ``rows``: which sequences ``index`` refers to (default: all, in order)."""
        index, offsets = list(index), [int(o) for o in offsets]
        rows = list(range(len(offsets) - 1)) if rows is None else list(rows)
        if logits.dim() != 3 or logits.shape[0] != 1 or len(rows) != len(index) or not offsets or \
                offsets[-1] > logits.shape[1] or any(b < a for a, b in zip(offsets, offsets[1:])) or \
                any(not 0 <= j < len(offsets) - 1 for j in rows):
            raise ValueError(f"hand-over: packed logits {tuple(logits.shape)} with offsets {offsets[:8]} for rollouts "
                             f"{index[:8]} at sequences {rows[:8]}; pass [1, N, V] logits, increasing offsets <= N "
                             "and one sequence per index")
        self._take(index, logits, [(0, offsets[j], offsets[j + 1]) for j in rows])

    def _take(self, index: list[int], logits: torch.Tensor, spans: list[tuple[int, int, int]],
              forward_rows: list[int] | None = None) -> None:
        """Rollout ``index[j]``'s tokens are ``logits[row, lo:hi]`` for ``spans[j] = (row, lo, hi)``;
        its aux states are the forward's row ``forward_rows[row]`` (default: ``row``)."""
        t0 = time.perf_counter()
        aux = self._hooks.aux()
        head_input = None
        if self.store == "hidden":
            head_input = self._head_input
            if head_input is None or head_input.shape[:2] != logits.shape[:2]:
                raise RuntimeError("hand-over store='hidden': the output head saw no forward of this batch since the "
                                   "last add(); call add() right after each forward of the policy")
            self._head_input = None
        keep = None if self.subset is None else set(self.subset)
        for i, (r, lo, hi) in zip(index, spans):
            if keep is not None and int(i) not in keep:
                continue  # not chosen: nothing copied (docs/design.md, "On a GPU")
            # kept in host memory: on a GPU the replay buffer must not hold device memory that the
            # engine's KV cache and the RL trainer need; copied beside the trainer's step, not in
            # it (HostCopies; docs/design.md, "On a GPU")
            copy = self._copies.copy
            if head_input is not None:
                if self.lm_head is None:
                    self.lm_head = self._head_rows()
                    self._check_head(head_input, logits, r, lo, hi)
                lse = torch.logsumexp(logits[r, lo:hi].detach().float() / self.temperature, -1, keepdim=True)
                row = {"lm_input": copy(head_input[r, lo:hi]), "lse": copy(lse)}
            else:
                # one row at a time: a float32 log-softmax of the whole micro-batch over a 128k
                # vocabulary would add B x T x 0.5 MB to the RL trainer's peak memory (on a GPU the
                # draft-vocabulary rows live until their copies land: B x T x Vd x 4 bytes at most)
                logp = restricted_logp(logits[r, lo:hi].detach(), self.temperature, self.draft_to_target)
                row = {"target_logp": copy(logp)}
            if aux is not None:
                # stored as aux_dtype (bf16): the policy's own on a bf16 policy, no cast at all;
                # a float32 policy's cast runs on the copy stream
                row["aux_hidden"] = copy(aux[r if forward_rows is None else forward_rows[r], lo:hi], self.aux_dtype)
            self.rows[int(i)] = row
        self._copies.mark()
        self._hooks.grabbed.clear()
        self.seconds += time.perf_counter() - t0

class TargetCapture:
    """Runs the target and returns aux hidden states and next-token log-probs, no gradients.

    model: an HF ``*ForCausalLM`` (the target); aux_layer_ids: Eagle-3 aux ids (None: no aux, e.g.
    for the small draft LM); draft_to_target: [Vd] target ids kept by the draft vocabulary (None:
    the whole vocabulary); temperature: the one the target samples at (log-probs are of
    softmax(logits / T)); aux_dtype: storage type of the aux states (bfloat16 halves memory).
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None,
                 draft_to_target: torch.Tensor | None = None, temperature: float = 1.0,
                 aux_dtype: torch.dtype = torch.float32):
        if temperature <= 0:
            raise ValueError(f"capture temperature must be > 0 (got {temperature}); greedy targets "
                             "have no distribution to distil: use a small positive temperature")
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else []
        n = model.config.num_hidden_layers
        bad = [k for k in self.aux_layer_ids if not 0 <= k <= n]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside 0..{n} for this {n}-layer target")
        self.draft_to_target = _subset_or_none(model, draft_to_target)
        self.temperature = temperature
        self.aux_dtype = aux_dtype
        self.forwards = 0  # policy forwards run so far (with a hand-over the adapter runs none)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, attention_mask: [B, T] -> (target_logp [B, T, Vd], aux [B, T, n*H] or None)."""
        self.forwards += 1
        was_training = self.model.training
        self.model.eval()
        try:
            with _AuxHooks(self.model, self.aux_layer_ids) as hooks:
                logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
                aux = hooks.aux()
        finally:
            self.model.train(was_training)
        logp = restricted_logp(logits, self.temperature, self.draft_to_target)  # [B, T, Vd]
        return logp, (aux.to(self.aux_dtype) if aux is not None else None)

    def capture(self, batch: dict[str, torch.Tensor]) -> CapturedBatch:
        """A collated batch (``data.sequences.collate``) -> :class:`CapturedBatch`."""
        logp, aux = self(batch["input_ids"], batch["attention_mask"])
        return CapturedBatch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], logp, aux)


def iter_captured(capture: TargetCapture, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[CapturedBatch]:
    """Stream: one batch is captured, yielded, and dropped before the next is computed."""
    for batch in batches:
        yield capture.capture(batch)
