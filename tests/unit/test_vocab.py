import pytest
import torch

from draftadapt.drafts.vocab import build_vocab_map, check_vocab_map, draft_to_target_ids, target_to_draft_probs


def test_keeps_most_frequent_in_target_order():
    counts = torch.tensor([5.0, 0.0, 9.0, 1.0, 9.0, 3.0])
    d2t, t2d = build_vocab_map(counts, 3)
    assert draft_to_target_ids(d2t).tolist() == [0, 2, 4]
    assert d2t.tolist() == [0, 1, 2]
    assert t2d.tolist() == [True, False, True, False, True, False]
    check_vocab_map(d2t, t2d, 6, "test")


def test_restricting_probabilities():
    d2t, _ = build_vocab_map(torch.tensor([1.0, 0.0, 2.0, 3.0]), 2)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    assert target_to_draft_probs(p, d2t)[0].tolist() == pytest.approx([0.3, 0.4])


def test_bad_maps_are_refused():
    with pytest.raises(ValueError, match="outside"):
        check_vocab_map(torch.tensor([0, 10]), None, 4, "d")
    with pytest.raises(ValueError, match="two draft ids"):
        check_vocab_map(torch.tensor([1, 0]), None, 4, "d")
    with pytest.raises(ValueError, match="another target"):
        check_vocab_map(torch.tensor([0, 0]), torch.ones(7, dtype=torch.bool), 4, "d")
    with pytest.raises(ValueError, match="draft_vocab"):
        build_vocab_map(torch.ones(4), 5)
