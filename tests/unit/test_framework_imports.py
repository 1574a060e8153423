"""TRL's import sets VLLM_LOGGING_LEVEL=ERROR when it is unset, and verl's import imports TRL: every
vLLM engine started later in that process then drops its warnings. draftadapt's imports of
either leave the variable as it was (draftadapt/integrations/__init__.py). Each case runs in a
fresh interpreter: TRL patches once per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import os, sys
os.environ.pop("VLLM_LOGGING_LEVEL", None)
{body}
print("VLLM_LOGGING_LEVEL=" + str(os.environ.get("VLLM_LOGGING_LEVEL")))
"""


def level_after(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", CHECK.format(body=body)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("VLLM_LOGGING_LEVEL=")][-1]


def test_trls_import_sets_the_level_and_draftadapts_leaves_it():
    # the cause, shown: a plain import sets it (if a release stops doing so, this fails and the
    # keeper can go)
    assert level_after("import trl") == "VLLM_LOGGING_LEVEL=ERROR"
    assert level_after("from draftadapt.integrations import import_framework; import_framework('trl')") \
        == "VLLM_LOGGING_LEVEL=None"
    # a level the user set stays theirs
    assert level_after("os.environ['VLLM_LOGGING_LEVEL'] = 'DEBUG'\n"
                       "from draftadapt.integrations import import_framework; import_framework('trl')") \
        == "VLLM_LOGGING_LEVEL=DEBUG"


def test_importing_verl_leaves_the_level():
    # verl loads draftadapt's cpu platform plugin (the ``verl.plugins`` entry point), which
    # imports TRL's value-head model: that import set ERROR for the whole pytest process when
    # tests/integration/test_verl.py imported verl at collection
    assert level_after("import verl, trl") == "VLLM_LOGGING_LEVEL=None"
