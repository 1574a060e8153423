"""capture/policy.py: the adapter's policy copy refuses what does not fit it, before loading anything."""

import pytest
import torch

from draftadapt.capture.policy import PolicyCopy
from draftadapt.data.sequences import Sequence

from .test_drafts import make_target


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    make_target(path)
    return PolicyCopy(PolicyCopy.load_model(path), path, version=3)


def test_an_update_that_does_not_fit_leaves_the_copy_as_it_was(copy, tmp_path):
    before = {k: v.clone() for k, v in copy.model.state_dict().items()}
    bad = {k: v.clone() for k, v in before.items()}
    bad[next(iter(bad))].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="hold NaN or Inf; not loaded, the adapter keeps version 3"):
        copy.update(bad, 4)
    with pytest.raises(ValueError, match="older than the adapter's 3"):
        copy.update(before, 2)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors policy weights"):
        copy.update(tmp_path, 4)
    assert copy.version == 3
    assert all(torch.equal(v, before[k]) for k, v in copy.model.state_dict().items())
    moved = {k: v * 1.01 for k, v in before.items()}
    copy.update(moved, 4)
    assert copy.version == 4 and all(torch.equal(v, moved[k]) for k, v in copy.model.state_dict().items())


def test_a_rollout_must_fit_the_policy_and_the_drafts_aux_layers(copy):
    ok = Sequence([1, 5, 6], [7, 8])
    copy.check_rollout(0, ok, {"aux_hidden": torch.zeros(5, 2 * copy.hidden_size)}, [1, 2])
    with pytest.raises(ValueError, match="rollout 1 has token ids \\[9999\\] outside"):
        copy.check_rollout(1, Sequence([1, 5], [9999]), None, [1, 2])
    with pytest.raises(ValueError, match="aux_hidden of rollout 2 is 64 wide; this draft reads aux layers \\[1, 2\\]"):
        copy.check_rollout(2, ok, {"aux_hidden": torch.zeros(5, 64)}, [1, 2])
