"""The README's test commands: `bash scripts/test.sh` passes pytest arguments through, and the
contributors' fast line, `-m "not integration and not slow"`, selects by marker (here narrowed
with -k to one small module, not the whole unit suite)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAST = ["-m", "not integration and not slow"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/test.sh", *FAST, "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)


def test_the_fast_line_passes_its_arguments_to_pytest():
    done = run("-k", "test_threads")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "setup: .venv is up to date" in done.stdout + done.stderr
    assert "\n3 passed" in done.stdout, done.stdout[-2000:]
    assert "bringing up nodes" in done.stdout  # the default: xdist workers (scripts/test.sh)
    # an integration module and a slow one are left out by the markers alone (listed serially:
    # DRAFTADAPT_TEST_WORKERS=0, the README's way to run without workers)
    out = run("-k", "test_trainer_dist or test_online_k", "--co", env={**os.environ, "DRAFTADAPT_TEST_WORKERS": "0"})
    listed = out.stdout
    assert "tests/unit/test_online_k.py::" in listed and "tests/integration/test_online_k.py::" not in listed, listed[-2000:]
    assert "test_trainer_dist.py::" not in listed, listed[-2000:]
