"""Online k on a real engine: the per-batch-size k table changed in place between generations
is what the engine drafts (its per-position counters show it), the output stays the target's,
and OnlineK fits its step costs on the engine and writes its choice into it."""

from __future__ import annotations

import pytest

from draftadapt.draft_init import init_draft
from draftadapt.engine import k_table
from draftadapt.metrics.kcost import StepCostModel, k_at
from draftadapt.online_k import OnlineK, OnlineKConfig

from .conftest import start_engine, stop_engine, toy_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def table_engine(toy_target, tmp_path_factory):
    # an untrained head: what is drafted (the counters per position) does not depend on what is accepted
    draft = init_draft(toy_target, "eagle3", tmp_path_factory.mktemp("online_k") / "head", seed=0)
    engine = start_engine(toy_target, draft, k=5, k_schedule=[(1, 64, 3)])
    yield engine
    stop_engine(engine)


def drafted(engine, prompts):
    res = engine.generate(prompts, temperature=0.0, max_tokens=16)
    return res, res.acceptance.drafts_per_position(5) if res.acceptance.k else [0] * 5


def test_the_k_served_follows_the_table_changed_in_place(table_engine, plain_engine, toy_target):
    engine = table_engine
    prompts = toy_prompts(toy_target, 8)
    reference = plain_engine.generate(prompts, temperature=0.0, max_tokens=16)
    assert engine.k == 5 and engine.k_schedule == [(1, 64, 3)]
    res, d = drafted(engine, prompts)
    assert d[0] > 0 and d[:3] == [d[0]] * 3 and d[3:] == [0, 0]  # 3 of the engine's 5 positions

    engine.set_k_schedule([(1, 64, 1)])
    res1, d = drafted(engine, prompts)
    assert d[0] > 0 and d[1:] == [0, 0, 0, 0]

    engine.set_k_schedule([(1, 64, 0)])  # speculation off in the speculative engine
    assert engine.drafter_idle  # a table of zeros idles the drafter: no pass at all
    idle_before = engine.drafter_idle_steps()
    res0, _ = drafted(engine, prompts)
    assert res0.acceptance.drafts == 0
    idle_steps = engine.drafter_idle_steps() - idle_before
    assert idle_steps >= 16  # every step of the 16-token generation skipped the drafter

    engine.set_k_schedule([(1, 64, 0)], idle_drafter=False)  # vLLM's own k = 0: the first pass runs
    assert not engine.drafter_idle
    res0v, _ = drafted(engine, prompts)
    assert res0v.acceptance.drafts == 0 and engine.drafter_idle_steps() - idle_before == idle_steps

    engine.set_k_schedule([(1, 64, 5)])
    res5, d = drafted(engine, prompts)
    assert d[0] > 0 and d == [d[0]] * 5

    # per batch size: 5 tokens while at most 4 sequences run, 2 above
    engine.set_k_schedule([(1, 4, 5), (5, 64, 2)])
    assert engine.k_schedule == [(1, 4, 5), (5, 64, 2)]
    _, d = drafted(engine, prompts[:3])
    assert d[0] > 0 and d == [d[0]] * 5
    resm, d = drafted(engine, prompts)
    assert d[0] == d[1] > d[2] == d[3] == d[4]  # the 8-sequence steps drafted 2, the tail 5
    assert not engine.drafter_idle  # a table that drafts anywhere keeps vLLM's pass at k = 0

    # greedy decoding under every table is the target's own output
    for r in (res, res1, res0, res0v, res5, resm):
        assert [x.token_ids for x in r.rollouts] == [x.token_ids for x in reference.rollouts]

    # every generation's engine steps are timed (GenerateResult.steps): the prefill first, then
    # decode steps at the batch running, drafting what the table gives that batch (fewer where a
    # sequence is within k of its last token), and together nearly the call's whole time
    for r, k in ((res, 3), (res1, 1), (res0, 0), (res5, 5)):
        assert r.steps[0].prefill and all(s.seconds > 0 for s in r.steps)
        decode = [s for s in r.steps if not s.prefill]
        assert all(s.drafted <= k for s in decode) and len(r.decode_step_seconds(8, k)) >= 3, (k, r.steps)
        assert 0.5 * r.seconds < sum(s.seconds for s in r.steps) <= r.seconds
    decode = [s for s in resm.steps if not s.prefill]
    assert all(s.drafted <= 2 for s in decode if s.batch > 4) and len(resm.decode_step_seconds(8, 2)) >= 3

    with pytest.raises(ValueError, match="started without a k schedule"):
        plain_engine.set_k_schedule([(1, 64, 1)])
    with pytest.raises(ValueError, match="start at 1"):
        engine.set_k_schedule([(2, 64, 1)])
    assert engine.k_schedule == [(1, 4, 5), (5, 64, 2)]  # a refused table leaves the live one


def test_a_step_that_drafts_nothing_samples_what_a_plain_engine_samples(table_engine, plain_engine, toy_target):
    """A step with no draft token skips vLLM's rejection sampler (draftadapt/engine/zero_draft.py).
    Lossless by construction: at temperature 1, a seeded request's tokens and log-probs are the
    plain engine's own, with the drafter idle or running its first pass."""
    engine = table_engine
    prompts = toy_prompts(toy_target, 8)
    ref = plain_engine.generate(prompts, temperature=1.0, max_tokens=16, seed=11, logprobs=True)
    assert plain_engine.zero_draft_steps() == 0  # a plain engine has no rejection sampler to skip
    for idle in (True, False):
        engine.set_k_schedule([(1, 64, 0)], idle_drafter=idle)
        before = engine.zero_draft_steps()
        res = engine.generate(prompts, temperature=1.0, max_tokens=16, seed=11, logprobs=True)
        assert res.acceptance.drafts == 0 and engine.zero_draft_steps() - before >= 16  # every step
        assert [x.token_ids for x in res.rollouts] == [x.token_ids for x in ref.rollouts]
        for got, want in zip(res.rollouts, ref.rollouts):
            assert got.logprobs == pytest.approx(want.logprobs, rel=1e-5, abs=1e-6)
    engine.set_k_schedule([(1, 64, 3)])
    before = engine.zero_draft_steps()
    res = engine.generate(prompts, temperature=1.0, max_tokens=16, seed=11)
    # drafting: only the steps before the first draft (the prefill) skip the rejection sampler
    assert res.acceptance.drafts > 0 and 1 <= engine.zero_draft_steps() - before < 16


def test_online_k_calibrates_on_the_engine_and_writes_its_choice(table_engine, toy_target):
    engine = table_engine
    engine.set_k_schedule([(1, 64, 3)])
    prompts = toy_prompts(toy_target, 4)
    online = OnlineK.calibrate(engine, prompts, OnlineKConfig(batch_sizes=[1, 4], calibrate_tokens=8, repeats=1))
    assert engine.k_schedule == online.choose()  # the calibration's own choice serves from here
    assert online.model.batch_sizes == [1, 4] and online.k_max == 5 and online.max_batch == 64
    assert all(c > 0 for c in online.model.plain) and online.calibrate_s > 0
    assert online.counts.drafts > 0  # the k_max calibration generations gave the first counts
    res = engine.generate(prompts, temperature=1.0, max_tokens=16, seed=0)
    metrics = online.update(engine, res.acceptance)
    assert engine.k_schedule == online.choose()
    assert metrics["k/b1"] == k_at(engine.k_schedule, 1) and metrics["k/b4"] == k_at(engine.k_schedule, 4)
    assert 0 <= metrics["k/rate_pos_0"] <= 1 and metrics["k/changed"] in (0.0, 1.0)


def test_stepping_aside_idles_the_drafter_until_the_simulated_length_pays(table_engine, toy_target):
    """Where no k pays (a margin no draft can beat stands in for a draft that pays nowhere) the
    table drafts at no batch size and the engine's drafter idles: no draft, no pass, the target's
    own output. While idle, a simulated length that pays turns drafting back on."""
    engine = table_engine
    engine.set_k_schedule([(1, 64, 3)])
    prompts = toy_prompts(toy_target, 4)
    online = OnlineK.calibrate(engine, prompts, OnlineKConfig(batch_sizes=[1, 4, 16], calibrate_tokens=8, repeats=1,
                                                              margin=10.0), rl_batch=4)
    # no size past the RL batch is measured; the RL batch's own first, the rest only if its bound
    # does not already show that no k pays there (the early stop)
    assert online.model.batch_sizes == ([4] if online.pending is not None else [1, 4]) and online.rl_batch == 4
    assert online.step_aside and engine.k_schedule == [(1, 64, 0)] and engine.drafter_idle
    before = engine.drafter_idle_steps()
    res = engine.generate(prompts, temperature=0.0, max_tokens=16)
    assert res.acceptance.drafts == 0 and engine.drafter_idle_steps() - before >= 16
    assert online.simulated(engine, 1.0, 3)["k/resumed"] == 0.0 and engine.drafter_idle  # still nothing pays
    # Whether a length pays is the cost model's (unit-tested); here the engine's side is tested, so
    # the calibration's timings (noise on a busy 2-core machine: CI once measured a k = 3 step at
    # more than 3.9 plain ones) give way to a model where drafting is cheap: any length > 1.2 pays.
    online.finish_calibration(engine)  # measures the k it left out, at their k: idle again below
    online.model = StepCostModel(batch_sizes=[1, 4], plain=[1.0, 1.0], fixed=[0.05, 0.05], per_k=[0.05, 0.05])
    online.new_draft(engine, 1.0, 3)  # a draft that accepts nothing pays nowhere
    assert engine.k_schedule == [(1, 64, 0)] and engine.drafter_idle
    online.margin = 0.0
    m = online.simulated(engine, 3.9, 3)  # the draft it would serve accepts nearly every token
    assert m["k/resumed"] == 1.0 and not engine.drafter_idle and k_at(engine.k_schedule, 1) >= 1
    res = engine.generate(prompts, temperature=0.0, max_tokens=16)
    assert res.acceptance.drafts > 0
    engine.set_k_schedule([(1, 64, 3)])


def test_a_multiprocess_engine_takes_the_table_in_its_engine_core(toy_target, tmp_path):
    """vLLM's multiprocess engine (and verl's rollout servers) keep the scheduler in an engine-core
    process: draftadapt's plugin gives EngineCore the method that rewrites the table there
    (draftadapt/engine/k_table.py). What it drafts follows, a table of zeros idles the drafter,
    a table vLLM refuses is refused across the process boundary and the live one stays."""
    draft = init_draft(toy_target, "eagle3", tmp_path / "head", seed=0)
    engine = start_engine(toy_target, draft, k=5, k_schedule=[(1, 64, 3)], in_process=False)
    try:
        assert not engine.in_process
        prompts = toy_prompts(toy_target, 8)
        _, d = drafted(engine, prompts)
        assert d[0] > 0 and d[:3] == [d[0]] * 3 and d[3:] == [0, 0]
        engine.set_k_schedule([(1, 4, 5), (5, 64, 1)])
        _, d = drafted(engine, prompts[:3])
        assert d[0] > 0 and d == [d[0]] * 5  # 3 sequences: 5 tokens
        _, d = drafted(engine, prompts)
        assert d[0] > d[1] and d[1] == d[2] == d[3] == d[4]  # 8 sequences: 1 token (a tail of <= 4 drafts 5)
        engine.set_k_schedule([(1, 64, 0)])
        assert engine.drafter_idle
        before = engine.drafter_idle_steps()
        res, _ = drafted(engine, prompts)
        assert res.acceptance.drafts == 0 and engine.drafter_idle_steps() - before >= 16
        with pytest.raises(Exception, match="start at 1"):
            engine.set_k_schedule([(2, 64, 1)])
        assert engine.k_schedule == [(1, 64, 0)] and engine.drafter_idle
        # read back from the engine core itself (no schedule: nothing changes)
        state = engine.llm.llm_engine.engine_core.call_utility(k_table.CORE_METHOD, None, True, False)
        assert state == {"rows": [[1, 64, 0]], "k_max": 5, "max_num_seqs": 64, "idle": True}
    finally:
        stop_engine(engine)
