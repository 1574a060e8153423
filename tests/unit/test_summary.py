"""The demo's and the TRL recipe's whole-run block: the dip and the mean over every step."""

from __future__ import annotations

import math

import pytest

from draftadapt.rl.summary import whole_run


def test_whole_run_block_from_per_step_acceptance():
    adapted = [3.2, 2.8, float("nan"), 2.4, 3.6]  # a step where nothing was drafted is left out
    frozen = [3.2, 2.8, 2.9, 2.4, 2.4]
    w = whole_run(adapted, frozen, [False, False, False, True, False])
    assert w["adapted_mean"] == pytest.approx(12.0 / 4, rel=1e-12)
    assert w["frozen_mean"] == pytest.approx(10.8 / 4, rel=1e-12)
    assert w["adapted_over_frozen"] == pytest.approx(12.0 / 10.8, rel=1e-12)
    assert w["adapted_worst_over_start"] == pytest.approx(2.4 / 3.2, rel=1e-12)
    assert w["adapted_retention"] == pytest.approx(3.0 / 3.2, rel=1e-12)
    assert w["first_publish_step"] == 4  # steps count from 1


def test_whole_run_without_a_publish_or_a_measured_step():
    assert whole_run([3.0, 2.0], [3.0, 2.5], [False, False])["first_publish_step"] is None
    assert whole_run([math.nan], [math.nan], [True]) == {}


def test_end_to_end_means_leave_out_the_warm_up_step():
    from draftadapt.rl.summary import end_to_end

    def step(rl, gen, train, adapt):
        return {"stage/rl_step_s": rl, "stage/gen_s": gen, "stage/exposed_gen_s": gen, "stage/train_s": train,
                "stage/adapt_s": adapt}

    e = end_to_end([step(100.0, 60.0, 38.0, 2.0), step(10.0, 4.0, 5.5, 0.5), step(12.0, 5.0, 6.0, 1.0)])
    assert e["from_step"] == 2
    assert e["rl_step_s"] == pytest.approx(11.0) and e["gen_s"] == pytest.approx(4.5)
    assert e["adapt_share"] == pytest.approx(0.75 / 11.0) and e["rl_step_without_adapter_s"] == pytest.approx(10.25)
    one = end_to_end([step(100.0, 60.0, 38.0, 2.0)])  # a one-step run has only its first step
    assert one["from_step"] == 1 and one["rl_step_s"] == pytest.approx(100.0)


def test_each_third_ends_on_a_step_and_the_run_s_last_is_one():
    from draftadapt.rl.arms import third_ends

    assert third_ends(15) == [4, 9, 14] and third_ends(6) == [1, 3, 5] and third_ends(7) == [1, 4, 6]
    assert third_ends(2) == [0, 1] and third_ends(1) == [0]
    for n in range(1, 40):
        ends = third_ends(n)
        assert ends[-1] == n - 1 and len(ends) == min(n, 3) and all(0 <= e < n for e in ends), (n, ends)


def test_the_summary_reports_what_each_third_served_at_the_rl_batch():
    from draftadapt.rl.config import DemoConfig
    from draftadapt.rl.summary import summarize

    rows = [{"step": i, "rl/reward": 0.0, "rl/accuracy": 0.0, "stage/rl_step_s": 2.0, "stage/gen_s": 1.0,
             "stage/exposed_gen_s": 1.0, "stage/train_s": 1.0, "stage/adapt_s": 0.0} for i in range(6)]
    rows[1].update({"tps/rl_batch_served_over_plain": 1.0, "k/served_undrafted": 1.0})
    rows[3].update({"tps/rl_batch_served_over_plain": 0.97, "k/served_undrafted": 0.0})
    rows[5].update({"tps/rl_batch_served_over_plain": 1.2, "k/served_undrafted": 0.0})
    s = summarize(DemoConfig(spec=False), rows, {"plain": []}, 12.0)
    assert s["served_over_plain_at_rl_batch"] == {"steps": [2, 4, 6], "tokens_per_s": [1.0, 0.97, 1.2],
                                                  "undrafted": [True, False, False]}
    del rows[1]["tps/rl_batch_served_over_plain"], rows[3]["tps/rl_batch_served_over_plain"]
    del rows[5]["tps/rl_batch_served_over_plain"]
    assert "served_over_plain_at_rl_batch" not in summarize(DemoConfig(spec=False), rows, {"plain": []}, 12.0)
