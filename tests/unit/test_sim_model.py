"""The step model's limits (issue 5's bar) and its building blocks, on small configs (fast)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from draftadapt.config import load_config
from draftadapt.sim.config import SimConfig
from draftadapt.sim.model import (
    accept_length,
    beta_for_length,
    capped_lognormal_mean,
    decayed_length,
    engine_model,
    geometric_pos,
    median_for_mean,
    response_lengths,
    simulate,
    simulate_step,
    spec_step_s,
    step_ceiling,
    target_step_s,
)

# 8B on 8 GB200, 64 sequences per replica: milliseconds per simulation
SMALL = ["workload.rollouts=512", "cluster.gpus=8", "workload.median_tokens=1500",
         "workload.sigma=0.8", "workload.max_tokens=8192", "spec.k=3", "spec.accept_length=3.0"]
SPLIT = ["cluster.gpus=12", "cluster.colocated=false", "cluster.gen_gpus=8", "cluster.train_gpus=4",
         "pipeline.modes=[sync,async]"]
FREE_DRAFTER = ["spec.method=ngram", "engine.draft_overhead_ms=0", "engine.verify_overhead_ms=0"]


def small(*overrides: str) -> SimConfig:
    return load_config(SimConfig, None, SMALL + list(overrides))


# --- acceptance ---------------------------------------------------------------------------


def test_accept_length_counts_the_bonus_token():
    assert accept_length([0.8, 0.5, 0.2]) == pytest.approx(2.5)
    assert accept_length([]) == 1.0


@pytest.mark.parametrize("alpha,k", [(1.0, 3), (2.77, 3), (3.32, 3), (4.0, 5), (5.06, 7), (4.0, 3)])
def test_beta_for_length_inverts_the_geometric_profile(alpha, k):
    beta = beta_for_length(alpha, k)
    assert accept_length(geometric_pos(beta, k)) == pytest.approx(alpha, abs=1e-6)


def test_frozen_draft_decays_towards_its_floor():
    seq = [decayed_length(3.3, 3, 0.05, t, floor=2.4) for t in range(200)]
    assert seq[0] == pytest.approx(3.3)
    assert all(a >= b for a, b in zip(seq, seq[1:]))  # never recovers by itself
    assert seq[-1] == pytest.approx(2.4, abs=1e-3)
    assert decayed_length(3.3, 3, 0.0, 50) == 3.3  # no drift, no decay


# --- workload -----------------------------------------------------------------------------


def test_lengths_are_capped_quantiles_with_the_analytic_mean():
    cfg = small("workload.rollouts=4096", "workload.sigma=1.2")
    lengths = response_lengths(cfg, 4096)
    assert lengths.max() == cfg.workload.max_tokens  # the tail hits the cap
    assert np.all(np.diff(np.sort(lengths)) >= 0)
    analytic = capped_lognormal_mean(1500, 1.2, 8192)
    assert lengths.mean() == pytest.approx(analytic, rel=0.01)


def test_median_for_mean_round_trips():
    cfg = small()
    median = median_for_mean(cfg, 2000.0)
    assert capped_lognormal_mean(median, cfg.workload.sigma, cfg.workload.max_tokens) == pytest.approx(2000.0)


# --- roofline -----------------------------------------------------------------------------


def test_decode_step_is_memory_bound_at_batch_one():
    cfg = small("engine.step_overhead_ms=0")
    m = engine_model(cfg)
    # Qwen3-8B BF16: 7.57e9 matmul weights x 2 bytes at 8 TB/s x 0.8 (GB200 datasheet)
    weights_s = 7.57e9 * 2 / (8e12 * 0.8)
    assert target_step_s(m, 1, 100) == pytest.approx(weights_s, rel=0.02)
    # verifying k+1 tokens of one sequence costs (almost) the same memory-bound pass
    assert target_step_s(m, 1, 100, q=4) == pytest.approx(target_step_s(m, 1, 100), rel=0.01)


def test_step_time_grows_with_batch_and_context_and_verify_width():
    m = engine_model(small())
    assert target_step_s(m, 64, 64 * 2000) > target_step_s(m, 8, 8 * 2000)
    assert target_step_s(m, 64, 64 * 8000) > target_step_s(m, 64, 64 * 2000)
    # large batch: verification turns compute-bound and k+1 tokens are no longer free
    big = target_step_s(m, 1024, 1024 * 100, q=8) / target_step_s(m, 1024, 1024 * 100, q=1)
    assert big > 2.0


def test_moe_small_batches_touch_few_experts():
    m = engine_model(small("target.model=qwen3-235b-a22b", "target.weight_bytes=1", "engine.tp=8",
                           "engine.step_overhead_ms=0", "engine.allreduce_us=0"))
    one = target_step_s(m, 1, 1000)
    many = target_step_s(m, 256, 256 * 1000)
    assert one < 0.2 * many  # 8 of 128 experts vs all of them (plus KV)
    # so verifying 6 tokens of one sequence costs well above one token's step
    assert target_step_s(m, 1, 1000, q=6) > 1.5 * one


def test_wider_replica_is_faster_per_step():
    m1 = engine_model(small("target.model=qwen3-32b", "engine.tp=1", "cluster.gpus=8"))
    m4 = engine_model(small("target.model=qwen3-32b", "engine.tp=4", "cluster.gpus=8"))
    assert target_step_s(m4, 16, 16 * 2000) < target_step_s(m1, 16, 16 * 2000)


# --- the bar: limits ----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], SPLIT])
def test_no_speculation_gives_speedup_one(extra):
    cfg = small("spec.k=0", "spec.accept_length=1.0", *extra)
    res = simulate(cfg, sweep=False)
    for mode in cfg.pipeline.modes:
        assert res.figures[f"{mode}.gen_speedup.spec"] == pytest.approx(1.0, abs=1e-12)
        assert res.figures[f"{mode}.e2e_speedup.spec"] == pytest.approx(1.0, abs=1e-12)


def test_useless_free_drafter_gives_speedup_one_when_memory_bound():
    # one sequence per replica: every step is memory-bound, verifying 4 tokens costs one pass
    cfg = small("workload.rollouts=8", "workload.prompt_tokens=16", "spec.accept_length=1.0",
                "engine.step_overhead_ms=0", *FREE_DRAFTER)
    res = simulate(cfg, sweep=False)
    assert res.figures["sync.gen_speedup.spec"] == pytest.approx(1.0, abs=0.01)
    assert res.figures["sync.gen_speedup.spec"] <= 1.0 + 1e-9


@pytest.mark.parametrize("k", [1, 3, 5])
def test_perfect_acceptance_free_drafter_reaches_the_memory_bound_ceiling(k):
    # memory-bound decode (one sequence per replica), zero-cost drafter, every draft accepted:
    # each target pass yields k+1 tokens for the price of one
    cfg = small("workload.rollouts=8", "workload.prompt_tokens=16", f"spec.k={k}",
                f"spec.accept_length={k + 1}", "engine.step_overhead_ms=0", *FREE_DRAFTER)
    res = simulate(cfg, sweep=False)
    assert res.figures["sync.gen_speedup.spec"] == pytest.approx(k + 1, rel=0.01)
    assert res.figures["sync.gen_speedup.spec"] <= k + 1 + 1e-9


@pytest.mark.parametrize("overrides", [
    [],
    ["spec.accept_length=1.5"],
    ["spec.k=5", "spec.accept_length=4.0", "pipeline.max_lag=2"],
    ["pipeline.async_batching=prompts"],
    ["pipeline.async_batching=prompts", "pipeline.max_lag=3", "workload.sigma=1.4"],
    ["cluster.gen_gpus=10", "cluster.train_gpus=2", "learner.train_mfu=0.1"],  # training-bound
    ["pipeline.async_batching=prompts", "pipeline.sync_on_trainer=true", "learner.logprob_passes=0"],
    ["target.model=qwen3-235b-a22b", "target.weight_bytes=1", "engine.tp=4", "cluster.gpus=24",
     "cluster.gen_gpus=16", "cluster.train_gpus=8", "spec.k=5", "spec.accept_length=4"],
])
def test_async_is_never_slower_than_sync_on_the_same_gpus(overrides):
    cfg = small(*SPLIT, *overrides)
    res = simulate(cfg, sweep=False)
    for config in ("plain", "spec"):
        assert res.figures[f"async.step_s.{config}"] <= res.figures[f"sync.step_s.{config}"] * (1 + 1e-6)


def test_sync_end_to_end_respects_the_papers_ceiling():
    cfg = small("sweep_points=6")
    res = simulate(cfg)
    share = res.rows["sync"]["plain"].gen_share
    for point in res.sweep["sync"]:
        alpha = point["accept_length"]
        assert point["gen_speedup"] <= alpha + 1e-9  # generation never beats acceptance
        assert point["e2e_speedup"] <= step_ceiling(share, alpha) + 1e-9


def test_speedup_rises_with_acceptance():
    res = simulate(small("sweep_points=5"))
    gains = [p["gen_speedup"] for p in res.sweep["sync"]]
    assert all(a < b for a, b in zip(gains, gains[1:]))


def test_longer_tail_at_same_mean_slows_generation():
    times = []
    for sigma in (0.3, 0.8, 1.4):
        cfg = small(f"workload.sigma={sigma}")
        cfg.workload.median_tokens = median_for_mean(cfg, 2000.0)
        times.append(simulate_step(cfg, "sync", None).gen_s)
    assert times[0] < times[1] < times[2]


def test_colocated_step_is_the_sum_of_its_stages():
    st = simulate_step(small("learner.data_s=0.3"), "sync", 3.0)
    assert st.step_s == pytest.approx(st.data_s + st.prepare_s + st.gen_s + st.logprob_s + st.train_s)


def test_drift_lowers_the_frozen_rows_acceptance_and_adaptation_restores_it():
    cfg = small("spec.drift_per_step=0.05", "spec.accept_floor=1.5", "adapt.enabled=true",
                "adapt.every_steps=5", "adapt.horizon_steps=40", "adapt.swap_ms=20")
    res = simulate(cfg, sweep=False)
    frozen, adapted = res.rows["sync"]["spec"], res.rows["sync"]["adapt"]
    assert frozen.accept_length < 3.0
    assert adapted.accept_length > frozen.accept_length
    assert adapted.adapt_s == pytest.approx(0.020 / 5)
    assert adapted.gen_s < frozen.gen_s


def test_spec_step_with_k_zero_is_a_plain_step():
    m = engine_model(small())
    assert spec_step_s(m, 32, 32 * 1000, 0) == target_step_s(m, 32, 32 * 1000)
    assert math.isfinite(spec_step_s(m, 32, 32 * 1000, 3))


@pytest.mark.parametrize("train_mfu", [0.4, 0.05])  # generation-bound, training-bound
def test_async_step_is_training_side_plus_weight_sync_plus_exposed_generation(train_mfu):
    """The paper's reading of a lag-1 step (docs/design.md "Simulator: asynchronous steps"):
    with the trainer broadcasting the weights, step = data + logprob + train + prepare +
    exposed generation; with the engine loading them, the trainer never waits for the load."""
    common = (*SPLIT, "pipeline.modes=[async]", "pipeline.async_batching=prompts",
              f"learner.train_mfu={train_mfu}", "learner.prepare_fixed_s=2.0")
    held = simulate_step(small(*common, "pipeline.sync_on_trainer=true"), "async", None)
    side = held.data_s + held.logprob_s + held.train_s
    assert held.step_s == pytest.approx(side + held.prepare_s + held.exposed_gen_s, rel=1e-6)
    loaded = simulate_step(small(*common), "async", None)
    assert loaded.step_s == pytest.approx(side + loaded.exposed_gen_s, rel=1e-6)
    if train_mfu < 0.1:  # training-bound: generation is hidden, the broadcast is not
        assert held.exposed_gen_s == loaded.exposed_gen_s == 0.0
        assert held.step_s == pytest.approx(loaded.step_s + held.prepare_s, rel=1e-6)


def test_a_verify_wider_than_the_decode_kernel_pays_per_mean_sequence_context():
    """k+1 <= decode_max_q: the roofline only; wider: + fallback per token of the mean
    sequence's context per query token, the same for a batch of 4 or 64 at that length."""
    base = engine_model(small())
    m = engine_model(small("engine.fallback_ns_per_ctx=100", "engine.decode_max_q=4"))
    for b in (4, 64):
        ctx = b * 8000.0
        assert target_step_s(m, b, ctx, 4) == target_step_s(base, b, ctx, 4)
        extra = target_step_s(m, b, ctx, 6) - target_step_s(base, b, ctx, 6)
        assert extra == pytest.approx(100e-9 * 8000.0 * 6)


def test_without_the_fallback_a_longer_draft_costs_at_most_k_over_3():
    """The bound behind the fallback (docs/design.md "Simulator: draft length and n-gram"): a
    step costing verify + k drafts grows at most 5/3 from k = 3 to 5, so RL-Think's 0.84x at
    k = 5 (2.1x its k = 3 cost per step) needs a cost that is not linear in k."""
    m = engine_model(small())
    for b, per_seq in ((1, 20000.0), (8, 15000.0), (128, 4000.0)):
        ratio = spec_step_s(m, b, b * per_seq, 5) / spec_step_s(m, b, b * per_seq, 3)
        assert 1.0 < ratio <= 5 / 3


def test_ngram_step_pays_host_matching_per_context_token():
    plain = engine_model(small(*FREE_DRAFTER))
    m = engine_model(small(*FREE_DRAFTER, "engine.ngram_ns_per_token=100"))
    for ctx in (1e5, 4e5):
        assert spec_step_s(m, 32, ctx, 3) - spec_step_s(plain, 32, ctx, 3) == pytest.approx(100e-9 * ctx)
    eagle = engine_model(small("engine.ngram_ns_per_token=100"))  # Eagle-3 ignores it
    assert spec_step_s(eagle, 32, 1e5, 3) == spec_step_s(engine_model(small()), 32, 1e5, 3)


# --- asynchronous steps on shared cores (the demo) ----------------------------------------


def test_shared_wall_runs_slow_beside_the_other_job_then_on_every_core():
    from draftadapt.sim.model import shared_wall

    assert shared_wall(3.0, 0.0, 2.0) == 3.0  # nothing beside it: all cores from the start
    assert shared_wall(3.0, 10.0, 2.0) == 6.0  # the other job outlasts it: slow all along
    # 4 s beside at half speed do 2 s of work; the 1 s left runs on every core
    assert shared_wall(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert shared_wall(3.0, 6.0, 2.0) == pytest.approx(6.0)  # the two cases meet
    assert shared_wall(3.0, 4.0, 1.0) == 3.0  # no slowdown: sharing costs nothing


def test_shared_async_step_exposes_only_the_generation_that_outlasts_the_trainer():
    from draftadapt.sim.config import SharedCoresConfig
    from draftadapt.sim.model import StageCosts, shared_async_step

    cores = SharedCoresConfig(gen_slowdown=1.5, train_slowdown=2.0, boundary_s=0.1)
    # training-bound: gen 3 s beside; train 1.5 s of work -> 3 s (still beside) + 0.5 s of work
    st = shared_async_step(StageCosts(gen_s=2.0, train_s=2.0, adapt_s=0.5), cores)
    assert st.gen_s == pytest.approx(3.0)
    assert st.train_s == pytest.approx(3.0 + 2.0 - 1.5)
    assert st.adapt_s == pytest.approx(0.5)  # after the generation: every core
    assert st.exposed_gen_s == 0.0
    assert st.step_s == pytest.approx(st.train_s + st.adapt_s + 0.1)
    # generation-bound: the trainer waits for the rest of the generation
    st = shared_async_step(StageCosts(gen_s=4.0, train_s=1.0, adapt_s=0.5), cores)
    assert st.gen_s == pytest.approx(6.0) and st.train_s == pytest.approx(2.0)
    assert st.adapt_s == pytest.approx(1.0)  # beside the generation too
    assert st.exposed_gen_s == pytest.approx(3.0)
    assert st.step_s == pytest.approx(6.0 + 0.1)
    # the last step: nothing beside the trainer; the first: the fill is exposed on top
    st = shared_async_step(StageCosts(gen_s=0.0, train_s=2.0, adapt_s=0.5), cores)
    assert st.step_s == pytest.approx(2.6) and st.exposed_gen_s == 0.0
    first = shared_async_step(StageCosts(gen_s=2.0, train_s=2.0, adapt_s=0.5), cores, fill_s=1.7)
    steady = shared_async_step(StageCosts(gen_s=2.0, train_s=2.0, adapt_s=0.5), cores)
    assert first.step_s == pytest.approx(steady.step_s + 1.7)
    assert first.exposed_gen_s == pytest.approx(1.7)


def test_shared_cores_config_rejects_nonsense():
    from draftadapt.config import ConfigError
    from draftadapt.sim.config import SharedCoresConfig

    with pytest.raises(ConfigError, match="cores.gen_slowdown=0"):
        SharedCoresConfig(gen_slowdown=0.0).validate()
    with pytest.raises(ConfigError, match="negative"):
        SharedCoresConfig(boundary_s=-1.0).validate()
