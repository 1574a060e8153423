"""StepBoundary's order of calls (pure logic: recorders stand in for the adapter and the engines;
the real ones run it in tests/e2e/test_demo.py, test_async.py, test_trl.py and test_ray_fleet.py)."""

from __future__ import annotations

from types import SimpleNamespace

from draftadapt.boundary import LocalEngines, StepBoundary, as_engine_set
from draftadapt.metrics.acceptance import AcceptanceStats


class Recorder:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def __getattr__(self, op):
        def call(*args, **kwargs):
            self.calls.append(f"{self.name}.{op}")
            if op == "step":
                return {"adapt/published": 1.0}
            if op == "finish_step":
                return {"adapt/trained": 1.0}
            if op == "check_integrity":
                return True
            if op == "swap":
                return SimpleNamespace(version=2, ms=3.0)
            return None
        return call


def engines_and_adapter(n: int = 1):
    calls: list[str] = []
    engines = [Recorder(calls, f"engine{i}") for i in range(n)]
    return calls, engines, Recorder(calls, "adapter")


def test_synchronous_boundary_runs_the_adapter_calls_in_their_order():
    calls, engines, adapter = engines_and_adapter(2)
    b = StepBoundary(adapter, engines)
    res = b.after_update(["r"], sampled_version=0, weights={}, version=1, handover=None)
    assert calls == ["engine0.update_policy", "engine1.update_policy",
                     "adapter.check_integrity", "adapter.check_integrity",
                     "adapter.observe", "adapter.update_policy", "adapter.step",
                     "adapter.swap", "adapter.swap"]
    assert res.metrics == {"draft/integrity_ok": 1.0, "adapt/published": 1.0, "swap/ms": 3.0}
    assert len(res.swaps) == 2 and res.swap.version == 2


def test_background_rounds_collect_the_last_round_first_and_start_the_next_before_generating():
    calls, engines, adapter = engines_and_adapter()
    b = StepBoundary(adapter, engines[0], background=True)
    b.before_generate()  # nothing due yet
    b.after_update(["r"], sampled_version=0, weights={}, version=1)
    b.before_generate()
    assert calls == ["engine0.update_policy", "adapter.finish_step", "adapter.swap", "adapter.check_integrity",
                     "adapter.observe", "adapter.update_policy", "adapter.start_step"]


def test_asynchronous_split_and_no_adapter():
    calls, engines, adapter = engines_and_adapter()
    b = StepBoundary(adapter, engines[0])
    assert b.report(AcceptanceStats(k=3, drafts=10, accepted_per_pos=[5, 2, 1])) == {"accept/rl_batch_length": 1.8}
    b.learn(["r"], sampled_version=0, weights={}, version=1)
    b.load_policy({}, 1)
    b.serve()
    assert calls == ["adapter.report_measured", "adapter.observe", "adapter.update_policy", "adapter.step",
                     "engine0.update_policy", "adapter.check_integrity", "adapter.swap"]
    calls.clear()
    plain = StepBoundary(None, engines[0])
    assert plain.report(AcceptanceStats(k=3, drafts=10, accepted_per_pos=[5, 2, 1])) == {}
    assert plain.after_update(["r"], 0, {}, 1).metrics == {} and calls == ["engine0.update_policy"]


def test_engine_sets():
    calls, engines, _ = engines_and_adapter()
    assert isinstance(as_engine_set(engines[0]), LocalEngines) and as_engine_set(None) is None
    class Fleet:
        engine_set = True

    fleet = Fleet()
    assert as_engine_set(fleet) is fleet
