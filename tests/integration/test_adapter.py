"""DraftAdapter against a real vLLM engine: train -> validate -> publish -> swap, the async
version guard, validation rejecting a worse candidate, the integrity guard, the drift trigger,
and the same loop for a small draft LM (method draft_model)."""

from __future__ import annotations

import json

import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftadapt.adapter import AdapterConfig, DraftAdapter, ScheduleConfig
from draftadapt.config import ConfigError
from draftadapt.data.store import DraftStore
from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.fileio import file_sha256
from draftadapt.draft_init import init_draft
from draftadapt.train.trainer import TrainConfig

from .conftest import start_engine, stop_engine, toy_prompts

pytestmark = pytest.mark.integration
K = 3


def small_cfg(method: str = "eagle3", **train) -> AdapterConfig:
    """Small rounds: the point here is the control flow against a real engine, not quality."""
    tc = TrainConfig(lr=train.pop("lr", 3e-3), warmup_steps=0, schedule="constant", threads=1,
                     batch_size=train.pop("batch_size", 8), **train)
    return AdapterConfig(method=method, k=K, train=tc,
                         schedule=ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=6, min_sequences=8))


def policy_weights(target, scale: float = 0.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The target's weights, optionally nudged (a stand-in for one RL update)."""
    sd = load_file(str(target / "model.safetensors"))
    if scale:
        g = torch.Generator().manual_seed(seed)
        sd = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in sd.items()}
    return sd


@pytest.fixture(scope="module")
def world(toy_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    draft0 = init_draft(toy_target, "eagle3", root / "draft0", seed=0)
    engine = start_engine(toy_target, draft0, method="eagle3", k=K)
    prompts = toy_prompts(toy_target, 48)
    yield {"root": root, "draft0": draft0, "engine": engine, "prompts": prompts}
    stop_engine(engine)


def rollouts(world, seed: int, n: int = 48):
    return world["engine"].generate(world["prompts"][:n], temperature=1.0, max_tokens=64, seed=seed).rollouts


def test_background_round_runs_beside_generation_and_is_swapped_after(world, toy_target):
    """start_round trains in a thread while the engine generates the next rollouts; calls that use
    the adapter's state wait for the round; finish_round hands its metrics over, then the swap."""
    engine = world["engine"]
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "bg", small_cfg())
    try:
        adapter.observe(rollouts(world, seed=11), policy_version=0)
        adapter.start_round()
        with pytest.raises(RuntimeError, match="finish_round"):
            adapter.start_round()
        # the engine generates while the round trains (16 prompts: the two share 2 cores, and 48 here
        # took 30 s; a shorter generation only makes the observe below more likely to have to wait)
        nxt = rollouts(world, seed=12, n=16)
        adapter.observe(nxt, policy_version=0)  # waits for the round: the buffer is never shared
        assert adapter._round is not None and adapter._round.done()
        m = adapter.finish_round()
        assert m["adapt/trained"] == 1.0 and m["adapt/published"] == 1.0, m
        assert adapter.finish_round() == {}  # nothing open any more
        res = adapter.swap(engine)
        assert res is not None and res.version == 2 and engine.draft_version == 2
        adapter.start_round()
    finally:
        adapter.close()  # finishes the open round
    assert adapter._round is None and adapter._round_pool is None
    assert adapter.store.latest().version >= 2


def test_train_validate_publish_swap(world, toy_target):
    engine = world["engine"]
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "out", small_cfg())
    assert adapter.live_version == 1  # the starting draft is the run's first version
    adapter.observe(rollouts(world, seed=1), policy_version=0)
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and m["adapt/published"] == 1.0, m
    # a random head trained for a few steps beats itself untrained on held-out rollouts
    assert m["accept/simulated_length"] > m["accept/simulated_live"], m
    latest = adapter.store.latest()
    assert latest.version == 2 and latest.policy_version == 0
    meta = json.loads((latest.path / META_FILE).read_text())
    assert meta["sha256"] == file_sha256(latest.path / WEIGHTS_FILE)
    assert meta["version"] == 2 and meta["policy_version"] == 0

    res = adapter.swap(engine)
    assert res is not None and res.version == 2 and engine.draft_version == 2
    assert engine.draft_state()["checksum"] == res.checksum
    assert adapter.swap(engine) is None  # already live: nothing to do
    from draftadapt.sidecar import pick_up_latest

    assert pick_up_latest(engine, world["root"] / "out") is None  # the sidecar's engine side: the same path
    gen = engine.generate(world["prompts"][:8], temperature=1.0, max_tokens=32, seed=2)
    assert gen.acceptance.drafts > 0


def test_handover_trains_and_swaps_with_zero_policy_forwards(world, toy_target):
    """The RL trainer's own forward over the engine's rollouts hands the aux states and log-probs
    over: the adapter trains, validates, publishes and swaps without running its policy copy once,
    and the draft it publishes serves in the engine better than the untrained one."""
    from draftadapt.data.sequences import Sequence, collate

    engine = world["engine"]
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "handover", small_cfg())
    forwards = []
    hook = adapter.policy.register_forward_hook(lambda *_: forwards.append(1))
    trainer_policy = AutoModelForCausalLM.from_pretrained(str(toy_target), torch_dtype=torch.float32)
    try:
        engine.swap_draft(world["draft0"])  # an earlier test may have left a trained draft serving
        before = engine.generate(world["prompts"][:16], temperature=1.0, max_tokens=64, seed=21).acceptance.acceptance_length
        for step, seed in enumerate((31, 32)):
            gen = engine.generate(world["prompts"], temperature=1.0, max_tokens=64, seed=seed)
            seqs = [Sequence(list(r.prompt_token_ids), list(r.token_ids)) for r in gen.rollouts]
            with adapter.handover(trainer_policy) as ho:  # the "GRPO update": forward with grad
                for lo in range(0, len(seqs), 16):
                    idx = list(range(lo, min(lo + 16, len(seqs))))
                    batch = collate([seqs[i] for i in idx], adapter.pad_id)
                    logits = trainer_policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    ho.add(idx, logits, batch["attention_mask"])
                    logits.mean().backward()
            adapter.observe(gen.rollouts, policy_version=0, handover=ho)
            m = adapter.run_round()
            assert m["adapt/trained"] == 1.0 and m["adapt/published"] == 1.0, m
            assert adapter.swap(engine) is not None
        assert forwards == [] and adapter.capture.forwards == 0
        assert adapter.store.latest().policy_version == 0  # trained against the sampling policy
        after = engine.generate(world["prompts"][:16], temperature=1.0, max_tokens=64, seed=21).acceptance.acceptance_length
        # a random head trained for 12 steps: measured in vLLM it drafts clearly better (typically
        # 1.0x -> 1.4x+; 0.15 is well above the engine's seed-to-seed noise on 16 prompts)
        assert after > before + 0.15, (before, after)
    finally:
        hook.remove()
        engine.swap_draft(world["draft0"])


def test_handover_targets_current_recaptures_with_the_adapters_policy(world, toy_target):
    """targets=current ignores handed-over log-probs and runs the adapter's own policy copy."""
    cfg = small_cfg()
    cfg.targets = "current"
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "current", cfg)
    gen = world["engine"].generate(world["prompts"], temperature=1.0, max_tokens=64, seed=41)
    from draftadapt.data.sequences import Sequence, collate

    seqs = [Sequence(list(r.prompt_token_ids), list(r.token_ids)) for r in gen.rollouts]
    with adapter.handover(adapter.policy) as ho, torch.no_grad():
        batch = collate(seqs, adapter.pad_id)
        ho.add(range(len(seqs)), adapter.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
               batch["attention_mask"])
    adapter.observe(gen.rollouts, policy_version=0, handover=ho)
    assert adapter.run_round()["adapt/trained"] == 1.0
    assert adapter.capture.forwards > 0


@pytest.fixture(scope="module")
def trained(world, toy_target):
    """A head that has had one adaptation round on the engine's rollouts (better than draft0)."""
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "trained", small_cfg())
    adapter.observe(rollouts(world, seed=11), policy_version=0)
    assert adapter.run_round()["adapt/published"] == 1.0
    return adapter.store.latest().path


def test_async_never_swaps_in_a_draft_of_a_newer_policy(world, toy_target):
    """The trainer is at policy v+1 while the engine still serves v: the draft trained against
    v+1 waits until the engine serves v+1."""
    engine = world["engine"]
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "async", small_cfg())
    # the run's version 1 (the starting draft) goes live, although the engine served a version 2
    # of another store: versions compare within a store's lineage only
    assert adapter.swap(engine).version == 1
    served = engine.policy_version
    adapter.observe(rollouts(world, seed=3), policy_version=served)
    new_weights = policy_weights(toy_target, scale=0.02, seed=1)
    adapter.update_policy(new_weights, version=served + 1)
    m = adapter.run_round()
    assert m["adapt/published"] == 1.0, m
    newest = adapter.store.latest()
    assert newest.policy_version == served + 1
    before = engine.draft_state()
    assert adapter.swap(engine) is None  # nothing the engine may serve yet is newer than what it has
    assert engine.draft_state() == before
    engine.update_policy(new_weights, version=served + 1)
    try:
        assert adapter.check_integrity(engine)  # the policy sync left the draft alone
        res = adapter.swap(engine)
        assert res is not None and res.version == newest.version
    finally:
        engine.update_policy(policy_weights(toy_target), version=served + 2)  # back to the toy's weights


def test_validation_rejects_a_worse_candidate(world, trained, toy_target):
    """A destructive learning rate makes the candidate worse than the live draft on held-out
    rollouts: nothing is published and the engine keeps serving the live version."""
    out = world["root"] / "reject"
    adapter = DraftAdapter(toy_target, trained, out, small_cfg(lr=5.0))
    live = adapter.store.latest()
    adapter.observe(rollouts(world, seed=4), policy_version=0)
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and m["adapt/rejected"] == 1.0 and m["adapt/published"] == 0.0, m
    assert m["accept/simulated_length"] < m["accept/simulated_live"] * 0.99, m
    assert adapter.store.latest().version == live.version
    assert DraftStore(out).versions() == [live.version]


def test_a_round_scores_the_live_draft_once_the_guard_s_score_is_its_own(world, toy_target, monkeypatch):
    """The guard scores the served draft on the newest held-out share at every round call, and a
    round holds out that same share: the round takes the guard's score for its live draft rather
    than scoring it again (the same batches, so the same number to the last bit)."""
    import draftadapt.adapter as adapter_module

    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "score_once", small_cfg())
    adapter.observe(rollouts(world, seed=11), policy_version=0)
    assert adapter.run_round()["adapt/published"] == 1.0  # the served draft is no longer the frozen one
    adapter.observe(rollouts(world, seed=12), policy_version=1)
    scored = []
    real = adapter_module.score_draft
    monkeypatch.setattr(adapter_module, "score_draft", lambda draft, *a, **kw: scored.append(draft) or real(draft, *a, **kw))
    live = adapter.publisher.live
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and "guard/served_simulated" in m, m
    assert m["accept/simulated_live"] == m["guard/served_simulated"], m
    assert sum(d is live for d in scored) == 1 and sum(d is adapter._frozen for d in scored) == 1, scored
    assert len(scored) == 3, scored  # served and frozen (the guard), the candidate (one block)
    # a round whose held-out share the guard did not score (no guard: the frozen draft serves) scores it itself
    adapter._serving_frozen = True
    adapter.observe(rollouts(world, seed=13), policy_version=2)
    scored.clear()
    live = adapter.publisher.live
    m = adapter.run_round()
    assert "guard/served_simulated" not in m and sum(d is live for d in scored) == 1, m


def test_the_guard_goes_back_to_the_frozen_draft_when_the_served_one_falls_below_it(world, trained, toy_target):
    """A published draft worse than the first one (its weights zeroed: it drafts one token
    whatever the context, as a draft left far behind by the policy does) is replaced
    at the next round call by the frozen first draft, published as the next version and served."""
    engine = world["engine"]
    cfg = small_cfg()
    cfg.schedule = ScheduleConfig(every_n_steps=0, drift_fraction=0.0, min_sequences=8)  # the guard alone: no round due
    adapter = DraftAdapter(toy_target, trained, world["root"] / "keep_better", cfg)
    first = {k: v.clone() for k, v in adapter.trainer.draft.state_dict().items()}
    bad = {k: torch.zeros_like(v) if v.is_floating_point() and v.ndim == 2 else v for k, v in first.items()}
    adapter.trainer.draft.load_state_dict(bad)
    bad_version = adapter.publish()
    adapter._serving_frozen = False  # what a round's publish sets
    adapter.swap(engine)
    served_bad = engine.generate(world["prompts"][:16], temperature=1.0, max_tokens=48, seed=7).acceptance.length
    adapter.observe(rollouts(world, seed=5), policy_version=0)
    m = adapter.run_round()
    assert m["guard/reverted"] == 1.0 and m["draft/published_version"] == bad_version + 1, m
    assert m["guard/served_simulated"] < m["guard/frozen_simulated"] * (1 - adapter.cfg.validation.guard_margin), m
    assert m["guard/served_over_frozen"] == pytest.approx(m["guard/served_simulated"] / m["guard/frozen_simulated"])
    assert adapter.store.latest().version == bad_version + 1
    live = adapter.live_draft().state_dict()
    for k, v in first.items():  # the new version is the first draft's weights, and so is the trainer's start
        assert torch.equal(live[k], v), k
    res = adapter.swap(engine)
    assert res is not None and res.version == bad_version + 1
    back = engine.generate(world["prompts"][:16], temperature=1.0, max_tokens=48, seed=7).acceptance.length
    assert back > served_bad * 1.1, (back, served_bad)  # the engine serves the better draft again
    # the frozen draft serving: the guard has nothing to compare until the next publish
    adapter.observe(rollouts(world, seed=6), policy_version=0)
    assert "guard/reverted" not in adapter.run_round()


def test_integrity_guard_swaps_the_lost_draft_back(world, trained, toy_target):
    engine = world["engine"]
    adapter = DraftAdapter(toy_target, trained, world["root"] / "guard", small_cfg())
    res = adapter.swap(engine)
    assert res is not None
    expected = res.checksum
    assert adapter.check_integrity(engine)
    # something else (a weight sync gone wrong, a sleep/wake) puts another draft in behind our back
    engine.swap_draft(world["draft0"])
    assert engine.draft_state()["checksum"] != expected
    assert not adapter.check_integrity(engine)  # detected and repaired
    assert engine.draft_state()["checksum"] == expected
    assert adapter.check_integrity(engine)


def test_a_draft_lost_in_the_engine_is_noticed_from_acceptance_and_swapped_in_again(world, trained, toy_target,
                                                                                    tmp_path):
    """vLLM #52479's failure: the draft's weights go to zero inside the running engine and nothing
    raises. Here they are loaded as zeros into the worker behind every record the engine keeps
    (no swap, the same version number), and the checksum check is left out: only the acceptance
    the engine measures, set against what the draft it should serve simulates on the same
    rollouts, can tell. The next round call notices, the boundary swaps the newest version in
    again, and the step after it accepts what it accepted before."""
    from safetensors.torch import save_file

    from draftadapt.boundary import StepBoundary
    from draftadapt.engine.worker_ext import WorkerCall

    engine = world["engine"]
    cfg = small_cfg()
    cfg.schedule = ScheduleConfig(every_n_steps=0, drift_fraction=0.0, min_sequences=8)  # the checks alone
    adapter = DraftAdapter(toy_target, trained, world["root"] / "lost", cfg)
    boundary = StepBoundary(adapter, engine)
    served = adapter.swap(engine).version  # the trained head serves, as this store's first version

    def step(seed: int, version: int):
        gen = engine.generate(world["prompts"][:32], temperature=1.0, max_tokens=48, seed=seed)
        boundary.report(gen.acceptance)  # the engine's counters, as the loop reports them
        adapter.observe(gen.rollouts, policy_version=version)  # a step's own version: its rows are the newest
        return gen.acceptance, adapter.run_round()

    good, m = step(seed=21, version=1)
    assert m["guard/lost_draft"] == 0.0, m
    # measured and simulated on the same rows agree for a draft that serves (sampling noise only)
    assert m["guard/first_simulated"] >= 0.1 and abs(m["guard/first_measured"] - m["guard/first_simulated"]) < 0.1, m
    assert adapter.swap(engine) is None  # nothing newer, nothing lost: no swap

    weights = load_file(str(engine.draft_dir / WEIGHTS_FILE))
    zeros = {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in weights.items()}
    save_file(zeros, str(tmp_path / "zeros.safetensors"))
    engine._rpc(WorkerCall.LOAD_DRAFT, str(tmp_path / "zeros.safetensors"), None, served)
    lost, m = step(seed=22, version=2)
    assert lost.reached_rates[0] < 0.5 * good.reached_rates[0], (lost.reached_rates, good.reached_rates)
    assert m["guard/lost_draft"] == 1.0, m
    assert m["guard/first_measured"] < adapter.cfg.validation.lost_below * m["guard/first_simulated"], m
    res = adapter.swap(engine)  # the boundary's swap: the newest version in again, although it "serves" it
    assert res is not None and res.version == served
    assert adapter.swap(engine) is None  # once
    back, m = step(seed=21, version=3)  # within one step: the first step's acceptance, the same draft, prompts and seed
    assert back.length == pytest.approx(good.length, rel=1e-9), (back.length, good.length)
    assert m["guard/lost_draft"] == 0.0, m


def test_drift_trigger_trains_only_when_acceptance_fell(world, trained, toy_target):
    cfg = small_cfg()
    cfg.schedule = ScheduleConfig(every_n_steps=0, drift_fraction=0.10, train_steps=2, min_sequences=8)
    adapter = DraftAdapter(toy_target, trained, world["root"] / "drift", cfg)
    adapter.observe(rollouts(world, seed=5), policy_version=0)
    assert adapter.run_round().get("adapt/skipped") == 1.0  # no schedule, no reference yet
    adapter.report_measured(3.0)  # the engine's first measurement of the live draft: the reference
    published = adapter.store.latest().version
    adapter.observe(rollouts(world, seed=6), policy_version=0)
    adapter.report_measured(2.9)  # -3%: within the 10% band
    assert adapter.run_round().get("adapt/skipped") == 1.0
    adapter.report_measured(2.5)  # -17% since the last round: drift
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and m["adapt/trigger_drift"] == 1.0, m
    assert adapter.store.latest().version >= published


def test_a_round_over_max_share_waits_and_stays_due(world, toy_target):
    """schedule.max_share: after a first round, a run that has spent almost no time outside the
    adapter has not earned the next one; it is deferred (logged), and runs once the run's time
    makes it fit."""
    cfg = small_cfg()
    cfg.schedule = ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=2, min_sequences=8, max_share=0.2)
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "max_share", cfg)
    first, second = rollouts(world, seed=7), rollouts(world, seed=8)  # generated before the adapter's clock starts
    adapter.observe(first, policy_version=0)
    assert adapter.run_round()["adapt/trained"] == 1.0  # the first round: nothing to expect yet
    round_s = adapter.cost.round_s
    adapter.observe(second, policy_version=0)
    m = adapter.run_round()
    assert m["adapt/deferred"] == 1.0 and m["adapt/trained"] == 0.0, m
    assert 0.5 < m["adapt/share"] <= 1.0, m  # nearly all the time so far was the adapter's
    time.sleep(5 * (adapter.cost.spent + round_s) + 0.2)  # the RL step's time: the round now fits in 20%
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and "adapt/deferred" not in m, m


def test_a_round_the_budget_cannot_pay_runs_the_steps_that_fit_and_the_age_bound_ends_a_wait(world, toy_target):
    """schedule.partial_rounds: where a whole round (6 steps) does not fit max_share but some
    steps do, the round runs those steps instead of waiting. schedule.max_draft_age: where not
    one step fits, the due round waits, but no longer than until the served draft was last
    trained or scored 3 policy versions ago; then one step runs over the budget. Run time is
    credited (CostMeter.credit) rather than slept: the budget is exact, not the machine's."""
    cfg = small_cfg()
    cfg.schedule = ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=6, min_sequences=8, max_share=0.2,
                                  max_draft_age=3)
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "partial", cfg)
    adapter.observe(rollouts(world, seed=7), policy_version=0)
    assert adapter.run_round()["adapt/train_steps"] == 6.0  # the first round: whole, and measured
    cost = adapter.cost
    assert cost.step_s > 0 and cost.fixed_s > 0
    adapter.observe(rollouts(world, seed=8), policy_version=0)
    # the run's time that makes room for the round's fixed part and three of its six steps
    room = cost.fixed_s + 3 * cost.step_s
    cost.credit((room * (1 - 0.2) + cost.spent) / 0.2 - cost.elapsed())
    m = adapter.run_round()
    assert m["adapt/partial"] == 1.0 and m["adapt/trained"] == 1.0 and 1 <= m["adapt/train_steps"] < 6, m
    cost.max_share = 0.01  # from here not one step fits
    weights = policy_weights(toy_target)
    for version in (1, 2, 3):
        adapter.update_policy(weights, version=version)  # the policy moves on (the same weights: the count is the point)
        adapter.observe(rollouts(world, seed=8 + version), policy_version=version)
        m = adapter.run_round()
        assert m["draft/age_validated"] == version, m
        if version < 3:
            assert m["adapt/deferred"] == 1.0 and m["adapt/trained"] == 0.0, m
    assert m["adapt/age_bound"] == 1.0 and m["adapt/trained"] == 1.0 and m["adapt/train_steps"] == 1.0, m
    adapter.update_policy(weights, version=4)
    adapter.observe(rollouts(world, seed=13), policy_version=4)
    assert adapter.run_round()["draft/age_validated"] == 1.0  # counted from the round the bound ran


@pytest.mark.parametrize("chase_gain, next_round", [(1e-6, True), (10.0, False)])
def test_a_round_that_gained_brings_the_next_one_at_the_next_step(world, toy_target, chase_gain, next_round):
    """Chase: a random head gains on the held-out rollouts in every round; with chase_gain below
    that gain the next round is due one RL step later although every_n_steps is 3; with a gain
    no round reaches (1000%) it is not."""
    cfg = small_cfg(batch_size=16)
    cfg.schedule = ScheduleConfig(every_n_steps=3, drift_fraction=0.0, train_steps=2, min_sequences=8,
                                  chase_gain=chase_gain)
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / f"chase-{chase_gain}", cfg)
    adapter.observe(rollouts(world, seed=7), policy_version=0)
    first = adapter.run_round(force=True)
    assert first["adapt/published"] == 1.0 and first["accept/simulated_length"] > first["accept/simulated_live"], first
    adapter.observe(rollouts(world, seed=8), policy_version=0)
    m = adapter.run_round()
    if next_round:
        assert m["adapt/trained"] == 1.0 and m["adapt/trigger_chase"] == 1.0, m
    else:
        assert m.get("adapt/skipped") == 1.0, m


@pytest.mark.parametrize("max_train_steps, gain, expected_steps", [
    (0, 0.02, 2),  # catch-up off: one block of train_steps
    (6, 1e-6, 6),  # a random head gains every block: blocks until the round's budget is spent
    (6, 10.0, 2),  # no block gains 1000%: stops after the first
])
def test_catch_up_trains_more_only_while_it_pays(world, toy_target, max_train_steps, gain, expected_steps):
    cfg = small_cfg(batch_size=16)  # 8 sequences a step left one block of a random head without a gain
    cfg.schedule = ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=2, min_sequences=8,
                                  max_train_steps=max_train_steps, catchup_gain=gain)
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / f"catchup{max_train_steps}-{gain}", cfg)
    adapter.observe(rollouts(world, seed=7), policy_version=0)
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and m["adapt/train_steps"] == expected_steps, m


def test_under_max_share_catch_up_stops_when_the_next_block_would_not_fit(world, toy_target):
    """The same round as the catch-up case that goes to 6 steps, under a 20% cap with nearly all
    the run's time so far the adapter's: the first block runs (a due round is not cut), the
    next would pass the share, so the round publishes after 2 steps; the next round is expected
    to cost what the round took up to its first block scored."""
    cfg = small_cfg(batch_size=16)
    cfg.schedule = ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=2, min_sequences=8,
                                  max_train_steps=6, catchup_gain=1e-6, max_share=0.2)
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "catchup-capped", cfg)
    adapter.observe(rollouts(world, seed=7), policy_version=0)  # generated before the clock starts
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and m["adapt/train_steps"] == 2, m
    assert 0 < adapter.cost.round_s <= m["stage/adapt_s"], (adapter.cost.round_s, m)


def _priorities_after_a_round(adapter, steps: int, batch: int):
    """The round's draws got the trainer's per-sequence losses; the held-out rollouts none."""
    held = {it.uid for it in adapter.replay.heldout()}
    seen = [it for it in adapter.replay if it.priority is not None]
    assert seen and all(it.uid not in held for it in seen)
    assert len(seen) <= steps * batch
    assert all(0 < it.priority < 50 for it in seen), [it.priority for it in seen]
    last = adapter.trainer.last_row_losses
    assert last is not None and last.shape == (batch,)
    # the last batch's losses are what its sequences now carry
    assert {round(v, 6) for v in last.tolist()} <= {round(it.priority, 6) for it in seen}
    return seen


def test_prioritized_rounds_record_each_draws_loss(world, toy_target):
    """adapter.priority: a round draws one optimizer step at a time and records the draft's loss
    on each sequence it trained on; a prioritized round still trains and publishes."""
    cfg = small_cfg(batch_size=8)
    cfg.priority = 1.0
    adapter = DraftAdapter(toy_target, world["draft0"], world["root"] / "priority", cfg)
    adapter.observe(rollouts(world, seed=7), policy_version=0)
    m = adapter.run_round()
    assert m["adapt/trained"] == 1.0 and m["adapt/train_steps"] == 6, m
    assert m["adapt/published"] == 1.0 and m["accept/simulated_length"] > m["accept/simulated_live"], m
    _priorities_after_a_round(adapter, steps=6, batch=8)
    with pytest.raises(ConfigError, match="adapter.priority"):
        AdapterConfig(priority=-1.0).validate()


def test_catch_up_config_is_checked():
    with pytest.raises(ConfigError, match="max_train_steps"):
        AdapterConfig(schedule=ScheduleConfig(train_steps=10, max_train_steps=5)).validate()


def test_draft_lm_adapts_and_swaps(toy_target, tmp_path):
    """The same loop with a small draft LM served by method draft_model."""
    draft0 = init_draft(toy_target, "draft_model", tmp_path / "lm0", seed=0)
    engine = start_engine(toy_target, draft0, method="draft_model", k=K)
    try:
        cfg = small_cfg("draft_model")
        cfg.priority = 1.0  # the draft LM's per-sequence losses feed the replay priorities too
        adapter = DraftAdapter(toy_target, draft0, tmp_path / "out", cfg)
        gen = engine.generate(toy_prompts(toy_target, 48), temperature=1.0, max_tokens=64, seed=1)
        adapter.observe(gen.rollouts, policy_version=0)
        m = adapter.run_round()
        assert m["adapt/published"] == 1.0, m
        _priorities_after_a_round(adapter, steps=6, batch=8)
        assert m["accept/simulated_length"] > m["accept/simulated_live"], m
        res = adapter.swap(engine)
        assert res is not None and res.version == 2
        assert engine.draft_state()["checksum"] == res.checksum
        after = engine.generate(toy_prompts(toy_target, 8), temperature=1.0, max_tokens=32, seed=2)
        assert after.acceptance.drafts > 0
    finally:
        stop_engine(engine)
