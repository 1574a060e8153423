"""The engine's reload log filter: only the modules a swap leaves out on purpose go quiet (no vLLM here)."""

import logging

import torch
from torch import nn

from draftadapt.engine.worker_ext import (
    RELOAD_FAILED_MSG,
    RELOAD_LOGGER,
    expected_unloaded,
    quiet_expected_unloaded,
)


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
