"""The draft's forward pass for training and scoring, as ``nn.Module.forward``.

Data parallel wrappers (DDP, DeepSpeed engines) hook ``forward``: the Eagle-3 unroll must run
through it, not through a side method, or gradients are not reduced across ranks. Both modules
return *step logits* in one convention (see ``metrics.acceptance.simulate_acceptance``):
``step_logits[i][:, t]`` are the draft's logits for token t + i + 2, i.e. position i of a draft
made right after token t + 1 became known. Which wrapper a draft gets, and how each is called,
is its method's answer (``train/methods.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from draftadapt.drafts.eagle3 import Eagle3Head
from draftadapt.metrics.acceptance import shift_left


class Eagle3TTT(nn.Module):
    """An Eagle-3 head unrolled ``steps`` deep with training-time test (EAGLE-3, section 3.2).

    The head's own outputs replace the target's features from step 1 on (``Eagle3Head.unroll``:
    step i at slot t attends to the step-0 keys up to t and to its own step-1..i keys at t, the
    keys vLLM's draft KV cache holds). Token inputs at step i (``feed``):

    - "data" (default): the sequence's own tokens t + 2 .. t + i + 1. A proposal only matters if
      every earlier one was accepted, and then the earlier proposals *are* those tokens, so this is
      the conditioning that acceptance depends on; it also keeps the target distribution (computed
      on the data prefix) consistent with the draft's input.
    - "argmax": the head's own argmax at the previous step (the literal inference-time input).
    """

    def __init__(self, head: Eagle3Head, steps: int, feed: str = "data", pad_id: int = 0):
        super().__init__()
        if steps < 1:
            raise ValueError(f"TTT depth must be >= 1, got {steps}")
        if feed not in ("data", "argmax"):
            raise ValueError(f"unknown TTT feed {feed!r}; use 'data' or 'argmax'")
        self.head = head
        self.steps = steps
        self.feed = feed
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int | None = None,
                slots: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                features: bool = False) -> list[torch.Tensor]:
        """input_ids: [B, T] sequence tokens; aux: [B, T, n*H] -> ``steps`` x [B, T, Vd] (steps >= 1
        at ``slots`` [B, M] only when given: [B, M, Vd]; ``segments``: a packed batch's sequence
        ids; ``features``: lm_head's input [.., H] instead of the logits; see ``Eagle3Head.unroll``)."""
        ids = shift_left(input_ids, 1, self.pad_id)  # slot t consumes token t + 1
        feed = None
        if self.feed == "data":
            def feed(j, _logits):  # ids fed at step j + 1: token t + j + 2
                return shift_left(input_ids, j + 2, self.pad_id)
        return self.head.unroll(ids, aux.to(self.head.feature_dtype), steps or self.steps, feed_ids=feed, slots=slots,
                                segments=segments, features=features)


class DraftLMForward(nn.Module):
    """A small draft LM (HF causal LM), teacher-forced; step i reuses the logits one position on."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] -> logits [B, T, V] (position t predicts token t + 1)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def lm_step_logits(logits: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Teacher-forced LM logits [B, T, V] -> k step logits: step i at slot t = logits at t + i + 1.

    With the data tokens as the earlier proposals a draft LM's i-th proposal after token t + 1 is
    simply its prediction at position t + i + 1.
    """
    return [shift_left(logits, i + 1, 0.0) for i in range(k)]
