"""Importing draftadapt changes nothing in the process: no umask set (not even set and put back),
no environment variable, and no framework an integration attaches to (issue 35, item 4). Each
check runs in a fresh interpreter, so what an earlier test imported does not hide anything."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Extras a module may need (pyproject's optional dependencies, and the frameworks integrations/
# attach to): a module that cannot be imported without one is left out with that reason.
OPTIONAL = ("ray", "arctic_inference", "trl", "verl")

WALK = r"""
import importlib, json, os, pkgutil, sys

# The baseline: what the dependencies change when they load is theirs. torch's inductor, loaded
# with transformers' PreTrainedModel, sets TORCHINDUCTOR_CACHE_DIR. vLLM's import sets several
# more (TORCHINDUCTOR_COMPILE_THREADS, TRITON_CACHE_AUTOTUNING, ...), but no module of ours imports
# vllm when it is imported (engine/ does when an engine starts), so it is not in the baseline:
# a module that imports it is reported by name instead.
import torch
from transformers import PreTrainedModel

umask_calls = []
real_umask = os.umask
os.umask = lambda mask: (umask_calls.append(mask), real_umask(mask))[1]
env0 = dict(os.environ)

import draftadapt

# Modules verl imports in its own processes (its entry point, worker extension, trainer): their
# import is verl's (which sets variables of its own) and registering with verl is their purpose;
# tests/integration/test_verl.py runs them where verl does.
PLUGINS = ("draftadapt.integrations.verl.",)

out = {"env": {}, "umask": {}, "vllm": [], "missing": {}}
for info in pkgutil.walk_packages(draftadapt.__path__, "draftadapt.", onerror=lambda name: None):
    if info.name.startswith(PLUGINS):
        continue
    env, calls, had_vllm = dict(os.environ), len(umask_calls), "vllm" in sys.modules
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        out["missing"][info.name] = exc.name or str(exc)
        continue
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    if changed:
        out["env"][info.name] = changed
    if len(umask_calls) > calls:
        out["umask"][info.name] = umask_calls[calls:]
    if not had_vllm and "vllm" in sys.modules:
        out["vllm"].append(info.name)
out["env_total"] = sorted(k for k in set(env0) | set(os.environ) if env0.get(k) != os.environ.get(k))
print(json.dumps(out))
"""


def _run(code: str):
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_every_module_leaves_umask_and_environment_alone():
    out = _run(WALK)
    not_optional = {m: dep for m, dep in out["missing"].items() if dep.split(".")[0] not in OPTIONAL}
    assert not not_optional, f"modules that failed to import for a dependency that is not optional: {not_optional}"
    if out["missing"]:
        warnings.warn(f"not imported, optional dependency missing: {out['missing']}")
    assert not out["umask"], f"os.umask called at import (read it when it is needed): {out['umask']}"
    assert not out["env"], f"os.environ changed at import (set it where it is needed): {out['env']}"
    assert not out["env_total"], out["env_total"]
    assert not out["vllm"], f"vllm imported at import time by {out['vllm']}: import it where an engine starts"


def test_the_trl_integration_imports_no_framework():
    out = _run("import json, sys\nimport draftadapt.integrations.trl\n"
               "print(json.dumps(sorted(m for m in ('transformers', 'trl', 'torch', 'accelerate') if m in sys.modules)))")
    assert out == [], f"`import draftadapt.integrations.trl` imported {out}; import them when an object is made"
