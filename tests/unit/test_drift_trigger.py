"""The adapter's schedule: when a round is due (pure logic, no engine)."""

from draftadapt.adapter import DriftTrigger, ScheduleConfig


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
