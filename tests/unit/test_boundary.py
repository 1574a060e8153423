"""StepBoundary's order of calls (pure logic: recorders stand in for the adapter and the engines;
the real ones run it in tests/e2e/test_demo.py, test_async.py, test_trl.py, test_ray_fleet.py and
test_sidecar.py)."""

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
            if op == "run_round":
                return {"adapt/published": 1.0}
            if op == "finish_round":
                return {"adapt/trained": 1.0}
            if op == "check_integrity":
                return True
            if op == "swap":
                return SimpleNamespace(version=2, ms=3.0)
            if op == "simulate_live":
                return 1.25
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
                     "adapter.observe", "adapter.update_policy", "adapter.run_round",
                     "adapter.swap", "adapter.swap"]
    assert res.metrics == {"draft/integrity_ok": 1.0, "adapt/published": 1.0, "swap/ms": 3.0}
    assert len(res.swaps) == 2 and res.swap.version == 2


def test_background_rounds_collect_the_last_round_first_and_start_the_next_before_generating():
    calls, engines, adapter = engines_and_adapter()
    b = StepBoundary(adapter, engines[0], background=True)
    b.before_generate()  # nothing due yet
    b.after_update(["r"], sampled_version=0, weights={}, version=1)
    b.before_generate()
    assert calls == ["engine0.update_policy", "adapter.finish_round", "adapter.swap", "adapter.check_integrity",
                     "adapter.observe", "adapter.update_policy", "adapter.start_round"]


def test_a_paused_boundary_observes_and_scores_the_served_draft_but_trains_none():
    calls, engines, adapter = engines_and_adapter()
    b = StepBoundary(adapter, engines[0])
    b.paused = True  # no engine drafts: nobody would serve what a round trains
    res = b.after_update(["r"], sampled_version=0, weights={}, version=1)
    assert calls == ["engine0.update_policy", "adapter.check_integrity", "adapter.observe", "adapter.update_policy",
                     "adapter.simulate_live", "adapter.swap"]
    assert res.metrics == {"draft/integrity_ok": 1.0, "adapt/paused": 1.0, "accept/simulated_live": 1.25, "swap/ms": 3.0}
    calls.clear()
    b.paused = False  # drafting again: the round runs as before
    b.after_update(["r"], sampled_version=1, weights={}, version=2)
    assert "adapter.run_round" in calls and "adapter.simulate_live" not in calls


def test_a_paused_background_boundary_reports_what_it_simulated_and_leaves_no_round_due():
    calls, engines, adapter = engines_and_adapter()
    b = StepBoundary(adapter, engines[0], background=True)
    b.paused = True
    res = b.after_update(["r"], sampled_version=0, weights={}, version=1)
    assert res.metrics["adapt/paused"] == 1.0 and res.metrics["accept/simulated_live"] == 1.25
    b.before_generate()
    assert "adapter.start_round" not in calls


def test_asynchronous_split_and_no_adapter():
    calls, engines, adapter = engines_and_adapter()
    b = StepBoundary(adapter, engines[0])
    measured = AcceptanceStats(k=3, drafts=10, accepted_per_pos=[5, 2, 1])
    assert b.beside_generation(measured, ["r"], sampled_version=0, weights={}, version=1) == {
        "accept/rl_batch_length": 1.8, "adapt/published": 1.0}
    res = b.after_generation({}, 1)
    assert calls == ["adapter.report_measured", "adapter.observe", "adapter.update_policy", "adapter.run_round",
                     "engine0.update_policy", "adapter.check_integrity", "adapter.swap"]
    assert res.metrics == {"draft/integrity_ok": 1.0, "swap/ms": 3.0} and res.swap.version == 2
    calls.clear()
    plain = StepBoundary(None, engines[0])
    assert plain.report(measured) == {} and plain.beside_generation(measured, ["r"], 0, {}, 1) == {}
    assert plain.after_update(["r"], 0, {}, 1).metrics == {} and calls == ["engine0.update_policy"]
    calls.clear()
    assert plain.after_generation({}, 2).metrics == {} and calls == ["engine0.update_policy"]


def spool_item(name: str, version: int):
    """A spool shard and policy checkpoint in one: what the boundary reads of each."""
    return SimpleNamespace(name=name, version=version, policy_version=version, prompt_ids=[[1, 2]],
                           response_ids=[[3]], aux_hidden=None, state_dict=dict)


class Refusing(Recorder):
    """An adapter that refuses (ValueError) the inputs named in ``refused`` and fails rounds on ``fail``."""

    def __init__(self, calls, refused=(), fail=False, write_fails=False):
        super().__init__(calls, "adapter")
        self.refused, self.fail, self.write_fails = set(refused), fail, write_fails

    def wait_published(self):
        self.calls.append("adapter.wait_published")
        if self.write_fails:
            raise RuntimeError("writing draft version 3 failed: No space left on device")

    def update_policy(self, weights, version):
        self.calls.append(f"adapter.update_policy v{version}")
        if f"v{version}" in self.refused:
            raise ValueError("does not fit")

    def observe(self, rollouts, policy_version, hidden_states=None, source=None):
        self.calls.append(f"adapter.observe {source}")
        if source in self.refused:
            raise ValueError("token ids outside the vocabulary")

    def run_round(self):
        self.calls.append("adapter.run_round")
        if self.fail:
            raise RuntimeError("round failed")
        return {"adapt/trained": 1.0}


def test_the_sidecars_poll_takes_the_policy_then_the_shards_then_a_round():
    calls: list[str] = []
    refused: list[str] = []
    b = StepBoundary(Refusing(calls, refused=("v3", "s2")), None)
    poll = b.after_poll([spool_item("p3", 3), spool_item("p2", 2)], [spool_item("s1", 1), spool_item("s2", 1)],
                        lambda ckpt, exc: refused.append(ckpt.name), lambda shard, exc: refused.append(shard.name))
    # the round's version written before the shards count as consumed (a background write)
    assert calls == ["adapter.update_policy v3", "adapter.update_policy v2", "adapter.observe s1",
                     "adapter.observe s2", "adapter.run_round", "adapter.wait_published"]
    assert refused == ["p3", "s2"] and poll.policy.name == "p2" and poll.taken == ["s1"]
    assert poll.metrics == {"adapt/trained": 1.0} and poll.error is None
    calls.clear()
    nothing = b.after_poll([], [spool_item("s2", 1)], None, lambda shard, exc: None)
    assert calls == ["adapter.observe s2"] and nothing.taken == [] and nothing.policy is None  # no round


def test_a_spool_round_whose_write_fails_comes_back_as_the_rounds_error():
    calls: list[str] = []
    poll = StepBoundary(Refusing(calls, write_fails=True), None).after_poll([], [spool_item("s1", 1)], None, None)
    assert calls == ["adapter.observe s1", "adapter.run_round", "adapter.wait_published"]
    assert poll.taken == ["s1"] and "No space left" in str(poll.error)


def test_a_failed_spool_round_comes_back_and_a_restart_observes_before_the_policy():
    calls: list[str] = []
    b = StepBoundary(Refusing(calls, fail=True), None)
    poll = b.after_poll([], [spool_item("s1", 1)], None, None)
    assert poll.taken == ["s1"] and isinstance(poll.error, RuntimeError) and poll.metrics == {}
    calls.clear()
    back = b.resume([spool_item("s1", 1)], [spool_item("p4", 4)], None, None)
    assert calls == ["adapter.observe s1", "adapter.update_policy v4"]  # no round
    assert back.taken == ["s1"] and back.policy.version == 4


def test_engine_sets():
    calls, engines, _ = engines_and_adapter()
    assert isinstance(as_engine_set(engines[0]), LocalEngines) and as_engine_set(None) is None
    class Fleet:
        engine_set = True

    fleet = Fleet()
    assert as_engine_set(fleet) is fleet
