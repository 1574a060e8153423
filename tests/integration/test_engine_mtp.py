"""MTP speculation in a real vLLM engine: the target's own MTP layers (method="mtp", MiMo path).

Greedy output is identical with and without speculation; at temperature 1 the tokens follow the
target's exact distribution (the chi-square test of test_lossless.py, same threshold); a policy
update leaves the MTP layers alone, and an MTP swap leaves the policy alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.drafts.mtp import PREFIX, head_from_target
from draftadapt.engine.rollout import DraftSwapError
from draftadapt.fileio import file_sha256
from draftadapt.toy.known import transition_matrix
from draftadapt.train.methods import MTP

from .conftest import start_engine, stop_engine, toy_prompts
from .test_lossless import _sample, assert_target_distribution

pytestmark = pytest.mark.integration
K = 3


def _greedy(engine, prompts):
    res = engine.generate(prompts, temperature=0.0, max_tokens=64, seed=0)
    return [r.token_ids for r in res.rollouts], res.acceptance


@pytest.fixture(scope="module")
def plain_greedy(mtp_target):
    """Greedy token ids of the MTP target served without speculation (engine closed after)."""
    eng = start_engine(mtp_target)
    try:
        return _greedy(eng, toy_prompts(mtp_target, 16))[0]
    finally:
        stop_engine(eng)


@pytest.fixture(scope="module")
def mtp_engine(mtp_target, plain_greedy):
    eng = start_engine(mtp_target, None, method="mtp", k=K)
    yield eng
    stop_engine(eng)


def test_greedy_is_identical_with_the_targets_mtp_layers(mtp_engine, mtp_target, plain_greedy):
    assert mtp_engine.method == "mtp" and mtp_engine.k == K and mtp_engine.draft_dir is None
    ids, acceptance = _greedy(mtp_engine, toy_prompts(mtp_target, 16))
    assert ids == plain_greedy
    assert acceptance.drafts > 0 and acceptance.draft_tokens == K * acceptance.drafts
    # the jointly trained MTP layer proposes well (the spike's seed-0 target: 3.19 at k=3)
    assert acceptance.acceptance_length > 2.0, acceptance


def test_policy_update_and_mtp_swap_do_not_clobber_each_other(mtp_engine, mtp_target, plain_greedy, tmp_path):
    prompts = toy_prompts(mtp_target, 16)
    live = mtp_engine.live_checksum
    policy_before = mtp_engine.policy_checksum()
    body = {k: v for k, v in load_file(str(mtp_target / WEIGHTS_FILE)).items() if not k.startswith(PREFIX)}
    # a policy update (the HF policy's tensors: no MTP layers among them) leaves the MTP layers
    moved = mtp_engine.update_policy({k: v * 1.01 for k, v in body.items()}, checks=True)
    assert moved["policy_checksum"] != policy_before
    assert moved["draft"]["checksum"] == live
    back = mtp_engine.update_policy(body, checks=True)
    assert back["policy_checksum"] == policy_before and back["draft"]["checksum"] == live

    # fresh MTP layers swapped in: the policy is untouched, acceptance collapses, greedy stays
    _, trained = _greedy(mtp_engine, prompts)
    fresh = MTP.export(head_from_target(mtp_target, fresh_seed=1), tmp_path / "fresh", mtp_target,
                       meta={"version": 1, "lineage": "t"})
    swapped = mtp_engine.swap_draft(fresh)
    assert swapped.version == 1 and swapped.checksum != live
    assert mtp_engine.policy_checksum() == policy_before
    ids, acceptance = _greedy(mtp_engine, prompts)
    assert ids == plain_greedy
    assert acceptance.acceptance_length < trained.acceptance_length - 0.5, (acceptance, trained)

    # the target's own layers back, exported as a draft: the same checksum, the same acceptance
    own = MTP.export(MTP.init(mtp_target), tmp_path / "own", mtp_target, meta={"version": 2, "lineage": "t"})
    assert mtp_engine.swap_draft(own).checksum == live
    ids, acceptance = _greedy(mtp_engine, prompts)
    assert ids == plain_greedy and acceptance.acceptance_length == pytest.approx(trained.acceptance_length)

    # a file with the embeddings (the policy's, shared) or other shapes is refused before loading
    bad = tmp_path / "bad"
    MTP.export(MTP.init(mtp_target), bad, mtp_target, meta={"version": 3, "lineage": "t"})
    sd = load_file(str(bad / WEIGHTS_FILE))
    sd["model.embed_tokens.weight"] = torch.zeros(64, 128)
    save_file(sd, str(bad / WEIGHTS_FILE))
    meta = json.loads((bad / META_FILE).read_text())
    meta["sha256"] = file_sha256(bad / WEIGHTS_FILE)
    (bad / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DraftSwapError, match="does not fit the serving draft"):
        mtp_engine.swap_draft(bad)
    assert mtp_engine.draft_state()["checksum"] == live and mtp_engine.policy_checksum() == policy_before


def test_adapter_trains_publishes_and_swaps_mtp_layers(mtp_engine, mtp_target, tmp_path):
    """DraftAdapter with method="mtp" from fresh MTP layers: a round trains them on the policy's
    hidden states (the policy gets no gradient), publishes only the MTP tensors and swaps them in;
    the engine then accepts more than with the fresh layers."""
    from draftadapt.adapter import DraftAdapter

    from .test_adapter import small_cfg

    prompts = toy_prompts(mtp_target, 48)
    fresh = MTP.export(head_from_target(mtp_target, fresh_seed=2), tmp_path / "fresh", mtp_target,
                       meta={"version": 0})
    mtp_engine.swap_draft(fresh)
    _, before = _greedy(mtp_engine, prompts[:16])
    cfg = small_cfg("mtp", lr=1e-2)
    cfg.schedule.train_steps = 40
    adapter = DraftAdapter(mtp_target, fresh, tmp_path / "out", cfg)
    try:
        adapter.observe(mtp_engine.generate(prompts, temperature=1.0, max_tokens=64, seed=3).rollouts, policy_version=0)
        m = adapter.run_round()
        assert m["adapt/trained"] == 1.0 and m["adapt/published"] == 1.0, m
        assert m["accept/simulated_length"] > m["accept/simulated_live"], m
        assert all(p.grad is None for p in adapter.policy.parameters())
        latest = adapter.store.latest()
        assert set(load_file(str(latest.path / WEIGHTS_FILE))) == {k for k in load_file(str(fresh / WEIGHTS_FILE))}
        res = adapter.swap(mtp_engine)
        assert res is not None and res.version == 2 and mtp_engine.draft_state()["checksum"] == res.checksum
        _, after = _greedy(mtp_engine, prompts[:16])
        assert after.acceptance_length > before.acceptance_length + 0.2, (before, after)
    finally:
        adapter.close()


def test_eval_measured_and_simulated_acceptance_agree(mtp_target, tmp_path):
    """`draftadapt eval` on an MTP draft: vLLM's measured acceptance and the offline simulation
    (the same unrolled MTP layer in plain torch, on the same rollouts) agree as for Eagle-3 (3%,
    test_eval_toy.py). Measured on the seed-0 MTP toy, 64 prompts: 2.829 against 2.818."""
    from .conftest import last_json, run_eval

    d = MTP.export(MTP.init(mtp_target), tmp_path / "own", mtp_target, meta={"version": 0})
    proc = run_eval(mtp_target, d, "--k", "3", "--temperature", "1.0", "--num-prompts", "32", "--max-tokens", "64",
                    "--json")
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = last_json(proc)
    assert result["method"] == "mtp"
    measured, simulated = result["acceptance_length_measured"], result["acceptance_length_simulated"]
    assert measured > 2.0, result
    assert simulated == pytest.approx(measured, rel=0.03)


# ------------------------------------------------------------------ losslessness at temperature 1

@pytest.fixture(scope="module")
def known_mtp_engine(known_mtp_target, tmp_path_factory):
    """Started from an MTP draft directory (the exact layers, exported): the engine serves the
    target with method="mtp" and loads the directory's layers into its drafter."""
    d = MTP.export(MTP.init(known_mtp_target), tmp_path_factory.mktemp("known_mtp") / "v0", known_mtp_target,
                   meta={"version": 0})
    eng = start_engine(known_mtp_target, d, method="mtp", k=K)
    yield eng
    stop_engine(eng)


def test_mtp_greedy_follows_the_argmax_chain(known_mtp_engine):
    P = transition_matrix(64)
    seqs, acceptance = _sample(known_mtp_engine, n_seqs=8, max_tokens=40, temperature=0.0)
    for seq in seqs:
        for a, b in zip(seq, seq[1:]):
            assert b == int(P[a].argmax())
    # the MTP layer proposes from the chain's own row: every greedy proposal is accepted
    assert acceptance.acceptance_length == pytest.approx(K + 1, abs=0.05)


def test_mtp_speculative_sampling_matches_the_target_distribution(known_mtp_engine, known_mtp_target, tmp_path):
    P = transition_matrix(64)
    seqs, acceptance = _sample(known_mtp_engine, seed=1)
    gof = assert_target_distribution(seqs, P)
    assert gof["n"] >= 4000 and acceptance.drafts > 0
    assert 1.5 < acceptance.acceptance_length <= K + 1  # rejections happen, so the sampler is exercised

    # after an in-place swap to a worse MTP proposer the distribution is still the target's
    worse = MTP.init(known_mtp_target)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        w = worse.layers[0].input_proj.weight
        w.add_(0.5 * torch.randn(w.shape, generator=g))
    d = MTP.export(worse, tmp_path / "v1", known_mtp_target, meta={"version": 1})
    assert known_mtp_engine.swap_draft(d).version == 1
    seqs, acceptance2 = _sample(known_mtp_engine, seed=11)
    assert acceptance2.acceptance_length < acceptance.acceptance_length
    assert_target_distribution(seqs, P)


# ------------------------------------------------------------------ the sidecar (no engine)

def test_sidecar_publishes_mtp_versions(tmp_path):
    """`draftadapt sidecar adapter.method=mtp` as a real process on a spool: it trains the MTP
    layers of a tiny MTP target and publishes versions holding only the MTP tensors."""
    import random
    import subprocess

    from draftadapt.data.store import DraftStore
    from draftadapt.spool import SpoolWriter
    from tests.unit.test_mtp import VLLM_MTP_NAMES, make_mtp_target

    from .conftest import start_sidecar, write_shard

    target = tmp_path / "target"
    make_mtp_target(target, layers=4, hidden=64)
    draft = MTP.export(MTP.init(target), tmp_path / "draft0", target, meta={"version": 0})
    spool, out = tmp_path / "spool", tmp_path / "drafts"
    writer = SpoolWriter(spool, writer_id="rl")
    rng = random.Random(0)
    for step in range(3):
        write_shard(writer, step, rng)
    writer.finish(steps=3)
    with open(tmp_path / "sidecar.log", "w") as log:
        proc = start_sidecar(spool, out, target, draft, log, "adapter.method=mtp")
        try:
            assert proc.wait(timeout=600) == 0, (tmp_path / "sidecar.log").read_text()[-3000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    store = DraftStore(out, readonly=True)
    assert store.latest().version >= 2, (tmp_path / "sidecar.log").read_text()[-3000:]
    latest = store.latest()
    assert set(load_file(str(latest.weights))) == VLLM_MTP_NAMES
    assert json.loads((latest.path / META_FILE).read_text())["method"] == "mtp"


# ------------------------------------------------------------------ the demo

def test_demo_adapts_the_targets_own_mtp_layers(mtp_target, tmp_path):
    """`draftadapt demo method=mtp initial_draft=own` starts from the target's own MTP layer (the
    frozen arm serves it as vLLM would with nobody training a draft) and swaps adapted versions in."""
    from .test_async import run_demo

    out = tmp_path / "demo"
    proc = run_demo(["--out", str(out), "--steps", "2", "--toy", str(mtp_target), "method=mtp", "initial_draft=own", "k_policy=fixed",
                     "grpo.prompts_per_step=4", "grpo.group_size=4", "eval.prompts=8", "grpo.max_tokens=48",
                     "eval.max_tokens=48", "fresh_final=false", "rl_batch_arms=false",
                     "adapter.schedule.every_n_steps=1", "adapter.schedule.train_steps=2",
                    "adapter.schedule.max_train_steps=0", "adapter.schedule.max_share=0", "adapter.train.warmup_steps=0",
                     "adapter.train.batch_size=8", "adapter.schedule.min_sequences=8",
                     "adapter.validation.margin=0.99"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the target's own mtp layers as the draft" in proc.stdout
    own = head_from_target(mtp_target).mtp_state_dict()
    draft0 = load_file(str(out / "draft0" / WEIGHTS_FILE))
    assert set(draft0) == set(own) and all(torch.equal(draft0[k].float(), own[k].float()) for k in own)
    assert "pretrain" not in {p.name for p in (out / "draft0").iterdir()}  # nothing was pretrained
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "accept/frozen_length" in r]
    assert len(rows) == 2
    # the gate lets any candidate through here: a round every step swaps a new version in
    assert [r["draft/version"] for r in rows] == [r["draft/published_version"] for r in rows]
    assert rows[-1]["draft/version"] > rows[0]["draft/version"] >= 1
    # the frozen arm is the own layer as the build trained it (measured 3.11 and 3.19 here at k=3)
    assert all(r["accept/frozen_length"] > 2.5 for r in rows)
    # MTP's default k=5: the engine drafts 5 tokens, and the adapter ran 5 TTT steps deep, scoring at 5
    assert all(f"accept/pos_{i}" in r for r in rows for i in range(5)) and "accept/pos_5" not in rows[0]
    ran = yaml.safe_load((out / "config.yaml").read_text())
    assert (ran["k"], ran["adapter"]["k"], ran["adapter"]["train"]["ttt_steps"]) == (5, 5, 5)
