"""scripts/bench_job_threads.py as a user runs it, shortened (one arm, one generation a timing):
each arm in a process of its own with a real vLLM engine, a JSON line at the end. The speed
figures come from the full run on an idle machine (docs/design.md, "Publishing beside the next
round"), not from a timed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.integration]


def test_bench_job_threads_runs_an_arm_and_prints_its_timings(toy_target):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "scripts/bench_job_threads.py", "--target", str(toy_target),
                           "--arms", "job_thread", "--repeats", "1", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (arm,) = result["arms"]
    assert arm["arm"] == "job_thread" and arm["before_s"] > 0 and arm["after_s"] > 0
    assert arm["after_over_before"] == pytest.approx(arm["after_s"] / arm["before_s"], abs=2e-3)


def test_bench_job_threads_names_a_bad_arm():
    proc = subprocess.run([sys.executable, "scripts/bench_job_threads.py", "--target", "x", "--arms", "pool,threads"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "choose from none, pool, job_thread" in proc.stderr
