"""Engines for the integration tests: real vLLM on CPU, started once and shared."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from draftadapt.engine.rollout import RolloutEngine


def start_engine(target: Path, draft: Path | None = None, method: str = "eagle3", k: int = 3, **kw) -> RolloutEngine:
    return RolloutEngine(target, draft, method=method, num_speculative_tokens=k, max_model_len=256,
                         max_num_seqs=64, kv_cache_gib=1, seed=0, **kw)


def stop_engine(engine: RolloutEngine) -> None:
    engine.close()
    gc.collect()


@pytest.fixture(scope="session")
def plain_engine(toy_target):
    """The toy target served without speculation: the reference for greedy equality and speed."""
    engine = start_engine(toy_target)
    yield engine
    stop_engine(engine)


def toy_prompts(target: Path, n: int) -> list[str]:
    from draftadapt.toy.task import load_heldout

    return [p["prompt"] for p in load_heldout(target / "heldout.jsonl")[:n]]
