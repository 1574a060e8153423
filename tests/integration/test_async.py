"""`draftadapt demo async_lag=L`: the versions each side holds, checked at every step of a real run
(real vLLM engines, the RL engine in its own process, the adapter publishing every step)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from draftadapt.draft_init import init_draft

pytestmark = pytest.mark.integration


def run_demo(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftadapt.cli", "demo", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("lag", [1, 2])
def test_async_versions_every_step(toy_target, tmp_path, lag):
    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "demo"
    steps = 4
    proc = run_demo(["--out", str(out), "--steps", str(steps), "--toy", str(toy_target), f"draft={draft}",
                     f"async_lag={lag}", "k_policy=fixed", "grpo.prompts_per_step=4", "grpo.group_size=4",
                     "grpo.max_tokens=48", "fresh_final=false", "rl_batch_arms=false",
                     # the eval arms are measured every step but not checked here: the fewest tokens
                     "eval.prompts=4", "eval.max_tokens=16",
                     # a round and a publish every step (the gate lets nearly any candidate through),
                     # so every step has a swap to check
                     "adapter.schedule.every_n_steps=1", "adapter.schedule.train_steps=2",
                    "adapter.schedule.max_train_steps=0", "adapter.schedule.max_share=0", "adapter.train.warmup_steps=0",
                     "adapter.train.batch_size=8", "adapter.schedule.min_sequences=8", "adapter.validation.margin=0.99"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "async/engine_version" in r]
    assert [int(r["async/trainer_version"]) for r in rows] == list(range(steps))
    swaps = 0
    for r in rows:
        t, engine, sampled = int(r["async/trainer_version"]), int(r["async/engine_version"]), int(r["async/rollout_version"])
        # the rollouts this step trained on came from the policy exactly `lag` versions behind the
        # trainer (the first `lag` steps: the initial policy, while the pipeline fills)
        assert sampled == max(0, t - lag), r
        assert engine == t + 1  # after the boundary the engine serves the trainer's new policy
        drafted = int(r["draft/policy_version"])
        # the draft serving from here on was never trained on a newer policy than the engine
        # serves, and a newly swapped-in one lags it by at most `lag`
        assert drafted <= engine, r
        if "swap/ms" in r:
            swaps += 1
            assert engine - drafted <= lag, r
    assert swaps >= steps - 2  # rounds from the second step on publish and swap (the first has no held-out split)
    summary = json.loads((out / "summary.json").read_text())
    a = summary["async"]
    assert a["lag"] == lag and 0.0 <= a["exposed_gen_s"] <= a["step_s"] and 0.0 <= a["overlap"] <= 1.0
    assert a["step_s"] == pytest.approx(summary["end_to_end"]["rl_step_s"], rel=1e-9)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["async"]["lag"] == lag


def test_async_refuses_bad_settings(tmp_path):
    proc = run_demo(["--out", str(tmp_path / "x"), "async_lag=1", "adapter_background=true"], timeout=120)
    assert proc.returncode == 2 and "drop adapter_background=true" in proc.stderr, proc.stderr
    proc = run_demo(["--out", str(tmp_path / "x"), "async_lag=-1"], timeout=120)
    assert proc.returncode == 2 and "async_lag=-1" in proc.stderr, proc.stderr
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "summary.json").write_text(json.dumps({"spec": False, "end_to_end": {}}))
    proc = run_demo(["--out", str(tmp_path / "x"), "async_lag=1", f"sync={tmp_path / 'base'}"], timeout=120)
    assert proc.returncode == 2 and "is not a synchronous spec=true run" in proc.stderr, proc.stderr
