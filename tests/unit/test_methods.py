"""drafts/methods.py: one object per draft method answers every per-method question."""

import pytest
import torch

from draftadapt.config import ConfigError
from draftadapt.drafts.formats import DraftFormatError
from draftadapt.drafts.init import init_draft
from draftadapt.drafts.methods import DRAFT_LM, EAGLE3, check_serves, method_for, method_of_dir

from .test_drafts import make_target


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    make_target(root / "target")
    head = init_draft(root / "target", "eagle3", root / "head", draft_vocab=40)
    lm = init_draft(root / "target", "draft_model", root / "lm")
    return root / "target", head, lm


def test_a_method_is_found_by_name_by_module_and_by_directory(drafts):
    target, head_dir, lm_dir = drafts
    assert method_for("eagle3") is EAGLE3 and method_for("draft_model") is DRAFT_LM
    assert method_of_dir(head_dir) is EAGLE3 and method_of_dir(lm_dir) is DRAFT_LM
    head, lm = EAGLE3.load(head_dir, target), DRAFT_LM.load(lm_dir, target)
    assert method_for(head) is EAGLE3 and method_for(lm) is DRAFT_LM
    assert method_for(EAGLE3.wrap(head, 3)) is EAGLE3 and method_for(DRAFT_LM.wrap(lm)) is DRAFT_LM
    assert EAGLE3.unwrap(EAGLE3.wrap(head, 3)) is head and DRAFT_LM.unwrap(DRAFT_LM.wrap(lm)) is lm
    with pytest.raises(DraftFormatError, match="unknown draft method 'mtp'"):
        method_for("mtp")


def test_capture_setup_and_vocabulary_follow_the_method(drafts, tmp_path):
    target, head_dir, lm_dir = drafts
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(target))
    head, lm = EAGLE3.load(head_dir, target), DRAFT_LM.load(lm_dir, target)
    cap = EAGLE3.target_capture(policy, head, 1.0)
    assert cap.aux_layer_ids == list(head.cfg.aux_layer_ids)
    assert cap.draft_to_target.tolist() == EAGLE3.vocab_ids(head).tolist() and len(cap.draft_to_target) == 40
    cap = DRAFT_LM.target_capture(policy, lm, 1.0)
    assert cap.aux_layer_ids == [] and cap.draft_to_target is None
    assert torch.equal(DRAFT_LM.vocab_ids(lm), torch.arange(policy.config.vocab_size))
    # only the Eagle-3 spec needs no max_model_len of its own
    assert "max_model_len" not in EAGLE3.speculative_config(head_dir, 3, 256)
    assert DRAFT_LM.speculative_config(lm_dir, 3, 256) == {
        "method": "draft_model", "model": str(lm_dir), "num_speculative_tokens": 3, "max_model_len": 256}


def test_a_draft_of_the_other_method_is_refused_with_the_fix(drafts):
    _, head_dir, lm_dir = drafts
    check_serves(EAGLE3, head_dir, "speculators", "set {method}")
    with pytest.raises(DraftFormatError, match="is an HF draft LM; start it with method='draft_model'"):
        check_serves(EAGLE3, lm_dir, "hf", "start it with method='{method}'")
    with pytest.raises(ConfigError, match="is an Eagle-3 head; set adapter.method=eagle3"):
        check_serves(DRAFT_LM, head_dir, "eagle", "set adapter.method={method}", error=ConfigError)
