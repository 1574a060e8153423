"""One small metric-logger interface with TensorBoard, stdout and JSON-lines backends.

Names are namespaced (``train/loss``, ``accept/pos_0``, ``swap/ms``, ``stage/gen_s``). Ratios
should be logged from sums and totals divided at the end, so they stay right across ranks; only
rank 0 writes (pass ``enabled=False`` elsewhere).

    logger = make_logger(["tensorboard", "jsonl", "stdout"], out_dir)
    logger.log_dict({"train/loss": 0.31, "accept/simulated_length": 2.7}, step=100)
    logger.close()
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Mapping, Protocol

BACKENDS = ("tensorboard", "jsonl", "stdout")


class MetricLogger(Protocol):
    def log_dict(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _check_name(name: str) -> None:
    if "/" not in name:
        raise ValueError(f"metric name {name!r} is not namespaced; use e.g. 'train/{name}'")


class StdoutLogger:
    """One line per call: ``step 100 | train/loss 0.3100 | accept/simulated_length 2.70``."""

    def __init__(self, stream=None, keys: tuple[str, ...] | None = None):
        self.stream = stream or sys.stdout
        self.keys = keys  # only these names (all if None)

    def log_dict(self, metrics: Mapping[str, float], step: int) -> None:
        items = [(k, v) for k, v in metrics.items() if self.keys is None or k in self.keys]
        if not items:
            return
        text = " | ".join(f"{k} {_fmt(v)}" for k, v in items)
        print(f"step {step} | {text}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class JsonlLogger:
    """``{"step": 100, "time": ..., "train/loss": 0.31, ...}`` per line, appended (resumes append)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def log_dict(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardLogger:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_dict(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, float(v), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MultiLogger:
    """Fans out to several backends; checks names once; a disabled one (non-zero rank) drops all."""

    def __init__(self, backends: list[MetricLogger], enabled: bool = True):
        self.backends = backends if enabled else []

    def log_dict(self, metrics: Mapping[str, float], step: int) -> None:
        for name in metrics:
            _check_name(name)
        for b in self.backends:
            b.log_dict(metrics, step)

    def log(self, name: str, value: float, step: int) -> None:
        self.log_dict({name: value}, step)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.backends = []


def make_logger(backends: list[str], out_dir: str | Path, enabled: bool = True,
                stdout_keys: tuple[str, ...] | None = None) -> MultiLogger:
    """Backends by name: "tensorboard" (``out_dir/tb``), "jsonl" (``out_dir/metrics.jsonl``), "stdout"."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown logger backend(s) {unknown}; choose from {list(BACKENDS)}")
    out = []
    if enabled:
        out_dir = Path(out_dir)
        for b in backends:
            if b == "tensorboard":
                out.append(TensorBoardLogger(out_dir / "tb"))
            elif b == "jsonl":
                out.append(JsonlLogger(out_dir / "metrics.jsonl"))
            else:
                out.append(StdoutLogger(keys=stdout_keys))
    return MultiLogger(out, enabled)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)
