#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (unit + integration on a real CPU vLLM).
#   bash scripts/test.sh [pytest args]
# Two pytest-xdist workers by default, each taking whole test modules (their engines are
# module-scoped) and the Ray tests as one group, longest groups first (tests/conftest.py): on 2
# cores a serial run keeps one core busy (imports, engine start-up and subprocesses are
# single-threaded), two keep ~1.5 busy. Three ran slower on 23 GiB (memory, docs/design.md "The suite").
# DRAFTADAPT_TEST_WORKERS=0 runs serially, N runs N workers (each needs ~4 GiB at its peak).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${DRAFTADAPT_TEST_WORKERS:-2}
# Idle OpenMP threads sleep instead of spinning: two workers' thread pools share the cores, and a
# spinning pool took a core from the other (two integration modules: 356 s spinning, 146 s passive)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
dist=()
[ "$workers" = 0 ] || dist=(-n "$workers" --dist loadgroup)
exec .venv/bin/python -m pytest tests "${dist[@]}" "$@"
