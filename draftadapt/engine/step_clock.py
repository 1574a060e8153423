"""Each engine step timed in vLLM's engine core, where it runs: installed in every vLLM process.

Online k prices a draft length by the engine's step at each batch size (docs/design.md, "Step
costs are the engine's own steps"). ``RolloutEngine`` times its steps from the stat logger it
attaches to its own frontend; verl's rollout servers run vLLM's frontend and engine core in
processes of their own, so this module's ``vllm.general_plugins`` entry point gives
``EngineCore`` a method, :data:`CORE_METHOD`, that a caller reaches through vLLM's utility calls:
its first call starts a clock on the engine core's step function, and every call returns the
steps timed since the one before (and forgets them). Nothing is timed before the first call, and
at most :data:`MAX_KEPT` steps are kept between two calls (the newest).

A step is ``[batch, drafted, prefill, seconds]``: the requests scheduled, the draft tokens
verified per request (rounded mean; 0 where none), whether prompt tokens were scheduled (a new
request or a prompt chunk), and the wall time of the engine core's step (schedule, forward,
sampling, the scheduler's update; not the frontend's output processing, which is verl's).

Guarded by version (0.32.x, whose ``EngineCore.step_fn`` and ``SchedulerOutput`` this reads).
``DRAFTADAPT_DISABLE_STEP_CLOCK=1`` turns it off (calibrations then time whole calls).
"""

from __future__ import annotations

import time
from collections import deque

PATCHED_VERSIONS = ("0.32.",)
DISABLE_ENV = "DRAFTADAPT_DISABLE_STEP_CLOCK"
CORE_METHOD = "draftadapt_take_steps"
MAX_KEPT = 50_000  # ~a few MB: an engine nobody asks keeps no more than this


def describe(scheduler_output, seconds: float) -> list:
    """[batch, drafted, prefill, seconds] of one step from vLLM's ``SchedulerOutput``."""
    scheduled = scheduler_output.num_scheduled_tokens  # request id -> tokens this step
    spec = scheduler_output.scheduled_spec_decode_tokens  # request id -> draft token ids verified
    drafted = [len(spec.get(r, ())) for r in scheduled]
    prefill = bool(scheduler_output.scheduled_new_reqs) or any(
        n > 1 + d for n, d in zip(scheduled.values(), drafted))
    k = round(sum(drafted) / len(drafted)) if drafted else 0
    return [len(scheduled), k, prefill, seconds]


class _Clock:
    """Wraps ``core.step_fn`` and its scheduler's ``schedule``: the scheduler output of each step
    that scheduled tokens, and the step's wall time."""

    def __init__(self, core):
        self.steps: deque = deque(maxlen=MAX_KEPT)
        self._output = None
        scheduler, step_fn = core.scheduler, core.step_fn
        schedule = scheduler.schedule

        def scheduled(*args, **kwargs):
            self._output = schedule(*args, **kwargs)
            return self._output

        def timed_step():
            self._output = None
            t0 = time.perf_counter()
            result = step_fn()
            seconds = time.perf_counter() - t0
            out = self._output
            if out is not None and out.total_num_scheduled_tokens > 0:
                self.steps.append(describe(out, seconds))
            return result

        scheduler.schedule = scheduled
        core.step_fn = timed_step

    def take(self) -> list[list]:
        steps = list(self.steps)
        self.steps.clear()
        return steps


def _core_method(self) -> list[list]:
    """``EngineCore.draftadapt_take_steps``: the steps timed since the last call (the first call
    starts the clock and returns none)."""
    clock = getattr(self, "_draftadapt_step_clock", None)
    if clock is None:
        self._draftadapt_step_clock = _Clock(self)
        return []
    return clock.take()


def register() -> None:
    """The ``vllm.general_plugins`` entry point (loaded in every vLLM process, more than once)."""
    from draftadapt.engine.cpu_fix import add_core_method

    add_core_method(CORE_METHOD, _core_method, DISABLE_ENV, PATCHED_VERSIONS)
