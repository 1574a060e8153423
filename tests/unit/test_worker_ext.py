"""The engine's reload log filter: only the modules a swap leaves out on purpose go quiet, and the
worker calls named once are the extensions' methods (no vLLM, no verl here)."""

import ast
import logging
from pathlib import Path

import torch
from torch import nn

from draftadapt.engine.worker_ext import (
    RELOAD_FAILED_MSG,
    RELOAD_LOGGER,
    DraftAdaptWorkerExtension,
    WorkerCall,
    expected_unloaded,
    quiet_expected_unloaded,
)
from draftadapt.integrations.verl import VerlWorkerCall

REPO = Path(__file__).resolve().parents[2]


class RotaryEmbedding(nn.Module):  # vLLM's: a computed cos/sin buffer, no weights
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2))


class VocabParallelEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 4))


class Draft(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed_tokens = embed
        self.rotary = RotaryEmbedding()
        self.fc = nn.Linear(4, 4)


def test_expected_unloaded_names_rotary_and_modules_shared_with_the_target():
    draft = Draft(VocabParallelEmbedding())
    assert expected_unloaded(draft, {"embed_tokens.weight"}) == {"RotaryEmbedding", "VocabParallelEmbedding"}
    # a draft with its own embeddings: a failure to load them is a real failure
    assert expected_unloaded(draft) == {"RotaryEmbedding"}


def test_a_class_with_one_module_that_should_load_stays_loud():
    draft = Draft(VocabParallelEmbedding())
    draft.own = VocabParallelEmbedding()
    assert expected_unloaded(draft, {"embed_tokens.weight"}) == {"RotaryEmbedding"}


def test_only_the_expected_warnings_are_dropped_and_only_inside_the_block(caplog):
    log = logging.getLogger(RELOAD_LOGGER)
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        with quiet_expected_unloaded({"RotaryEmbedding", "VocabParallelEmbedding"}):
            log.warning(RELOAD_FAILED_MSG, "RotaryEmbedding")
            log.warning(RELOAD_FAILED_MSG, "VocabParallelEmbedding")
            log.warning(RELOAD_FAILED_MSG, "QKVParallelLinear")
            log.warning("something else about %s", "RotaryEmbedding")
        log.warning(RELOAD_FAILED_MSG, "RotaryEmbedding")
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "something else about RotaryEmbedding",
        "RotaryEmbedding: Failed to load weights",
    ]
    assert not log.filters


def _calls(namespace) -> dict[str, str]:
    return {k: v for k, v in vars(namespace).items() if k.isupper()}


def test_each_engine_worker_call_names_a_method_of_the_extension():
    calls = _calls(WorkerCall)
    assert calls and len(set(calls.values())) == len(calls)
    assert all(callable(getattr(DraftAdaptWorkerExtension, name, None)) for name in calls.values()), calls


def test_each_verl_worker_call_names_a_method_of_verls_extension():
    # read from the source: importing the extension imports verl and vLLM (verl's processes do)
    tree = ast.parse((REPO / "draftadapt/integrations/verl/worker.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VerlDraftWorkerExtension")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    calls = _calls(VerlWorkerCall)
    assert calls and set(calls.values()) <= methods, (calls, methods)
