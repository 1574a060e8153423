"""verl 0.9.1's own GRPO trainer on CPU with draftadapt attached (recipes/verl_grpo_toy.py, the
README's verl command, shortened): verl's processes on a local Ray cluster, its FSDP actor (two
ranks, draftadapt's engine handing over from its log-prob pass), two vLLM rollout replicas
serving an Eagle-3 draft, draftadapt's trainer mode at the step boundary (the round beside the
next generation, the draft into every worker through Ray's object store)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftadapt.draft_init import init_draft

# found, not imported: importing verl in the suite's process imports TRL, which set
# VLLM_LOGGING_LEVEL=ERROR for every engine the tests after it started (draftadapt/integrations)
if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is installed by scripts/setup.sh (pip install --no-deps verl==0.9.1)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_verl_grpo_with_the_draft_adapted(toy_target, tmp_path):
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)  # random head: a candidate beats it
    out = tmp_path / "verl"
    proc = subprocess.run(
        [sys.executable, "recipes/verl_grpo_toy.py", "--out", str(out), "--steps", "2", "--toy", str(toy_target),
         "--draft", str(draft), "--prompts", "8", "--arms", "adapted", "--replicas", "2",
         # an untrained head pays nowhere: online k would step aside (test_verl_online_k_steps_aside)
         "--k-policy", "fixed", "schedule.train_steps=2",
         "schedule.max_train_steps=0", "schedule.max_share=0", "train.warmup_steps=0",
         "train.batch_size=8", "schedule.min_sequences=8", "validation.max_heldout=8"],
        capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["steps"] == 2
    arm = json.loads((out / "summary.json").read_text())["arms"]["adapted"]
    # vLLM's own counters through verl's metrics: speculation ran on every step (k=3)
    assert all(1.0 <= a <= 4.0 for a in arm["acceptance_length_per_step"]), arm["acceptance_length_per_step"]
    rows = [json.loads(x)["data"] for x in (out / "adapted" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["draftadapt/draft/integrity_ok"] == 1.0 and r["draftadapt/refused"] == 0.0
        # the hand-over from verl's actor: both FSDP ranks' rows, every rollout, no forward of the
        # adapter's own policy copy (counted where it forwards)
        assert r["draftadapt/handover_ranks"] == 2.0 and r["draftadapt/handover_rows"] == 8 * 4
        assert r["draftadapt/adapter_policy_forwards"] == 0.0
        # every worker of both replicas answered, all on one version
        assert r["draftadapt/served_workers"] == 2.0 and r["draftadapt/version_skew"] == 0.0
        # the step's generation inside each engine core (draftadapt/engine/step_clock.py): some
        # of verl's generation time, drafting at k=3
        assert 0 < r["draftadapt/engine/step_s"] <= r["timing_s/gen"] and r["draftadapt/engine/steps"] >= 1
        assert r["draftadapt/engine/drafting_share"] > 0
    assert arm["adapter_policy_forwards"] == 0 and arm["served_workers"] == 2 and arm["max_version_skew"] == 0
    # step 1 swaps the store's first version (the starting draft) into every worker; step 1's
    # rollouts train beside step 2's generation, and that round's publish is collected and swapped
    # into every worker at step 2's boundary
    assert rows[0]["draftadapt/swaps"] == 1.0 and rows[0]["draftadapt/draft_version"] == 1.0
    assert rows[1]["draftadapt/adapt/published"] == 1.0
    served = {k: v for k, v in rows[1].items() if k.startswith("draftadapt/served/")}
    assert len(served) == 2 and set(served.values()) == {2.0}, served
    store = sorted(p.name for p in (out / "adapted" / "draftadapt" / "drafts").glob("v*"))
    assert len(store) == 2, store
    # nothing went through a file: no policy tap, no status files, only the adapter's own store
    assert sorted(p.name for p in (out / "adapted" / "draftadapt").iterdir()) == ["drafts"]
    assert not list(out.rglob("policy_tap*")) and not list(out.rglob("*status*"))


def test_verl_online_k_steps_aside(toy_target, tmp_path):
    """Online k in verl's rollout servers: vLLM starts at k_max with a per-batch-size table, the
    first step's prompts calibrate it through the server's own generate before they generate,
    and the table it writes into the server's engine core (draftadapt/engine/k_table.py) is what
    step 1 already drafts with. A margin no draft can beat stands in for a draft that pays
    nowhere: the table drafts at no batch size, the drafter idles, no step drafts, and the
    boundary is paused (no round) while the adapter's simulated acceptance keeps watch."""
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "verl"
    proc = subprocess.run(
        [sys.executable, "recipes/verl_grpo_toy.py", "--out", str(out), "--steps", "2", "--toy", str(toy_target),
         "--draft", str(draft), "--prompts", "4", "--arms", "adapted", "--online-k", "margin=10",
         "--online-k", "batch_sizes=[1,16]", "--online-k", "calibrate_tokens=8", "--online-k", "repeats=1",
         "train.batch_size=8", "schedule.min_sequences=8", "validation.max_heldout=8"],
        capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    arm = json.loads((out / "summary.json").read_text())["arms"]["adapted"]
    rows = [json.loads(x)["data"] for x in (out / "adapted" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # calibrated before step 1 generated (its seconds reported from the first boundary on)
    assert rows[0]["draftadapt/k/calibrate_s"] > 0
    assert rows[0]["draftadapt/k/max"] == 0.0
    assert rows[0]["draftadapt/k/drafter_idle"] == 1.0 and rows[1]["draftadapt/k/drafter_idle"] == 1.0
    # neither step drafted: no verify step in the server's counters, none in verl's metric
    # (verl's figure is 0 where no request drafted; the starting table drafted k=3 everywhere)
    for r in rows:
        assert "draftadapt/accept/length" not in r, r
        # nor did any step inside the engine core (its step clock), though the engine stepped
        assert r["draftadapt/engine/drafting_share"] == 0.0 and r["draftadapt/engine/steps"] >= 1
        assert 0 < r["draftadapt/engine/step_s"] <= r["timing_s/gen"]
    assert arm["acceptance_length_per_step"] == [0.0, 0.0]
    # the adapter trained nothing nobody serves: paused at both boundaries, watching by simulation
    # on the pause's first step and on any later one its share of the run affords
    # (online_k.watch_share): a step that does not watch reads no hand-over and simulates nothing
    assert rows[0]["draftadapt/adapt/watched"] == 1.0
    for r in rows:
        assert r["draftadapt/adapt/paused"] == 1.0 and r.get("draftadapt/adapt/published", 0.0) == 0.0
        if r["draftadapt/adapt/watched"] == 1.0:
            assert 1.0 <= r["draftadapt/accept/simulated_live"] <= 4.0, r
        else:
            assert "draftadapt/accept/simulated_live" not in r and r["draftadapt/handover_rows"] == 0.0, r
    assert arm["online_k"]["k_max_per_step"] == [0.0, 0.0]
    store = sorted(p.name for p in (out / "adapted" / "draftadapt" / "drafts").glob("v*"))
    assert len(store) == 1, store  # the starting draft only
