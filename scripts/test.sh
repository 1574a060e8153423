#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (unit + integration on a real CPU vLLM).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
