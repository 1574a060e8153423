"""adapt_gain: when adapting the draft pays, on a closed-form step time and the simulator's."""

from __future__ import annotations

import pytest

from draftadapt.config import load_config
from draftadapt.sim.config import SimConfig
from draftadapt.sim.costbenefit import adapt_gain, drift_between, step_time_fn
from draftadapt.sim.model import decayed_length


def linear_step(alpha: float) -> float:
    """A sync step of 50 s outside generation plus 100 s of generation sped up by alpha."""
    return 50.0 + 100.0 / alpha


def test_no_drift_and_nothing_to_restore_costs_exactly_the_adaptation():
    d = adapt_gain(3.0, 0.0, 5.0, restored_accept=3.0, k=3, step_time=linear_step, horizon_steps=20)
    assert d.gain_s == pytest.approx(-5.0)
    assert not d.adapt_now and d.break_even_steps is None


def test_restoring_acceptance_saves_what_the_step_model_says():
    # no drift: every following step saves step(2.5) - step(3.0) = 40 - 33.3 = 6.67 s
    d = adapt_gain(2.5, 0.0, 10.0, restored_accept=3.0, k=3, step_time=linear_step, horizon_steps=10)
    assert d.saved_per_step_s[0] == pytest.approx(100 / 2.5 - 100 / 3.0)
    assert d.gain_s == pytest.approx(10 * (100 / 2.5 - 100 / 3.0) - 10.0)
    assert d.adapt_now and d.break_even_steps == 2


def test_faster_drift_makes_adapting_pay_sooner_but_not_for_longer():
    slow = adapt_gain(2.9, 0.005, 20.0, restored_accept=3.2, k=3, step_time=linear_step)
    fast = adapt_gain(2.9, 0.05, 20.0, restored_accept=3.2, k=3, step_time=linear_step)
    assert fast.gain_s > 0 and slow.gain_s > 0
    assert fast.break_even_steps < slow.break_even_steps  # the kept draft falls away quickly
    # ... but the adapted draft drifts as fast, so its advantage fades within the horizon
    assert fast.saved_per_step_s[-1] < 0.25 * max(fast.saved_per_step_s)
    assert slow.saved_per_step_s[-1] > 0.9 * max(slow.saved_per_step_s)


def test_expensive_adaptation_does_not_pay():
    d = adapt_gain(3.1, 0.001, 500.0, restored_accept=3.2, k=3, step_time=linear_step, horizon_steps=20)
    assert d.gain_s < 0 and not d.adapt_now


def test_on_the_simulator():
    cfg = load_config(SimConfig, None, ["workload.rollouts=512", "cluster.gpus=8",
                                        "workload.max_tokens=8192", "spec.k=3", "spec.accept_length=3.0"])
    step = step_time_fn(cfg, points=5)
    assert step(1.0) > step(2.0) > step(4.0)  # more acceptance, shorter step
    current = decayed_length(3.3, 3, 0.02, 10, floor=2.0)
    d = adapt_gain(current, 0.02, 2.0, restored_accept=3.3, k=3, step_time=step, horizon_steps=30,
                   accept_floor=2.0)
    assert d.adapt_now and d.break_even_steps is not None


def test_drift_between_recovers_the_decay():
    a10 = decayed_length(3.3, 3, 0.03, 10, floor=2.0)
    assert drift_between(3.3, a10, 10, k=3, floor=2.0) == pytest.approx(0.03, rel=1e-4)
    assert drift_between(3.0, 3.1, 5, k=3) == 0.0


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(current_accept=4.5), "current_accept=4.5"),
    (dict(restored_accept=0.5), "restored_accept=0.5"),
    (dict(decay_per_step=-0.1), "decay_per_step"),
    (dict(adapt_cost_s=-1.0), "negative"),
])
def test_bad_arguments(kwargs, fragment):
    args = dict(current_accept=3.0, decay_per_step=0.01, adapt_cost_s=1.0, restored_accept=3.5,
                k=3, step_time=linear_step)
    args.update(kwargs)
    with pytest.raises(ValueError, match=None) as info:
        adapt_gain(**args)
    assert fragment in str(info.value)
