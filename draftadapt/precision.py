"""Which float precision pays on this machine: one rule for the adapter's trainer, the demo's
policy update and the rollout engines (docs/design.md, "Precision").

On a CPU, bf16 pays where the cores multiply bf16 in hardware (AMX tiles, or avx512_bf16's dot
products) and the matrices are wide enough for that to outrun the casts around it. Measured on an
Intel Xeon with AMX-BF16 (2 cores, docs/results.md "bf16 on a CPU that has it"): one Eagle-3
optimizer step in bf16 autocast took 1.06-1.34x float32's at the toy's width (128), 0.63-0.77x at
SmolLM2's (576), 0.58x at 1b widths (2048); vLLM 0.32 decoding SmolLM2 in bf16 took 0.58-0.85x
float32's step at 1-32 sequences (docs/results.md, "The engine in bf16"). On an AMD EPYC with
avx512_bf16 and no AMX (docs/results.md, "bf16 on an EPYC without AMX"): the Eagle-3 step 0.54-0.55x
at 576 and 0.59x at 2048, the SmolLM2 policy's micro-batch 0.49-0.54x, vLLM's plain SmolLM2 step
0.63-0.76x at 8-32 sequences and 0.57x at 64; on a Zen 4 EPYC (docs/results.md, "bf16 on a Zen 4
EPYC") 0.61-0.67x, 0.59-0.66x and 0.52-0.77x at 1-64 sequences, each against float32 on the same
machine."""

from __future__ import annotations

from pathlib import Path

import torch

BF16_CPU_MIN_WIDTH = 512
PRECISIONS = ("auto", "bf16", "fp32")


def cpu_has_bf16() -> bool:
    """This CPU multiplies bf16 in hardware: AMX tiles or avx512_bf16."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def cpu_bf16_pays(width: int) -> bool:
    """bf16 on this CPU for matmuls ``width`` wide: :func:`cpu_has_bf16` and width >= BF16_CPU_MIN_WIDTH."""
    return cpu_has_bf16() and width >= BF16_CPU_MIN_WIDTH


def engine_dtype(precision: str, target: str | Path) -> str | None:
    """The dtype a rollout engine serves ``target`` in, for a precision setting: "bf16" ->
    "bfloat16", "fp32" -> "float32", "auto" -> "bfloat16" on a CPU-only machine where
    :func:`cpu_bf16_pays` for the target's hidden size, else None (the target's own dtype; on a GPU
    that is what the checkpoint says). vLLM casts a float32 checkpoint as it loads it, and every
    policy update casts as it lands (RolloutEngine.update_policy), so the build stays as it is."""
    if precision not in PRECISIONS:
        raise ValueError(f"engine precision {precision!r}: use 'auto' (bf16 where this CPU multiplies it in "
                         "hardware and the model is wide enough, else the model's own dtype), 'bf16' or 'fp32'")
    if precision != "auto":
        return {"bf16": "bfloat16", "fp32": "float32"}[precision]
    if torch.cuda.is_available():
        return None
    from draftadapt.drafts.formats import read_hf_config

    cfg = read_hf_config(target)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    width = int(cfg.get("hidden_size") or text.get("hidden_size") or 0)
    return "bfloat16" if cpu_bf16_pays(width) else None


def served_dtype(precision: str, target: str | Path) -> str:
    """The dtype name the engines serve ``target`` in: :func:`engine_dtype`, with None resolved to
    the target's own (what RolloutEngine does with it), for summaries and reports."""
    from draftadapt.drafts.formats import model_dtype

    return engine_dtype(precision, target) or model_dtype(target)
