"""The hand-over from verl's own actor: verl's FSDP engine, which keeps the draft's targets from
the log-prob forward verl already runs (docs/design.md, "verl on CPU", "The hand-over").

:class:`HandOverFSDPEngine` is verl's ``FSDPEngineWithLMHead`` registered through verl's engine
registry (``EngineRegistry``, model type ``language_model``, backends fsdp and fsdp2) for the
devices ``cpu`` and ``cuda`` under the vendor :data:`VENDOR`; verl picks it when
``VERL_ENGINE_VENDOR=draftadapt`` is set (``EngineRegistry.get_engine_cls`` reads it in every
worker). It computes exactly what verl's engine computes; only when a log-prob batch carries the
adapter's request (:data:`REQUEST`, put in the batch's ``extra_info`` by draftadapt's trainer
before ``compute_log_prob``) does it also keep, for the rows the request picks on this rank, the
aux layers' states and the log-probs of the very logits verl's forward produced
(:class:`~draftadapt.capture.hidden.HandOver`), and the policy tensors the draft shares (its
embeddings). Those go into Ray's object store from this worker (``ray.put``); the trainer takes
the references with :func:`take_handed_over` on every actor worker and the adapter reads them:
no file, no second forward.

verl imports this module in each of its processes through draftadapt's trainer module
(``VERL_USE_EXTERNAL_MODULES``), which registers the engine at import.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from typing import Any

import torch

# first: the cpu platform verl's device lookups need (as the trainer module)
from draftadapt.integrations.verl import cpu as _cpu  # noqa: F401
from draftadapt.integrations.verl.handover import REQUEST, VENDOR, HandOverRequest
from verl.utils import tensordict_utils as tu
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

# references to what this worker handed over since the trainer last took them (ray.put here)
_OUTBOX: list[Any] = []
# which of a log-prob batch's rows this rank keeps for the adapter (bool per row), split with the
# batch into micro-batches (and reordered with it when verl balances by tokens)
_KEEP_FIELD = "draftadapt_keep"


def take_handed_over(_worker=None) -> list:
    """The object references this process handed over since the last call (run in each actor
    worker through Ray's ``__ray_call__``); a list, so Ray passes the references, not the rows."""
    out, _OUTBOX[:] = list(_OUTBOX), []
    return out


def _hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM inside verl's FSDP module (FSDP1 wraps it; FSDP2 shards it in place)."""
    return getattr(module, "_fsdp_wrapped_module", module)


def _state_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, m in model.named_modules():
        if m is target:
            return name.replace("_fsdp_wrapped_module.", "")
    raise ValueError(f"{type(target).__name__} is not a module of {type(model).__name__}")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor on the host: FSDP2 keeps each as a DTensor shard (gathered here,
    a collective every data-parallel rank runs in the same log-prob pass)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.to("cpu", copy=True)


class HandOverFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine with the adapter's hand-over in its log-prob pass (module docstring)."""

    _da_ho = None  # the hand-over of the log-prob pass running now
    _da_tokens: list[list[int]] = []
    _da_logits: torch.Tensor | None = None

    def infer_batch(self, data, loss_function=None):
        raw = tu.get_non_tensor_data(data=data, key=REQUEST, default=None)
        if raw is None:
            return super().infer_batch(data, loss_function=loss_function)
        req = HandOverRequest.from_dict(raw)
        if tu.get_non_tensor_data(data=data, key="use_fused_kernels", default=False):
            raise ValueError("draftadapt's hand-over reads the log-prob forward's logits, which verl's fused kernels "
                             "never form: set actor_rollout_ref.model.use_fused_kernels=false, or run without "
                             "+draftadapt.handover")
        if req.store != "logp":
            raise ValueError(f"draftadapt's hand-over from verl's FSDP actor keeps log-probs (handover_store='logp'); "
                             f"handover_store={req.store!r} reads the output head's weight, which FSDP holds in shards: "
                             "set adapter.handover_store=logp")
        if self.use_ulysses_sp:
            raise ValueError("draftadapt's hand-over reads whole sequences from the log-prob forward; with Ulysses "
                             "sequence parallelism each rank holds a slice: set ulysses_sequence_parallel_size=1, "
                             "or run without +draftadapt.handover")
        from draftadapt.capture.hidden import HandOver

        n = len(data)
        keep = torch.zeros(n, dtype=torch.bool)
        rng = random.Random(req.seed * 1000003 + self.get_data_parallel_rank())
        picked = range(n) if req.rows_per_rank is None else rng.sample(range(n), min(n, req.rows_per_rank))
        keep[list(picked)] = True
        data[_KEEP_FIELD] = keep
        model = _hf_model(self.module)
        d2t = None if req.draft_to_target is None else torch.tensor(req.draft_to_target, dtype=torch.long)
        ho = HandOver(model, req.aux_layer_ids, d2t, req.temperature, store=req.store)
        with ExitStack() as stack:
            stack.enter_context(ho)
            handle = self.module.register_forward_hook(self._da_keep_logits)
            stack.callback(handle.remove)
            self._da_ho, self._da_tokens = ho, []
            try:
                out = super().infer_batch(data, loss_function=loss_function)
            finally:
                self._da_ho, self._da_logits = None, None
                del data[_KEEP_FIELD]
        shared = {}
        if req.shared:
            mods = {"input_embeddings": model.get_input_embeddings(), "output_embeddings": model.get_output_embeddings()}
            for key in req.shared:
                m = mods[key]
                shared[f"{_state_name(model, m)}.weight"] = _full(m.weight)
        if self.get_data_parallel_rank() != 0:
            shared = {}  # every rank gathered (a collective); one sends
        import ray

        handed = ho.detach()
        handed.shared = shared
        _OUTBOX.append(ray.put({"tokens": self._da_tokens, "handover": handed,
                                "dp_rank": self.get_data_parallel_rank()}))
        self._da_tokens = []
        return out

    def _da_keep_logits(self, _module, _inputs, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        self._da_logits = logits.detach()

    def forward_step(self, micro_batch, loss_function, forward_only):
        ho = self._da_ho
        out = super().forward_step(micro_batch, loss_function, forward_only)
        if ho is None:
            return out
        keep = micro_batch[_KEEP_FIELD].bool().tolist()
        ids = micro_batch["input_ids"]  # nested: one run of prompt + response tokens per row
        offsets = ids.offsets().tolist()
        values = ids.values()
        logits, self._da_logits = self._da_logits, None
        rows = [j for j, k in enumerate(keep) if k]
        index = list(range(len(self._da_tokens), len(self._da_tokens) + len(rows)))
        self._da_tokens.extend(values[offsets[j]: offsets[j + 1]].tolist() for j in rows)
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            ho.add_packed(index, logits, offsets, rows=rows)  # one packed row
        else:  # right padded, one row per sequence (verl's to_padded_tensor)
            lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])])
            mask = torch.arange(logits.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
            ho.add(index, logits, mask, rows=rows)
        return out


EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=["cpu", "cuda"],
                        vendor=VENDOR)(HandOverFSDPEngine)
