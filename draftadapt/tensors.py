"""Checks on tensors shared by the engine's worker, the adapter and the trainer."""

from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: its min and max are finite (NaN propagates through both). One
    reduction pass and no mask tensor: ``isfinite(t).all()`` took 809 ms on 150M bf16 elements
    here, this 21 ms (docs/design.md, "Weight path"). Non-float tensors are finite."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
