"""Reduced draft vocabulary: d2t / t2d mapping between draft ids and target ids.

Conventions (as in EAGLE-3 checkpoints and vLLM's Eagle-3 loader):
- ``d2t[i]`` is an *offset*: draft id ``i`` means target id ``i + d2t[i]``; shape [Vd], int64.
- ``t2d[j]`` is a bool mask over the target vocabulary: target id ``j`` is in the draft vocab.
Draft ids are the kept target ids in ascending target order, so the mapping is monotone.
"""

from __future__ import annotations

import torch


def build_vocab_map(counts: torch.Tensor, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``draft_vocab`` most frequent target tokens.

    counts: [Vt] token frequencies (any non-negative numbers). Ties keep the lower id.
    returns d2t [Vd] int64 offsets, t2d [Vt] bool.
    """
    vt = counts.numel()
    if not 0 < draft_vocab <= vt:
        raise ValueError(f"draft_vocab {draft_vocab} must be in 1..{vt} (the target vocab size)")
    # Stable ordering: sort by count descending, then id ascending.
    order = sorted(range(vt), key=lambda j: (-float(counts[j]), j))
    kept = torch.tensor(sorted(order[:draft_vocab]), dtype=torch.int64)  # [Vd] target ids
    d2t = kept - torch.arange(draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] offsets -> [Vd] target ids."""
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, target_vocab: int, where: str) -> None:
    """Raise a ValueError naming ``where`` if the mapping is not a valid injection into the target vocab."""
    ids = draft_to_target_ids(d2t)
    if ids.numel() and (ids.min() < 0 or ids.max() >= target_vocab):
        raise ValueError(
            f"{where}: d2t maps draft ids to target ids outside 0..{target_vocab - 1}; "
            "the draft was built for another target vocabulary (re-export it for this target)"
        )
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{where}: d2t maps two draft ids to one target id; the mapping is corrupt")
    if t2d is not None:
        if t2d.numel() != target_vocab:
            raise ValueError(
                f"{where}: t2d has {t2d.numel()} entries but the target vocab is {target_vocab}; "
                "the draft was built for another target"
            )
        if int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
            raise ValueError(f"{where}: t2d and d2t disagree; the mapping is corrupt")


def target_to_draft_probs(p_target: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Restrict a target distribution to the draft vocabulary.

    p_target: [..., Vt] probabilities -> [..., Vd] (not renormalised: the mass outside the
    draft vocab is what a reduced-vocab draft can never propose).
    """
    return p_target.index_select(-1, draft_to_target_ids(d2t).to(p_target.device))
