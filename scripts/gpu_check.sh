#!/usr/bin/env bash
# The GPU checks, as one run on a CUDA machine (docs/design.md, "On a GPU"): the gpu-marked
# tests, scripts/bench_adapter.py at 1b and 8b widths and scripts/bench_step_vs_speculators.py at
# 8b. Needs a python with torch (CUDA), transformers, accelerate, safetensors, pyyaml and pytest
# (and speculators for the last: SPECULATORS_WHEELS); not vLLM. Logs go to $OUT (default
# ./gpu-out). The tests' toy target is built on first use (DRAFTADAPT_TEST_CACHE, as in the CPU
# suite); carry .cache/tests from a machine that ran the suite to skip the build.
#
#     bash scripts/gpu_check.sh [--quick]      # --quick: 1b only, fewer timed steps
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DRAFTADAPT_TEST_CACHE=${DRAFTADAPT_TEST_CACHE:-$PWD/.cache/tests}
if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: $py sees no CUDA device; these checks need a GPU (the CPU suite is bash scripts/test.sh)" >&2
  exit 2
fi
sizes=1b,8b steps=5
[[ ${1:-} == --quick ]] && sizes=1b steps=2

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import sys, torch, transformers, accelerate, safetensors; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, \
'accelerate', accelerate.__version__)"
  $py -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/env.txt"

rc=0
echo "== gpu tests"
timeout 300 $py -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" || rc=1
echo "== bench_adapter"
timeout 400 $py scripts/bench_adapter.py --sizes $sizes --precisions fp32,bf16 --slots 1.0,0.25 \
  --seqs 4 --seq-len 4096 --steps $steps --handover --json >"$out/bench_adapter.json" 2>"$out/bench_adapter.err" || rc=1
grep -v '^\[' "$out/bench_adapter.err" | tail -n 20
echo "== bench_step_vs_speculators (speculators from SPECULATORS_WHEELS when no index: see the script)"
step_size=8b
[[ ${1:-} == --quick ]] && step_size=1b
timeout 400 $py scripts/bench_step_vs_speculators.py --size $step_size --seqs 4 --seq-len 4096 --steps $steps \
  --json >"$out/bench_step_vs_speculators.json" 2>"$out/bench_step_vs_speculators.err" || rc=1
tail -n 5 "$out/bench_step_vs_speculators.err"
exit $rc
