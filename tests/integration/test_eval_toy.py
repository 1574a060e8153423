"""`draftadapt eval`: one JSON object with measured (vLLM) and simulated acceptance and speed.

The draft is the quickly trained Eagle-3 head of tests/integration/conftest.py; the eval CLI
then starts the engine with and without it.
"""

from __future__ import annotations

import json

import pytest

from .conftest import last_json, run_eval

pytestmark = pytest.mark.integration

KEYS = {"acceptance_length_measured", "acceptance_length_simulated", "per_position_acceptance",
        "tokens_per_s_spec", "tokens_per_s_plain", "speedup"}


def test_eval_prints_one_json_object_with_the_keys(trained_head, toy_target):
    proc = run_eval(toy_target, trained_head, "--k", "3", "--temperature", "1.0", "--num-prompts", "32",
                    "--max-tokens", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = last_json(proc)
    print(json.dumps(result))  # with -s: the numbers the bounds below were set from
    assert KEYS <= set(result)
    assert len(result["per_position_acceptance"]) == 3
    measured, simulated = result["acceptance_length_measured"], result["acceptance_length_simulated"]
    # Measured here (32 prompts x 64 tokens, k=3): an untrained head 1.02, this 30-step head 1.77
    # (a fully pretrained one 3.56, docs/results.md). The bar is halfway: a draft that is not the one
    # trained (lost weights, EAGLE vs Eagle-3 mismatch) serves without an error and lands near 1.0.
    assert measured > 1.4 and simulated > 1.4, (measured, simulated)
    pos = result["per_position_acceptance"]  # measured: position i counts only after 0..i-1 were accepted
    assert pos[0] >= pos[1] >= pos[2] and measured == pytest.approx(1.0 + sum(pos), abs=1e-3)
    # The offline estimate models what vLLM does (greedy drafts, walk over visited starts) on the
    # same rollouts, so only float near-ties between vLLM's kernels and HF's differ: measured 0.03%
    # apart here, 0.3% (Eagle-3) and 1.4% (draft LM) for pretrained drafts (docs/results.md). 3% is twice
    # the worst seen; a scorer that walks other starts than vLLM's is off by more (all starts:
    # 1.69 against 1.77 here).
    assert simulated == pytest.approx(measured, rel=0.03)
    assert result["tokens_per_s_spec"] > 0 and result["tokens_per_s_plain"] > 0
    assert result["speedup"] == pytest.approx(result["tokens_per_s_spec"] / result["tokens_per_s_plain"], rel=0.01)
    # --precision auto (the default): the toy is 128 wide, below where bf16 pays on any CPU
    assert result["engine_dtype"] == "float32"


def test_eval_refuses_a_draft_for_another_target(trained_head, known_target):
    proc = run_eval(known_target, trained_head, "--json", timeout=300)
    assert proc.returncode == 2
    # the exact error check_draft_for_target raises, with the fix it names
    assert f"error: {trained_head} was exported for another target (" in proc.stderr, proc.stderr[-3000:]
    assert f"`draftadapt draft init --target {known_target}`" in proc.stderr, proc.stderr[-3000:]
