"""The adapter's own HF copy of the policy, and the targets it gives the draft.

:class:`PolicyCopy` is the policy as the adapter knows it: loaded once, updated in place with the
RL run's weights (checked before anything is loaded), and the limits a rollout must fit before it
enters the replay buffer (docs/design.md, "Checks at the door"). :class:`Targets` turns replay
items into :class:`CapturedBatch` es: the hand-over's tensors as they are, or captured against
the copy (docs/design.md, "Hand-over").
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from draftadapt.capture.hidden import CapturedBatch, HandOver, TargetCapture, handed_logp
from draftadapt.data.replay import ReplayItem
from draftadapt.data.sequences import Sequence, collate
from draftadapt.tensors import all_finite, load_safetensors


class PolicyCopy:
    """An HF causal LM of the policy, at a known version."""

    def __init__(self, model: nn.Module, policy_dir: str | Path, version: int = 0):
        self.model = model.eval()
        self.dir = Path(policy_dir)
        self.version = version
        # the version whose weights the copy holds: behind ``version`` when the trainer hands
        # over every target and sends no weights (verl's actor); a forward then is refused
        self.weights_version = version
        pc = model.config.get_text_config()
        self.vocab_size = int(pc.vocab_size)
        self.max_positions = int(getattr(pc, "max_position_embeddings", 0) or 0)
        self.hidden_size = int(pc.hidden_size)
        pad = model.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)

    @staticmethod
    def load_model(policy_dir: str | Path) -> nn.Module:
        from transformers import AutoModelForCausalLM

        # the model's own dtype (a bf16 policy stays bf16; captured states are widened for training)
        return AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype="auto")

    def update(self, weights_or_path: str | Path | dict[str, torch.Tensor] | None, version: int) -> None:
        """Load the policy's new weights (a dir, a file or a state dict) in place; None: the
        version moves on with no weights (every target is handed over, nothing is forwarded)."""
        if version < self.version:
            raise ValueError(f"policy version {version} is older than the adapter's {self.version}")
        if weights_or_path is None:
            self.version = version
            return
        if isinstance(weights_or_path, dict):
            sd = weights_or_path
        else:
            p = Path(weights_or_path)
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
            if not files:
                raise FileNotFoundError(f"no *.safetensors policy weights in {p}")
            sd = load_safetensors(files)
        self._check_weights(sd)
        self.model.load_state_dict(sd, strict=False)
        self.version = self.weights_version = version

    def load_shared(self, tensors: dict[str, torch.Tensor]) -> None:
        """The policy tensors a hand-over carried (what the draft shares with the policy, e.g. the
        embeddings), loaded in place: names, shapes and finiteness checked first."""
        ref = self.model.state_dict()
        bad = [f"{k} {tuple(v.shape)}" for k, v in tensors.items() if k not in ref or ref[k].shape != v.shape]
        if bad:
            raise ValueError(f"hand-over: shared policy tensors {bad[:4]} do not fit the adapter's copy of {self.dir} "
                             f"(names and shapes of its HF state dict)")
        nonfinite = [k for k, v in tensors.items() if not all_finite(v)]
        if nonfinite:
            raise ValueError(f"hand-over: shared policy tensors {nonfinite[:4]} hold NaN or Inf; not loaded")
        self.model.load_state_dict(tensors, strict=False)

    def _check_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Names, shapes, dtypes and finiteness, all before anything is loaded: a refused update
        leaves the copy as it was."""
        ref = self.model.state_dict()
        missing = [k for k in ref if k not in sd and "rotary" not in k]
        unexpected = [k for k in sd if k not in ref]
        wrong = [f"{k} {tuple(v.shape)} (needs {tuple(ref[k].shape)})" for k, v in sd.items()
                 if k in ref and tuple(v.shape) != tuple(ref[k].shape)]
        if missing or unexpected or wrong:
            raise ValueError(
                f"policy weights do not fit the adapter's copy of {self.dir}: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}, wrong shape {wrong[:4]}; pass the HF state dict of the same architecture"
            )
        not_float = [k for k, v in sd.items() if ref[k].is_floating_point() and not v.is_floating_point()]
        if not_float:
            raise ValueError(f"policy weights {not_float[:4]} are not floating point; pass the model's own tensors")
        bad = [k for k, v in sd.items() if not all_finite(v)]
        if bad:
            raise ValueError(f"policy weights {bad[:4]} hold NaN or Inf; not loaded, the adapter keeps version "
                             f"{self.version}")

    def check_rollout(self, i: int, s: Sequence, extra: dict[str, torch.Tensor] | None,
                      aux_layer_ids: list[int]) -> None:
        """Refuse rollout ``i`` (ValueError naming it) unless its token ids fit this policy and its
        handed-over tensors have one row per token (aux states: ``aux_layer_ids`` wide, finite)."""
        ids = torch.as_tensor(s.prompt_ids + s.response_ids)
        if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise ValueError(f"observe: rollout {i} has token ids of dtype {ids.dtype}; pass integer ids")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.numel():
            raise ValueError(f"observe: rollout {i} has token ids {bad[:4].tolist()} outside the policy's vocabulary "
                             f"(0..{self.vocab_size - 1}); pass the ids the engine returned")
        if self.max_positions and len(ids) > self.max_positions:
            raise ValueError(f"observe: rollout {i} has {len(ids)} tokens, over the policy's max_position_embeddings "
                             f"{self.max_positions}; truncate it or drop it")
        width = len(aux_layer_ids) * self.hidden_size
        for name, t in (extra or {}).items():
            if t.dim() != 2 or t.shape[0] != len(ids):
                raise ValueError(f"observe: {name} of rollout {i} has shape {tuple(t.shape)}; it needs one row per "
                                 f"token of prompt + response ({len(ids)})")
            if name == "aux_hidden" and t.shape[1] != width:
                raise ValueError(f"observe: aux_hidden of rollout {i} is {t.shape[1]} wide; this draft reads "
                                 f"aux layers {aux_layer_ids} of the policy, {width} wide together")
            if name == "lm_input" and t.shape[1] != self.hidden_size:
                raise ValueError(f"observe: lm_input of rollout {i} is {t.shape[1]} wide; the policy's output head "
                                 f"reads {self.hidden_size}")
            # log-probs may be -inf
            finite = all_finite(t) if name in ("aux_hidden", "lm_input", "lse") else not bool(torch.isnan(t).any())
            if not finite:
                raise ValueError(f"observe: {name} of rollout {i} holds NaN or Inf; not added")


class Targets:
    """What the draft learns to match for a batch of replay items. ``mode`` "sampling": handed-over
    tensors as they are (the policy that sampled them); "current": captured against the copy."""

    def __init__(self, policy: PolicyCopy, capture: TargetCapture, mode: str, store: str = "logp"):
        self.policy = policy
        self.capture = capture
        self.mode = mode
        self.store = store
        # store="hidden": per policy version held in the buffer, the output head the hand-over's
        # forward ran (draft-vocabulary rows), to recompute its log-probs from
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def handover(self, model: nn.Module, subset=None) -> HandOver:
        """A :class:`HandOver` for the RL trainer's own forward of ``model`` (the draft's aux layers
        and vocabulary, at the capture's temperature; ``subset``: the rollouts to keep)."""
        return HandOver(model, self.capture.aux_layer_ids, self.capture.draft_to_target, self.capture.temperature,
                        store=self.store, subset=subset)

    def handed_over(self, it: ReplayItem) -> bool:
        return self.mode == "sampling" and ("target_logp" in it.tensors or "lm_input" in it.tensors)

    def keep_heads(self, head: tuple[torch.Tensor, torch.Tensor | None] | None, version: int,
                   versions_held: set[int]) -> None:
        """A hand-over's head for ``version``; heads of versions the buffer no longer holds go."""
        if head is not None:
            self.heads[version] = head
        for v in [v for v in self.heads if v not in versions_held]:
            del self.heads[v]

    def _logp(self, it: ReplayItem) -> torch.Tensor:
        if "target_logp" in it.tensors:
            return it.tensors["target_logp"]
        return handed_logp(it.tensors["lm_input"], it.tensors["lse"], self.heads[it.policy_version],
                           self.capture.temperature)

    def batch(self, items: list[ReplayItem]) -> CapturedBatch:
        """One training or scoring batch: the handed-over targets as they are, or captured against
        the current policy copy (aux states handed over without log-probs replace the recomputed
        ones where that same policy version produced them)."""
        batch = collate([it.sequence() for it in items], self.policy.pad_id)
        if all(self.handed_over(it) for it in items):
            width = batch["input_ids"].shape[1]
            return CapturedBatch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                 _pad_rows([self._logp(it) for it in items], width),
                                 _pad_rows([it.tensors.get("aux_hidden") for it in items], width))
        if self.policy.weights_version != self.policy.version:
            raise ValueError(f"the adapter's policy copy holds the weights of version {self.policy.weights_version}, "
                             f"not {self.policy.version} (the trainer sent none): a batch not all handed over "
                             f"({sum(not self.handed_over(it) for it in items)} of {len(items)} items) would be "
                             "captured against a stale policy; hand over every rollout (targets='sampling'), "
                             "or pass the policy's weights to update_policy")
        captured = self.capture.capture(batch)
        if captured.aux is not None:
            for r, it in enumerate(items):
                h = it.tensors.get("aux_hidden")
                if h is not None and it.policy_version == self.policy.version:
                    captured.aux[r, : h.shape[0]] = h.to(captured.aux.dtype)
        return captured

    def batches(self, items: list[ReplayItem], size: int) -> list[CapturedBatch]:
        """Scoring batches of ``items``, shortest to longest (a score sums over every sequence, so
        the order is free, and batches of like lengths pad least)."""
        items = sorted(items, key=lambda it: it.num_tokens)
        return [self.batch(items[i: i + size]) for i in range(0, len(items), size)]


def _pad_rows(rows: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Per-sequence [n_i, D] tensors -> [B, width, D] float32, zero past each row's end."""
    if rows[0] is None:
        return None
    out = torch.zeros((len(rows), width, rows[0].shape[-1]), dtype=torch.float32)
    for r, t in enumerate(rows):
        out[r, : t.shape[0]] = t
    return out
