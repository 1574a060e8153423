"""train/methods.py (and drafts/serving.py, the serving facts it extends): one object per draft
method answers every per-method question."""

import pytest
import torch

from draftadapt.config import ConfigError
from draftadapt.drafts.formats import DraftFormatError
from draftadapt.drafts.serving import check_serves, serving_for
from draftadapt.draft_init import init_draft
from draftadapt.train.methods import DRAFT_LM, EAGLE3, method_for, method_of_dir

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
    with pytest.raises(DraftFormatError, match="unknown draft method 'medusa'"):
        method_for("medusa")
    # a method is its serving facts extended: the engine's answer and the trainer's are one
    assert method_for(serving_for("eagle3")) is EAGLE3 and serving_for("draft_model").formats == DRAFT_LM.formats
    assert EAGLE3.speculative_config("d", 3, 64) == serving_for("eagle3").speculative_config("d", 3, 64)


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


def test_anything_else_is_refused_by_name_and_a_wrapped_draft_scores_as_the_bare_one(drafts):
    """method_for used to call any unknown object a draft LM; score_draft used to fail deep in
    HF (or in the wrapper's type check) when handed the trainer's wrapped module."""
    from draftadapt.capture.hidden import TargetCapture
    from draftadapt.data.sequences import Sequence, collate
    from draftadapt.train.trainer import score_draft
    from transformers import AutoModelForCausalLM

    target, head_dir, _ = drafts
    with pytest.raises(TypeError, match="no draft method for a Linear"):
        method_for(torch.nn.Linear(2, 2))
    head = EAGLE3.load(head_dir, target).eval()
    policy = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    capture = EAGLE3.target_capture(policy, head, 1.0)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(3, 40, (5,), generator=g).tolist(), torch.randint(3, 40, (9,), generator=g).tolist())
            for _ in range(4)]
    batches = [capture.capture(collate(seqs, 0))]
    bare = score_draft(head, batches, 3)[0]
    wrapped = score_draft(EAGLE3.wrap(head, 3), batches, 3)[0]
    assert bare.drafts > 0 and wrapped.drafts == bare.drafts
    assert wrapped.length == pytest.approx(bare.length, abs=1e-12)


def test_a_target_config_without_a_layer_size_is_refused_naming_it():
    """HF's own decoder configs always carry the sizes; a custom model's config may not (it used
    to build a head holding None and fail later, somewhere unrelated)."""
    from types import SimpleNamespace

    from draftadapt.drafts.eagle3 import init_from_target

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=50,
                          max_position_embeddings=128, rms_norm_eps=1e-6, model_type="custom")
    with pytest.raises(ValueError, match="the target's config has no intermediate_size"):
        init_from_target(SimpleNamespace(config=cfg), None, None, None, 0)


def test_pretrain_build_starts_lm_head_as_the_targets_rows_when_asked(tmp_path):
    """draft.lm_head_from_target (speculators' trainer's start): the draft-vocabulary rows of the
    target's lm_head, trainable; off: the random start of the original EAGLE-3."""
    from draftadapt.data.sequences import Sequence
    from draftadapt.pretrain import DraftConfig

    model = make_target(tmp_path / "target")
    seqs = [Sequence([1, 5, 6], [7, 8, 9, 9, 2]), Sequence([1, 4], [10, 11, 2])]
    head = EAGLE3.build(tmp_path / "target", model, DraftConfig(draft_vocab=20, lm_head_from_target=True), seqs)
    rows = model.get_output_embeddings().weight[EAGLE3.vocab_ids(head)]
    assert torch.equal(head.lm_head.weight, rows) and head.lm_head.weight.requires_grad
    plain = EAGLE3.build(tmp_path / "target", model, DraftConfig(draft_vocab=20), seqs)
    assert not torch.equal(plain.lm_head.weight, rows)
    torch.testing.assert_close(plain.fc.weight, head.fc.weight)  # nothing else differs
