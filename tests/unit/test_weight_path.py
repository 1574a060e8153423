"""The weight path's pure logic: the read-back checksum and how one update reaches several engines."""

from __future__ import annotations

import torch

import draftadapt.engine.rollout as rollout
import draftadapt.engine.worker_ext as worker_ext
from draftadapt.drafts.formats import model_dtype
from draftadapt.engine.worker_ext import module_checksum
from draftadapt.tensors import all_finite


def _module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.Linear(53, 11))


def test_full_checksum_in_slices_sees_every_element(monkeypatch):
    """Slices far smaller than a tensor: still a function of every value, and of nothing else."""
    monkeypatch.setattr(worker_ext, "CHECKSUM_CHUNK", 7)
    m = _module()
    first = module_checksum(m, full=True)
    assert module_checksum(m, full=True) == first
    assert module_checksum(_module(), full=True) == first  # same values, other storage
    with torch.no_grad():
        m[0].weight.view(-1)[-2] += 1e-3  # inside the last slice, not an extreme value
    assert module_checksum(m, full=True) != first
    with torch.no_grad():
        m[0].weight.view(-1)[-2] -= 1e-3
    assert module_checksum(m, full=True) == first
    # a bf16 copy has other values (rounded), so another checksum; its own is stable
    half = _module().to(torch.bfloat16)
    assert module_checksum(half, full=True) == module_checksum(half, full=True) != first


def test_sampled_fingerprint_sees_what_a_lost_draft_looks_like(monkeypatch):
    """The routine fingerprint: a sample of each parameter plus its min and max over all of it."""
    monkeypatch.setattr(worker_ext, "CHECKSUM_SAMPLE", 16)
    m = _module()
    first = module_checksum(m)
    assert module_checksum(_module()) == first and module_checksum(m) != module_checksum(m, full=True)
    w = m[0].weight.view(-1)  # 37 x 53 elements, every 123rd sampled
    for change in (lambda: w.mul_(1.001),  # reloaded from other weights
                   lambda: w.zero_(),  # zeroed, freed
                   lambda: w.__setitem__(5, float("nan")),  # an unsampled element gone bad
                   lambda: w.__setitem__(7, 10.0)):  # an unsampled element out of range
        with torch.no_grad():
            saved = w.clone()
            change()
            assert module_checksum(m) != first
            w.copy_(saved)
    assert module_checksum(m) == first


def test_all_finite_finds_nan_and_inf_anywhere():
    x = torch.randn(1000).to(torch.bfloat16)
    assert all_finite(x) and all_finite(torch.arange(4))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[517] = bad
        assert not all_finite(y)


def test_a_file_this_process_hashed_is_known_until_it_changes(tmp_path):
    from draftadapt.fileio import file_sha256, known_sha256

    (tmp_path / "tmp-v1").mkdir()
    f = tmp_path / "tmp-v1" / "w.bin"
    f.write_bytes(b"x" * 100)
    assert known_sha256(f) is None
    digest = file_sha256(f)
    (tmp_path / "tmp-v1").rename(tmp_path / "v1")  # a store publishes a version dir by rename
    moved = tmp_path / "v1" / "w.bin"
    assert known_sha256(moved) == digest
    with open(moved, "r+b") as fh:  # rewritten in place, same size
        fh.write(b"y")
    assert known_sha256(moved) is None


def test_checksum_skips_excluded_and_empty_parameters():
    m = _module()
    full = module_checksum(m)
    assert module_checksum(m, exclude={"1.weight"}) != full
    m.register_parameter("repacked", torch.nn.Parameter(torch.empty(0)))  # what CPU GEMM repacking leaves
    assert module_checksum(m) == full


class _Recorder:
    """An engine stand-in that records what update_policy received (routing logic only)."""

    def __init__(self, in_process: bool):
        self.in_process = in_process
        self.got: list = []

    def update_policy(self, weights, version=None, checks=False):
        self.got.append(weights)
        return {"version": version}


def test_update_policies_writes_one_file_for_all_multiprocess_engines(monkeypatch):
    written = []
    real = rollout.policy_file

    def counting(weights):
        written.append(1)
        return real(weights)

    monkeypatch.setattr(rollout, "policy_file", counting)
    engines = [_Recorder(True), _Recorder(False), _Recorder(False), _Recorder(True)]
    sd = {"w": torch.ones(3, dtype=torch.bfloat16)}
    results = rollout.update_policies(engines, sd, version=4)
    assert results == [{"version": 4}] * 4
    assert len(written) == 1
    assert engines[0].got == [sd] and engines[3].got == [sd]  # in-process: the dict itself
    paths = [engines[1].got[0], engines[2].got[0]]
    assert paths[0] == paths[1] and not paths[0].exists()  # one file, removed after
    assert rollout.update_policies([_Recorder(True)], sd) and len(written) == 1  # none needed


def test_policy_file_keeps_the_dtype(tmp_path):
    from safetensors.torch import load_file

    sd = {"a": torch.randn(4, 4).to(torch.bfloat16), "b": torch.randn(2)}
    with rollout.policy_file(sd) as path:
        back = load_file(str(path))
    assert back["a"].dtype == torch.bfloat16 and torch.equal(back["a"], sd["a"])
    assert back["b"].dtype == torch.float32 and not path.exists()


def test_model_dtype_reads_the_config(tmp_path):
    import json

    for cfg, want in (({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                      ({}, "float32"), ({"text_config": {"dtype": "bfloat16"}}, "bfloat16")):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert model_dtype(tmp_path) == want
