"""The README's commands, run as a user runs them (a fresh process, the documented flags),
with shortened settings. A README command that breaks fails here, not in a user's terminal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftadapt.draft_init import init_draft

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def last_json_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trl_recipe_runs_as_the_readme_shows(toy_target, tmp_path):
    """`python recipes/trl_grpo_toy.py --out DIR --steps N --toy T --draft D` (README, "Inside TRL"):
    TRL's own GRPOTrainer with the draft adapted, its summary and its one-line result."""
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "trl"
    proc = subprocess.run(
        [sys.executable, "recipes/trl_grpo_toy.py", "--out", str(out), "--steps", "2", "--toy", str(toy_target),
         "--draft", str(draft), "prompts_per_step=8", "group_size=4", "micro_batch=16", "max_tokens=48",
         "eval_prompts=8", "baseline_steps=1", "adapter.schedule.every_n_steps=1",
         "adapter.schedule.train_steps=2", "adapter.train.batch_size=8", "adapter.schedule.min_sequences=8",
         "adapter.schedule.max_train_steps=0", "adapter.schedule.max_share=0", "adapter.train.warmup_steps=0",
         "online_k.batch_sizes=[1,8]", "online_k.repeats=1", "online_k.calibrate_tokens=8",
         "online_k.step_aside=false"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    line = last_json_line(proc)
    assert line["steps"] == 2 and line["out"] == str(out)
    s = json.loads((out / "summary.json").read_text())
    assert s["framework"].startswith("trl 1.16")
    # online k by default: the k table measured on the first batch, re-chosen every step; with
    # step_aside=false the table keeps a draft somewhere, so the drafter never idles and the
    # adapter is never paused (stepping aside in TRL: tests/e2e/test_smollm2.py)
    assert s["k_policy"] == "online" and s["online_k"]["calibrate_seconds"] > 0
    assert line["drafter_idle_steps"] == 0 and s["online_k"]["adapter_paused_per_step"] == [0.0, 0.0], s["online_k"]
    for arm in ("frozen", "adapted"):  # measured at k=3 whatever the table
        per_step = s["arms"][arm]["acceptance_length_per_step"]
        assert len(per_step) == 2 and all(1.0 <= a <= 4.0 for a in per_step), per_step
    # the adapter ran a round on every step and the engine served what it published
    assert s["drafts"]["published"] >= 1 and s["drafts"]["swapped_in"] == s["drafts"]["published"]
    # the starting draft is the store's version 1; each publish adds one
    assert s["drafts"]["final_version"] == 1 + s["drafts"]["published"]
    adapted = s["arms"]["adapted"]["acceptance_length_per_step"]
    w = s["whole_run"]
    assert w["adapted_worst_over_start"] == pytest.approx(min(adapted) / adapted[0], rel=1e-9)
    assert line["adapted_retention"] == pytest.approx(w["adapted_retention"], abs=6e-4)
    e = s["end_to_end"]
    assert e["rl_step_s"] == pytest.approx(e["trl_step_s"] + e["sync_s"] + e["adapt_s"], rel=1e-9)
    assert set(s["without_draftadapt"]) == {"trl_generate", "vllm_no_spec"}
    assert s["tensorboard"], "TRL wrote no TensorBoard events"


def test_demo_on_a_ray_fleet_of_two_engines(toy_target, tmp_path):
    """`draftadapt demo engines=2` (README, "Past one machine"): the RL batch split over two engine
    actors on a local Ray cluster, the adapter in its own actor; every step both engines serve the
    same draft version, the newest published, and each broadcast's time is in the summary."""
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "draftadapt.cli", "demo", "--out", str(out), "--steps", "3", "--toy", str(toy_target),
         f"draft={draft}", "engines=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "eval.prompts=8",
         "grpo.max_tokens=64", "eval.max_tokens=64", "adapter.schedule.every_n_steps=1",
         "adapter.schedule.train_steps=2", "adapter.train.batch_size=8", "adapter.schedule.min_sequences=8",
         "adapter.schedule.max_train_steps=0", "adapter.schedule.max_share=0", "adapter.train.warmup_steps=0",
         "fresh_final=false", "rl_batch_arms=false"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    line = last_json_line(proc)
    assert line["steps"] == 3
    s = json.loads((out / "summary.json").read_text())
    f = s["fleet"]
    assert f["engines"] == 2 and f["max_skew"] == 0 and f["engine_restarts"] == 0
    assert f["policy_version_per_step"] == [{"engine0": v, "engine1": v} for v in (1, 2, 3)]
    served = [sorted(set(row.values())) for row in f["served_draft_version_per_step"]]
    assert all(len(v) == 1 for v in served), served
    # an untrained head learns fast: rounds publish, and the fleet serves the newest at every step
    published = [b["version"] for b in f["broadcasts"]]
    assert published and published == sorted(published) and served[-1] == [published[-1]]
    assert all(b["broadcast_ms"] > 0 and b["nbytes"] > 0 and not b["refused"] for b in f["broadcasts"])
    frozen, adapted = (s["arms"][arm]["acceptance_length_per_step"] for arm in ("frozen", "adapted"))
    assert all(f < 1.1 for f in frozen) and adapted[-1] > frozen[-1] + 0.1, (frozen, adapted)


def test_bench_scale_runs_as_the_readme_shows():
    """`scripts/bench_scale.py --sizes ... --dtypes bfloat16,float32 --json` (README, "The weight
    path at real sizes"), at the 5m size: one row per dtype with the figures the README quotes,
    and the engine still serving after the updates and swaps (the script generates after them)."""
    proc = subprocess.run([sys.executable, "scripts/bench_scale.py", "--sizes", "5m", "--dtypes", "bfloat16,float32",
                           "--updates", "2", "--swaps", "3", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    rows = last_json_line(proc)["sizes"]
    assert [(r["size"], r["dtype"]) for r in rows] == [("5m", "bfloat16"), ("5m", "float32")]
    for r in rows:
        assert r["model_bytes"] == r["params"] * (2 if r["dtype"] == "bfloat16" else 4)
        assert len(r["update_ms_all"]) == 2 and r["policy_update_ms"] > 0 and r["policy_update_gb_s"] > 0
        assert 0 < r["draft_swap_p50_ms"] <= r["draft_swap_p95_ms"]
        assert r["integrity_ms"] > 0 and r["update_peak_rss_over_model"] >= 0
