"""What a draft learns from: the target's aux hidden states and next-token distributions.

Computed from an HF transformers copy of the target (the policy), one batch at a time: callers
stream batches through :func:`iter_captured` and drop each after use, so memory is bounded by
one batch however large the dataset.

Aux layer indexing matches vLLM (DESIGN.md): aux id k is the residual stream after k decoder
layers, 0 being the embeddings. For k < L that is HF's ``hidden_states[k]``; for k = L vLLM takes
the stream *before* the final norm while HF's ``hidden_states[L]`` is after it, so we read every
id with forward hooks on the embedding and on decoder layer k - 1 instead of trusting
``output_hidden_states``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Iterator

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

    def to(self, device) -> "CapturedBatch":
        return CapturedBatch(**{f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                for f in fields(self) for v in [getattr(self, f.name)]})

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


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
        self.draft_to_target = draft_to_target
        self.temperature = temperature
        self.aux_dtype = aux_dtype

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, attention_mask: [B, T] -> (target_logp [B, T, Vd], aux [B, T, n*H] or None)."""
        grabbed: dict[int, torch.Tensor] = {}
        hooks = []

        def keep(k):
            def hook(_module, _inputs, output):
                grabbed[k] = (output[0] if isinstance(output, tuple) else output).detach()
            return hook

        layers = decoder_layers(self.model)
        for k in self.aux_layer_ids:
            module = self.model.get_input_embeddings() if k == 0 else layers[k - 1]
            hooks.append(module.register_forward_hook(keep(k)))
        was_training = self.model.training
        self.model.eval()
        try:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
            self.model.train(was_training)
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # [B, T, Vt]
        if self.draft_to_target is not None:
            logp = logp.index_select(-1, self.draft_to_target.to(logp.device))  # [B, T, Vd]
        aux = None
        if self.aux_layer_ids:
            aux = torch.cat([grabbed[k] for k in self.aux_layer_ids], dim=-1).to(self.aux_dtype)
        return logp, aux

    def capture(self, batch: dict[str, torch.Tensor]) -> CapturedBatch:
        """A collated batch (``data.sequences.collate``) -> :class:`CapturedBatch`."""
        logp, aux = self(batch["input_ids"], batch["attention_mask"])
        return CapturedBatch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], logp, aux)


def iter_captured(capture: TargetCapture, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[CapturedBatch]:
    """Stream: one batch is captured, yielded, and dropped before the next is computed."""
    for batch in batches:
        yield capture.capture(batch)
