"""The README's commands, run as a user runs them (a fresh process, the documented flags),
with shortened settings. A README command that breaks fails here, not in a user's terminal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftadapt.drafts.init import init_draft

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def last_json_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trl_recipe_runs_as_the_readme_shows(toy_target, tmp_path):
    """`python recipes/trl_grpo_toy.py --out DIR --steps N --toy T --draft D` (README, "TRL"):
    TRL's own GRPOTrainer with the draft adapted, its summary and its one-line result."""
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "trl"
    proc = subprocess.run(
        [sys.executable, "recipes/trl_grpo_toy.py", "--out", str(out), "--steps", "2", "--toy", str(toy_target),
         "--draft", str(draft), "prompts_per_step=8", "group_size=4", "micro_batch=16", "max_tokens=48",
         "eval_prompts=8", "baseline_steps=1", "adapter.schedule.every_n_steps=1",
         "adapter.schedule.train_steps=2", "adapter.train.batch_size=8", "adapter.schedule.min_sequences=8"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    line = last_json_line(proc)
    assert line["steps"] == 2 and line["out"] == str(out)
    s = json.loads((out / "summary.json").read_text())
    assert s["framework"].startswith("trl 1.16")
    for arm in ("frozen", "adapted"):
        per_step = s["arms"][arm]["acceptance_length_per_step"]
        assert len(per_step) == 2 and all(1.0 <= a <= 4.0 for a in per_step), per_step
    # the adapter ran a round on every step and the engine served what it published
    assert s["drafts"]["published"] >= 1 and s["drafts"]["swapped_in"] == s["drafts"]["published"]
    # the starting draft is the store's version 1; each publish adds one
    assert s["drafts"]["final_version"] == 1 + s["drafts"]["published"]
    e = s["end_to_end"]
    assert e["rl_step_s"] == pytest.approx(e["trl_step_s"] + e["sync_s"] + e["adapt_s"], rel=1e-9)
    assert set(s["without_draftadapt"]) == {"trl_generate", "vllm_no_spec"}
    assert s["tensorboard"], "TRL wrote no TensorBoard events"
