"""A bf16 model stays bf16 end to end: the engine serves it in bf16, the adapter's policy copy is
bf16, drafts are published in bf16 and swapped in, the trainer's bf16 tensors go into the engine
as they are, and a restart trains on from the float32 weights, not from the rounded copy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftadapt.adapter import DraftAdapter
from draftadapt.drafts.formats import WEIGHTS_FILE
from draftadapt.draft_init import init_draft
from draftadapt.toy.model import build_model
from draftadapt.toy.tokenizer import build_tokenizer

from .conftest import TINY, small_cfg, start_engine, stop_engine

pytestmark = pytest.mark.integration


def _float_dtypes(path) -> set[torch.dtype]:
    return {t.dtype for t in load_file(str(path / WEIGHTS_FILE)).values() if t.is_floating_point()}


def test_a_bf16_policy_stays_bf16_through_the_loop(tmp_path):
    target = tmp_path / "target"
    build_model(TINY, seed=0).to(torch.bfloat16).save_pretrained(str(target))
    build_tokenizer().save_pretrained(str(target))
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"
    draft = init_draft(target, "eagle3", tmp_path / "draft0", seed=0)
    assert _float_dtypes(draft) == {torch.bfloat16}

    engine = start_engine(target, draft, k=3)
    try:
        assert engine.dtype == "bfloat16"
        out = tmp_path / "drafts"
        adapter = DraftAdapter(target, draft, out, small_cfg())
        assert adapter.policy.dtype == torch.bfloat16
        prompts = [[1] + [4 + (7 * i + j) % 50 for j in range(6)] for i in range(24)]
        res = engine.generate(prompts, temperature=1.0, max_tokens=24, seed=0)
        assert res.acceptance.drafts > 0
        adapter.observe(res.rollouts, policy_version=0)
        assert adapter.run_round(force=True)["adapt/published"] == 1.0
        latest = adapter.store.latest()
        assert _float_dtypes(latest.path) == {torch.bfloat16}
        assert adapter.swap(engine).version == latest.version == engine.draft_version

        # the trainer's bf16 tensors, moved, into the engine as they are; the draft survives it
        before = engine.policy_checksum()
        moved = {k: v * 1.01 for k, v in adapter.policy.state_dict().items()}
        assert engine.update_policy(moved, version=1, checks=True)["policy_checksum"] != before
        assert adapter.check_integrity(engine)
        assert engine.generate(prompts[:4], temperature=1.0, max_tokens=16, seed=1).acceptance.drafts > 0

        trained = {k: v.clone() for k, v in adapter.trainer.draft.state_dict().items()}
        del adapter
        again = DraftAdapter(target, draft, out, small_cfg())
        assert again.resumed_from == "checkpoint"
        now = again.trainer.draft.state_dict()
        assert all(torch.equal(trained[k], now[k]) for k in trained)  # float32, exactly
        # ... which the published bf16 copy alone could not have given back
        assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in trained.values() if v.is_floating_point())
    finally:
        stop_engine(engine)
