"""Checks on tensors shared by the engine's worker, the adapter and the trainer, and the one
reader of policy weights from safetensors files."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: its min and max are finite (NaN propagates through both). One
    reduction pass and no mask tensor: ``isfinite(t).all()`` took 809 ms on 150M bf16 elements
    here, this 21 ms (docs/design.md, "Weight path"). Non-float tensors are finite."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def load_safetensors(files: Iterable[str | Path]) -> dict[str, torch.Tensor]:
    """One checkpoint's tensors from its safetensors files (HF shards), merged into one state
    dict. Which files make the checkpoint is the caller's to say: a spool manifest lists them,
    a model directory is globbed."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd
