"""The adapter's schedule: when a round is due (pure logic, no engine)."""

import time

import pytest

from draftadapt.adapter import CostMeter, DriftTrigger, ScheduleConfig
from draftadapt.boundary import StepBoundary
from draftadapt.metrics.acceptance import AcceptanceStats


def test_without_an_engine_the_first_simulated_score_is_the_reference():
    """No engine measurement: the live draft's simulated score at the first check is the
    reference, and a later drop by more than drift_fraction triggers a round."""
    trig = DriftTrigger(ScheduleConfig(every_n_steps=0, drift_fraction=0.05, min_sequences=1))
    scores = iter([3.6, 3.55, 3.3])
    assert trig.due(10, lambda: next(scores)) == (False, "not_due")  # sets the reference 3.6
    assert trig.reference == 3.6
    trig.observed()
    assert trig.due(10, lambda: next(scores)) == (False, "not_due")  # -1.4%
    assert trig.due(10, lambda: next(scores)) == (True, "drift")  # -8.3%
    trig.trained(True, 3.58)
    assert trig.reference == 3.58  # the published candidate's score is the new reference


def test_an_engine_measurement_is_used_without_simulating():
    trig = DriftTrigger(ScheduleConfig(every_n_steps=0, drift_fraction=0.05, min_sequences=8))

    def never():
        raise AssertionError("simulated although the engine measured")

    trig.report(3.7)
    trig.observed()
    assert trig.due(10, never) == (False, "not_due")
    trig.report(3.4)  # -8.1%
    assert trig.due(10, never) == (True, "drift")
    assert trig.due(4, never) == (False, "too_few_sequences")


def test_an_engine_measurement_replaces_a_simulated_reference():
    """Simulated and measured lengths are not comparable: the first measurement is the reference."""
    trig = DriftTrigger(ScheduleConfig(every_n_steps=0, drift_fraction=0.10, min_sequences=1))
    assert trig.due(10, lambda: 2.6) == (False, "not_due")  # simulated reference 2.6
    trig.report(3.0)
    assert trig.reference == 3.0
    trig.report(2.9)
    assert trig.reference == 3.0  # a measured reference stays until the next publish
    trig.report(2.5)
    assert trig.due(10, lambda: 2.6) == (True, "drift")


def test_a_round_that_gained_chase_gain_brings_the_next_round_a_step_later():
    """every_n_steps=2: after a round whose candidate beat the live draft by >= chase_gain, the
    next round is due after one observed step ("chase"); after a small gain, after two."""
    trig = DriftTrigger(ScheduleConfig(every_n_steps=2, drift_fraction=0.0, chase_gain=0.03, min_sequences=1))
    trig.trained(True, 3.10, 3.00)  # +3.3%: chasing
    assert trig.due(10, lambda: 3.0) == (False, "not_due")  # no step observed since the round
    trig.observed()
    assert trig.due(10, lambda: 3.0) == (True, "chase")
    trig.trained(True, 3.05, 3.00)  # +1.7%: back to the schedule
    trig.observed()
    assert trig.due(10, lambda: 3.0) == (False, "not_due")
    trig.observed()
    assert trig.due(10, lambda: 3.0) == (True, "schedule")
    trig.trained(False, 3.50, 3.00)  # a rejected round never chases
    trig.observed()
    assert trig.due(10, lambda: 3.0) == (False, "not_due")


def test_a_new_draft_measured_below_the_old_one_triggers_at_once():
    """The reference after a round is the engine's last measurement before it: a draft that
    measures 3% lower at its first step fell behind the policy (the step after a publish counts)."""
    trig = DriftTrigger(ScheduleConfig(every_n_steps=2, drift_fraction=0.03, min_sequences=1))

    def never():
        raise AssertionError("simulated although the engine measured")

    trig.report(3.09)
    trig.trained(True, 2.97, 2.99)
    assert trig.reference == 3.09
    trig.report(2.97)  # -3.9% at the new draft's first step
    trig.observed()
    assert trig.due(10, never) == (True, "drift")
    trig.trained(False, 2.70, 2.75)  # rejected: the next fall is measured from 2.97
    trig.report(2.95)  # -0.7%
    trig.observed()
    assert trig.due(10, never) == (False, "not_due")
    trig.report(3.20)  # a higher measurement raises the reference
    assert trig.reference == 3.20
    trig.report(3.08)  # -3.75% from it
    assert trig.due(10, never) == (True, "drift")


def test_a_measured_fall_makes_a_scheduled_round_urgent():
    """A round both the schedule and a measured fall call for is a drift round (urgent: under the
    cost cap it may run burst_rounds ahead), not a scheduled one that the cap defers."""
    trig = DriftTrigger(ScheduleConfig(every_n_steps=2, drift_fraction=0.03, min_sequences=1))

    def never():
        raise AssertionError("simulated although the engine measured")

    trig.report(2.85)
    trig.trained(True, 2.9, 2.8)
    trig.observed()
    trig.report(2.83)  # -0.7%: neither
    assert trig.due(10, never) == (False, "not_due")
    trig.observed()
    assert trig.due(10, never) == (True, "schedule")  # due by the schedule, no fall
    trig.report(2.66)  # -6.7% from 2.85
    assert trig.due(10, never) == (True, "drift")
    # no engine measurement: the schedule decides first, and nothing is simulated for it
    bare = DriftTrigger(ScheduleConfig(every_n_steps=1, drift_fraction=0.03, min_sequences=1))
    bare.observed()
    assert bare.due(10, never) == (True, "schedule")


def table_batch(rates: list[float], k_of_drafts: dict[int, int]) -> AcceptanceStats:
    """The engine's counts for one RL batch under a per-batch-size k table: ``k_of_drafts``
    {draft length: drafts of it}, every draft accepting position i with the reached rate
    ``rates[i]`` (exact expected counts), at k_max = len(rates)."""
    k = len(rates)
    accepted = [sum(n * rates[i] for kk, n in k_of_drafts.items() if kk > i) for i in range(k)]
    drafted = [sum(n for kk, n in k_of_drafts.items() if kk > i) for i in range(k)]
    return AcceptanceStats(k, sum(k_of_drafts.values()), accepted, drafted_per_pos=drafted)


def test_the_length_at_k_does_not_move_with_the_tables_mix_of_draft_lengths():
    rates = [0.9, 0.8, 0.7, 0.6, 0.5]
    short, long = table_batch(rates, {3: 900, 5: 100}), table_batch(rates, {3: 100, 5: 900})
    assert long.length / short.length > 1.2  # the raw length: a fifth apart for the same draft
    for s in (short, long):
        assert s.length_at(3) == (pytest.approx(1 + 0.9 + 0.8 + 0.7), 3)
        assert s.length_at(5) == (pytest.approx(1 + sum(rates)), 5)
    # a table whose k stays below the adapter's: the positions some draft reached
    assert table_batch(rates, {2: 1000}).length_at(3) == (pytest.approx(2.7), 2)
    assert AcceptanceStats(3, 100, [80, 60, 50]).length_at(3) == (pytest.approx(2.9), 3)  # one k, no per-position drafts
    assert AcceptanceStats(3, 100, [80, 60, 50]).length_at(5) == (pytest.approx(2.9), 3)  # deeper than the engine drafts


class ReportingAdapter:
    """What StepBoundary.report touches of an adapter: its k and report_measured."""

    def __init__(self, k: int):
        self.cfg = type("Cfg", (), {"k": k})()
        self.trigger = DriftTrigger(ScheduleConfig(every_n_steps=0, drift_fraction=0.03, min_sequences=1))

    def report_measured(self, length, first_rate=None, positions=None):
        self.trigger.report(length, positions)


def test_the_drift_trigger_reads_the_rl_batch_at_the_adapters_k_not_the_tables_mix():
    """The toy's seed-57 run: the raw RL-batch length went 4.17 -> 3.38 -> 4.00 while the draft's
    rates held (the table's k flipped), which fired a round at step 3 for nothing, and hid the
    real fall later. The boundary reports the length at the adapter's k: the flips leave it
    where it is, a 5% fall of every rate fires."""
    def never():
        raise AssertionError("simulated although the engine measured")

    rates = [0.9, 0.8, 0.7, 0.6, 0.5]
    adapter = ReportingAdapter(k=3)
    boundary = StepBoundary(adapter, [])
    raw = ReportingAdapter(k=3)  # fed the raw length, as before
    for mix in ({3: 100, 5: 900}, {3: 900, 5: 100}, {3: 100, 5: 900}, {3: 900, 5: 100}):
        batch = table_batch(rates, mix)
        m = boundary.report(batch)
        assert m["accept/rl_batch_length_at_k"] == pytest.approx(3.4) and m["accept/rl_batch_length"] == batch.length
        adapter.trigger.observed()
        assert adapter.trigger.due(64, never) == (False, "not_due")
        raw.trigger.report(batch.length)
    assert raw.trigger.due(64, never) == (True, "drift")  # the false alarm the mix alone raised
    boundary.report(table_batch([r * 0.95 for r in rates], {3: 100, 5: 900}))
    assert adapter.trigger.due(64, never) == (True, "drift")
    # a table that drafts fewer positions than the adapter's k: a new reference, not a fall
    boundary.report(table_batch(rates, {2: 1000}))
    assert adapter.trigger.positions == 2 and adapter.trigger.reference == pytest.approx(2.7)
    assert adapter.trigger.due(64, never) == (False, "not_due")


def test_the_cost_meter_defers_a_round_until_the_run_has_earned_it():
    meter = CostMeter(0.05)
    assert meter.allows_round()  # before any round: nothing to expect yet
    meter.start, meter.spent, meter.round_s = time.perf_counter() - 10.0, 0.3, 0.4
    assert not meter.allows_round()  # 0.3 + 0.4 s > 5% of 10.4 s
    assert meter.allows_round(advance_rounds=1)  # a drift or chase round may run one round ahead: 0.7 <= 0.52 + 0.4
    assert abs(meter.share() - 0.03) < 0.001
    meter.start -= 10.0  # ten seconds later, nothing spent since
    assert meter.allows_round()  # 0.7 s <= 5% of 20.4 s
    with meter.timed():
        with meter.timed():  # a timed call inside another counts once
            time.sleep(0.05)
    assert 0.35 <= meter.spent < 0.45, meter.spent
    off = CostMeter(0.0)
    off.start, off.spent, off.round_s = time.perf_counter() - 1.0, 100.0, 100.0
    assert off.allows_round() and off.allows(100.0, running_s=100.0)


def test_a_catch_up_block_asks_for_its_own_time():
    """Inside a round, another block fits only if what the round has spent so far (not in
    ``spent`` until the call returns) plus the block stays within the share."""
    meter = CostMeter(0.05)
    meter.start, meter.spent = time.perf_counter() - 20.0, 0.2
    assert meter.allows(0.4)  # 0.6 s <= 5% of 20.4 s
    assert not meter.allows(0.4, running_s=0.5)  # 1.1 s > 1.02 s
    assert meter.allows(0.4, advance_s=0.3, running_s=0.5)  # an urgent round's advance: 1.1 <= 1.32


def test_a_partial_round_gets_the_optimizer_steps_the_budget_affords():
    """CostMeter.affordable_steps: the most seconds x with spent + x <= share * (elapsed + x) +
    advance, less the round's fixed part, in whole steps of the last round's step time."""
    meter = CostMeter(0.05)
    assert meter.affordable_steps() == 0  # no round measured yet
    meter.start, meter.spent, meter.step_s, meter.fixed_s = time.perf_counter() - 100.0, 4.0, 0.3, 0.2
    assert meter.affordable_steps() == 2  # x <= (5.0 - 4.0) / 0.95 = 1.053 s: 0.2 s fixed + 2 x 0.3 s
    assert meter.affordable_steps(advance_s=0.95) == 6  # (5.0 + 0.95 - 4.0) / 0.95 = 2.05 s: 0.2 s + 6 x 0.3 s
    meter.spent = 6.0
    assert meter.affordable_steps() == 0  # over the share already
    assert CostMeter(0.0).affordable_steps() == 0  # no cap: rounds are never partial


def test_time_the_run_says_is_not_its_own_is_off_the_clock():
    """adapter.not_counted(): an evaluation between RL steps neither earns the adapter time nor
    charges it for the adapter calls made inside it."""
    meter = CostMeter(0.05)
    with meter.timed():
        pass
    before = meter.spent
    with meter.excluded():
        with meter.timed():
            time.sleep(0.05)
    assert meter.spent == before and meter.excluded_s >= 0.05
    assert meter.elapsed() < 0.05


def test_credited_time_counts_as_the_runs():
    """CostMeter.credit: run time outside this process's clock (a replay emulating the RL step)
    earns the adapter its share as if it had passed here."""
    meter = CostMeter(0.05)
    with meter.timed():
        time.sleep(0.02)
    meter.round_s = 0.5
    assert not meter.allows_round()  # 0.52 s > 5% of ~0.52 s
    meter.credit(10.0)
    assert 10.0 <= meter.elapsed() < 10.5
    assert meter.allows_round()  # 0.52 s <= 5% of ~10.5 s
    assert 0.001 < meter.share() < 0.003
