"""Adapters to other RL frameworks (each imports its framework lazily)."""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from types import ModuleType

# TRL sets this when it is unset, at its import (trl/_compat.py, ``_patch_vllm_logging``: "ERROR"),
# and so does verl's import, which imports TRL. vLLM reads it at every engine start and sets its
# "vllm" logger to it: every engine started later in the process then drops its warnings, the
# reload's "Failed to load weights" that names a policy update missing a tensor included.
VLLM_LOGGING_ENV = "VLLM_LOGGING_LEVEL"


@contextmanager
def vllm_logging_kept():
    """Imports inside the block leave ``VLLM_LOGGING_LEVEL`` as it was (unset stays unset)."""
    before = os.environ.get(VLLM_LOGGING_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VLLM_LOGGING_ENV, None)
        else:
            os.environ[VLLM_LOGGING_ENV] = before


def import_framework(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for TRL, verl and what imports them, without their
    import's change to vLLM's logging level (:func:`vllm_logging_kept`)."""
    with vllm_logging_kept():
        return importlib.import_module(name)
