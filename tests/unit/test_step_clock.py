"""The engine core's step clock (pure: vLLM's SchedulerOutput and EngineCore stand in as plain
objects; a real engine's steps are tests/integration/test_online_k.py and test_verl.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftadapt.engine import step_clock


def output(scheduled: dict[str, int], spec: dict[str, list[int]], new=()):
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec,
                           scheduled_new_reqs=list(new), total_num_scheduled_tokens=sum(scheduled.values()))


def test_a_step_is_described_by_its_batch_its_draft_tokens_and_whether_a_prompt_was_in_it():
    # four requests verifying 3 draft tokens each: 4 tokens scheduled a request
    assert step_clock.describe(output({f"r{i}": 4 for i in range(4)}, {f"r{i}": [1, 2, 3] for i in range(4)}), 0.05) \
        == [4, 3, False, 0.05]
    # no draft token: one token a request
    assert step_clock.describe(output({"a": 1, "b": 1}, {}), 0.02) == [2, 0, False, 0.02]
    # a new request's prompt beside a decode, or a prompt chunk of a known request: prefill
    assert step_clock.describe(output({"a": 1, "b": 17}, {}, new=["b"]), 0.1)[2]
    assert step_clock.describe(output({"a": 2, "b": 9}, {"a": [5]}), 0.1)[2:] == [True, 0.1]
    # a request within k of its last token drafts fewer: the rounded mean
    assert step_clock.describe(output({"a": 4, "b": 4, "c": 2}, {"a": [1] * 3, "b": [1] * 3, "c": [1]}), 0.0)[1] == 2


class Core:
    """An EngineCore's shape as the clock wraps it: ``step_fn`` calls ``scheduler.schedule``."""

    def __init__(self, plan):
        self.plan = list(plan)  # the SchedulerOutput of each step (None: nothing to schedule)
        self.scheduler = SimpleNamespace(schedule=self._schedule)
        self.step_fn = self._step

    def _schedule(self):
        return self.plan.pop(0)

    def _step(self):
        out = self.scheduler.schedule()
        return ({}, out is not None)


def test_the_clock_starts_at_its_first_call_and_each_call_takes_the_steps_since():
    decode = output({"a": 1, "b": 1}, {})
    idle = output({}, {})
    core = Core([decode, decode, decode, idle, decode, decode])
    core.step_fn()  # before the clock: not timed
    assert step_clock._core_method(core) == []  # the first call starts it
    core.step_fn()
    core.step_fn()
    core.step_fn()  # a step that scheduled nothing is not a step
    steps = step_clock._core_method(core)
    assert [s[:3] for s in steps] == [[2, 0, False]] * 2 and all(s[3] >= 0 for s in steps)
    assert step_clock._core_method(core) == []  # taken
    core.step_fn()
    assert len(step_clock._core_method(core)) == 1
    assert core.step_fn() == ({}, True)  # the step's own result passes through


def test_an_engine_nobody_asks_keeps_only_the_newest_steps(monkeypatch):
    monkeypatch.setattr(step_clock, "MAX_KEPT", 3)
    core = Core([output({"a": 1}, {})] * 5 + [output({"a": 1, "b": 1}, {})])
    step_clock._core_method(core)
    for _ in range(6):
        core.step_fn()
    assert [s[0] for s in step_clock._core_method(core)] == [1, 1, 2]


def test_engine_step_metrics_are_per_engine_means():
    pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (pip install --no-deps verl==0.9.1)")
    from draftadapt.integrations.verl.rollout import engine_step_metrics

    engines = [[[8, 0, True, 0.5], [8, 3, False, 0.2], [4, 3, False, 0.1]], [[8, 0, True, 0.3], [8, 0, False, 0.1]]]
    m = engine_step_metrics(engines)
    assert m["engine/step_s"] == pytest.approx((0.8 + 0.4) / 2) and m["engine/prefill_s"] == pytest.approx(0.4)
    assert m["engine/steps"] == 2.5 and m["engine/drafting_share"] == pytest.approx(2 / 5)
    assert engine_step_metrics([]) == {} and engine_step_metrics([[]])["engine/step_s"] == 0.0
