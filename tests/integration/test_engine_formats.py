"""Both Eagle-3 export formats and the small draft LM load and serve in a real vLLM engine."""

from __future__ import annotations

import json

import pytest

from draftadapt.drafts.formats import META_FILE, load_eagle3
from draftadapt.draft_init import init_draft

from .conftest import start_engine, stop_engine, toy_prompts

pytestmark = pytest.mark.integration


def _check_metrics(res, k):
    s = res.acceptance
    assert s.drafts > 0 and s.draft_tokens == k * s.drafts
    assert len(s.accepted_per_pos) == k and sum(s.accepted_per_pos) == s.accepted_tokens
    # the counters' own arithmetic; position i is counted only after 0..i-1 were accepted
    assert s.acceptance_length == pytest.approx(1.0 + sum(s.per_position), abs=1e-9)
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:])), s.accepted_per_pos


def test_original_eagle_format_serves(toy_target, tmp_path):
    draft = init_draft(toy_target, "eagle3", tmp_path / "eagle", fmt="eagle", seed=3, draft_vocab=40)
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == load_eagle3(draft, toy_target).cfg.aux_layer_ids
    eng = start_engine(toy_target, draft, method="eagle3", k=2)
    try:
        res = eng.generate(toy_prompts(toy_target, 8), temperature=1.0, max_tokens=32, seed=1)
        _check_metrics(res, 2)
        # the same head re-exported in the other format swaps into this engine in place
        spec_dir = init_draft(toy_target, "eagle3", tmp_path / "spec", fmt="speculators", seed=3, draft_vocab=40)
        assert eng.swap_draft(spec_dir).checksum == eng.live_checksum
        assert eng.draft_state()["checksum"] == eng.live_checksum
    finally:
        stop_engine(eng)


def test_small_draft_lm_serves_and_swaps(toy_target, plain_engine, tmp_path):
    v0 = init_draft(toy_target, "draft_model", tmp_path / "lm0", seed=0)
    v1 = init_draft(toy_target, "draft_model", tmp_path / "lm1", seed=1)
    meta = json.loads((v1 / META_FILE).read_text())
    meta["version"] = 1
    (v1 / META_FILE).write_text(json.dumps(meta))
    eng = start_engine(toy_target, v0, method="draft_model", k=3)
    try:
        prompts = toy_prompts(toy_target, 12)
        res = eng.generate(prompts, temperature=1.0, max_tokens=32, seed=2)
        _check_metrics(res, 3)
        before = eng.draft_state()["checksum"]
        swapped = eng.swap_draft(v1)
        assert swapped.version == 1 and swapped.checksum != before
        greedy = eng.generate(prompts, temperature=0.0, max_tokens=48)
        ref = plain_engine.generate(prompts, temperature=0.0, max_tokens=48)
        assert [r.token_ids for r in greedy.rollouts] == [r.token_ids for r in ref.rollouts]
    finally:
        stop_engine(eng)
