"""Captured batches on disk: capture once, train several epochs, hold one batch in RAM at a time.

One safetensors file per batch (``<key>.safetensors``), written atomically (temp file + rename),
so an interrupted run leaves only complete shards and a resumed one reuses them. Floating
tensors are stored in ``dtype`` (float16 halves disk and read time; the aux states and log-probs
lose nothing a draft can learn from) and come back as float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftadapt.capture.hidden import CapturedBatch
from draftadapt.fileio import atomic_path

_FIELDS = ("input_ids", "attention_mask", "loss_mask", "target_logp", "aux")


class CaptureStore:
    def __init__(self, root: str | Path, dtype: torch.dtype = torch.float16):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype

    def path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def save(self, key: str, batch: CapturedBatch) -> None:
        tensors = {}
        for name in _FIELDS:
            t = getattr(batch, name)
            if t is None:
                continue
            if t.is_floating_point():
                t = t.to(self.dtype)
            elif t.dtype == torch.bool:
                t = t.to(torch.uint8)  # safetensors has bool, but uint8 keeps readers simple
            tensors[name] = t.contiguous().cpu()
        with atomic_path(self.path(key), durable=False) as tmp:  # a cache: rebuilt if a crash loses it
            save_file(tensors, str(tmp))

    def load(self, key: str) -> CapturedBatch:
        t = load_file(str(self.path(key)))
        return CapturedBatch(
            input_ids=t["input_ids"].long(),
            attention_mask=t["attention_mask"].long(),
            loss_mask=t["loss_mask"].bool(),
            target_logp=t["target_logp"].float(),
            aux=t["aux"].float() if "aux" in t else None,
        )

    def get(self, key: str, make) -> CapturedBatch:
        """The stored batch ``key``, or ``make()`` captured now and stored."""
        if self.has(key):
            return self.load(key)
        batch = make()
        self.save(key, batch)
        return batch
