"""Does adapting the draft now pay? The call a drift-triggered schedule makes.

    step_time = step_time_fn(cfg)              # seconds of one RL step at acceptance a
    d = adapt_gain(current_accept=2.6, decay_per_step=0.01, adapt_cost_s=12.0,
                   restored_accept=3.3, k=3, step_time=step_time)
    if d.adapt_now: ...

Adapting now puts a draft with ``restored_accept`` in the engine from the next step on;
not adapting leaves the current draft decaying. Both decay the same way afterwards
(``draftadapt.sim.model.decayed_length``: the per-token acceptance loses ``decay_per_step``
of its distance to the floor per RL step). The gain is the step time saved over the horizon
minus what adapting costs on the critical path (exposed side-trainer time plus swap pause).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from draftadapt.sim.config import SimConfig
from draftadapt.sim.model import beta_for_length, decayed_length, simulate_step


@dataclass(frozen=True)
class AdaptDecision:
    gain_s: float  # seconds saved over the horizon by adapting now, net of the cost
    adapt_now: bool  # gain_s > 0
    break_even_steps: int | None  # steps until the savings cover the cost; None within the horizon
    saved_per_step_s: list[float]  # [horizon] step time saved at each following step
    horizon_steps: int


def adapt_gain(
    current_accept: float,
    decay_per_step: float,
    adapt_cost_s: float,
    *,
    restored_accept: float,
    k: int,
    step_time: Callable[[float], float],
    horizon_steps: int = 50,
    accept_floor: float = 1.0,
) -> AdaptDecision:
    """Expected gain of adapting the draft now rather than keeping the current one.

    current_accept: acceptance length of the draft in the engine now (1..k+1).
    decay_per_step: relative per-token acceptance lost per RL step (spec.drift_per_step).
    adapt_cost_s: seconds adapting adds to the run's critical path (exposed side-trainer time
        plus the swap pause); a fully overlapped side trainer costs only the swap.
    restored_accept: acceptance length right after adapting (what a fresh draft reaches).
    step_time: seconds of one RL step at a given acceptance length (``step_time_fn``).
    """
    for name, a in (("current_accept", current_accept), ("restored_accept", restored_accept)):
        if not 1.0 <= a <= k + 1 + 1e-9:
            raise ValueError(f"{name}={a} must lie in [1, k+1] = [1, {k + 1}]")
    if not 0 <= decay_per_step < 1:
        raise ValueError(f"decay_per_step={decay_per_step} must lie in [0, 1)")
    if adapt_cost_s < 0:
        raise ValueError(f"adapt_cost_s={adapt_cost_s} is negative; a cost is >= 0 seconds")
    if horizon_steps < 1:
        raise ValueError(f"horizon_steps={horizon_steps} must be >= 1")
    floor = min(accept_floor, current_accept, restored_accept)
    saved = []
    for t in range(1, horizon_steps + 1):
        keep = decayed_length(current_accept, k, decay_per_step, t, floor)
        fresh = decayed_length(restored_accept, k, decay_per_step, t - 1, floor)
        saved.append(step_time(keep) - step_time(fresh))
    cumulative = np.cumsum(saved)
    paid = np.nonzero(cumulative >= adapt_cost_s)[0]
    gain = float(cumulative[-1] - adapt_cost_s)
    return AdaptDecision(
        gain_s=gain,
        adapt_now=gain > 0,
        break_even_steps=int(paid[0]) + 1 if len(paid) else None,
        saved_per_step_s=saved,
        horizon_steps=horizon_steps,
    )


def step_time_fn(cfg: SimConfig, mode: str | None = None, points: int = 9) -> Callable[[float], float]:
    """Seconds of one steady-state RL step as a function of acceptance length, interpolated
    between ``points`` simulations from 1 to k+1 (simulated once, then cheap to call)."""
    mode = mode or cfg.pipeline.modes[0]
    k = cfg.spec.k
    alphas = np.linspace(1.0, k + 1.0, points)
    times = np.array([simulate_step(cfg, mode, float(a)).step_s for a in alphas])

    def step_time(alpha: float) -> float:
        return float(np.interp(alpha, alphas, times))

    return step_time


def drift_between(accept_then: float, accept_now: float, steps: int, k: int, floor: float = 1.0) -> float:
    """The decay_per_step that takes acceptance from accept_then to accept_now in ``steps``
    RL steps (for a schedule that has two acceptance readings of one frozen draft)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if accept_now >= accept_then:
        return 0.0
    b0, b1, bf = (beta_for_length(a, k) for a in (accept_then, accept_now, floor))
    if b1 <= bf:
        raise ValueError(f"accept_now={accept_now} is at or below the floor {floor}")
    return 1.0 - ((b1 - bf) / (b0 - bf)) ** (1.0 / steps)
