"""`draftadapt demo` end to end, shortened: a real GRPO loop, real vLLM engines, the adapter attached."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from draftadapt.drafts.init import init_draft

pytestmark = pytest.mark.integration


def test_demo_smoke(toy_target, tmp_path):
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "draftadapt.cli", "demo", "--out", str(out), "--steps", "3",
           "--toy", str(toy_target), f"draft={draft}", "grpo.prompts_per_step=4", "grpo.group_size=4",
           "eval.prompts=8", "adapter.schedule.train_steps=2", "adapter.batch_size=8",
           "adapter.schedule.min_sequences=8", "grpo.max_tokens=64", "eval.max_tokens=64",
           "pretrain_prompts=48", "fresh_max_minutes=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["steps"] == 3
    summary = json.loads((out / "summary.json").read_text())
    for arm in ("plain", "frozen", "adapted"):
        assert len(summary["arms"][arm]["acceptance_length_per_step"]) == 3
        assert summary["arms"][arm]["mean_tokens_per_s"] > 0
    for arm in ("frozen", "adapted"):
        assert all(1.0 <= a <= 4.0 for a in summary["arms"][arm]["acceptance_length_per_step"])
    assert len(summary["reward_per_step"]) == 3
    assert (out / "acceptance.png").stat().st_size > 1000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    for name in ("accept/length", "accept/pos_0", "accept/simulated_length", "draft/version",
                 "draft/age_policy_versions", "train/loss", "stage/gen_s", "stage/train_s", "stage/adapt_s"):
        assert name in keys, name
    assert list((out / "tb").glob("events.out.tfevents*"))
    # the reference: a fresh draft pretrained on the final policy, measured in the same engine
    fresh = summary["fresh_final"]
    assert 1.0 <= fresh["acceptance_length"] <= 4.0
    assert 1.0 <= fresh["adapted_final_acceptance"] <= 4.0
    assert (out / "draft_fresh_final" / "draftadapt.json").is_file()
    assert "adapted_over_fresh_final_acceptance" in last
