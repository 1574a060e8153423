"""StepBoundary's order of calls (pure logic: recorders stand in for the adapter and the engines;
the real ones run it in tests/e2e/test_demo.py, test_async.py, test_trl.py, test_ray_fleet.py and
test_sidecar.py)."""

from __future__ import annotations

from types import SimpleNamespace

import math

import pytest

from draftadapt.boundary import LocalEngines, PausedWatch, StepBoundary, as_engine_set
from draftadapt.metrics.acceptance import AcceptanceStats


class Recorder:
    cfg = SimpleNamespace(k=3)  # the adapter's k: StepBoundary.report reads the RL batch at it

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
    assert res.metrics == {"draft/integrity_ok": 1.0, "adapt/paused": 1.0, "adapt/watched": 1.0,
                           "accept/simulated_live": 1.25, "swap/ms": 3.0}
    calls.clear()
    b.paused = False  # drafting again: the round runs as before
    b.after_update(["r"], sampled_version=1, weights={}, version=2)
    assert "adapter.run_round" in calls and "adapter.simulate_live" not in calls


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PlannedAdapter(Recorder):
    """A recorder with what StepBoundary.plan reads: the adapter's k and its held-out rollouts."""

    def heldout_subset(self, rollouts, version):
        self.calls.append("adapter.heldout_subset")
        return [0, 1]


class PauseK:
    """Online k's side of the plan: pause_adapter answers as told."""

    def __init__(self, share: float):
        self.watch_share = share
        self.pause = True

    def pause_adapter(self, engine, fresh_length, k):
        return self.pause


def test_a_paused_adapter_watches_on_the_steps_its_share_affords_and_only_follows_the_policy_on_the_others():
    calls: list[str] = []
    engine, adapter = Recorder(calls, "engine0"), PlannedAdapter(calls, "adapter")
    b, k, clock = StepBoundary(adapter, engine), PauseK(share=0.01), Clock()
    b.watch = PausedWatch(k.watch_share, clock=clock)
    watch = SimpleNamespace(seconds=0.5)  # the hand-over's seconds inside the trainer's forward

    # the pause's first step watches: the held-out share handed over, observed, simulated
    assert b.plan(k, engine, ["r"] * 4, 0) == [0, 1] and b.paused and b.hands_over
    res = b.after_update(["r"] * 2, sampled_version=0, weights={}, version=1, handover=watch)
    assert calls == ["adapter.fresh_length", "adapter.heldout_subset", "engine0.update_policy", "adapter.check_integrity",
                     "adapter.observe",
                     "adapter.update_policy", "adapter.simulate_live", "adapter.swap"]
    assert res.metrics["adapt/watched"] == 1.0 and res.metrics["accept/simulated_live"] == 1.25
    assert 0.5 <= b.watch.spent < 0.6  # the boundary's own seconds too

    # 10 s on: 0.5 s spent is over 1% of 10 s: no hand-over, and the boundary only follows the policy
    calls.clear()
    clock.now = 10.0
    assert b.plan(k, engine, ["r"] * 4, 1) == [] and b.paused and not b.hands_over
    calls.clear()
    res = b.after_update(["r"] * 4, sampled_version=1, weights={}, version=2, handover=None)
    assert calls == ["engine0.update_policy", "adapter.update_policy", "adapter.swap"]
    assert res.metrics["adapt/watched"] == 0.0 and "accept/simulated_live" not in res.metrics
    assert abs(res.metrics["adapt/watch_share"] - b.watch.spent / 10.0) < 1e-12

    clock.now = 60.0  # 1% of 60 s covers what was spent: the watch runs again
    assert b.plan(k, engine, ["r"] * 4, 2) == [0, 1] and b.hands_over

    k.pause = False  # drafting again: every rollout handed over, and the next pause starts afresh
    assert b.plan(k, engine, ["r"] * 4, 3) is None and not b.paused and b.hands_over
    k.pause, clock.now = True, 61.0
    assert b.plan(k, engine, ["r"] * 4, 4) == [0, 1]
    assert StepBoundary(adapter, engine).plan(None, engine, ["r"], 0) is None  # no online k: never paused
    assert not StepBoundary(None, engine).hands_over


def test_the_watch_costs_its_share_plus_one_watch_and_runs_at_least_every_few_steps():
    for share, w, step in ((0.005, 3.6, 163.0), (0.005, 1.0, 80.0), (0.005, 0.2, 400.0), (0.02, 5.0, 20.0)):
        clock = Clock()
        watch, watched = PausedWatch(share, clock=clock), []
        for i in range(200):
            clock.now = i * step
            if watch.due():
                watch.spend(w)
                watched.append(i)
        elapsed = 200 * step
        assert watch.spent <= share * elapsed + w, (share, w, step)
        gaps = [b - a for a, b in zip(watched, watched[1:])]
        assert watched[0] == 0 and max(gaps) <= math.ceil(w / (share * step)) + 1, (share, w, step, gaps)
        assert (max(gaps) == 1) == (w <= share * step), (share, w, step, gaps)  # cheap: every step


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
    assert b.beside_generation(measured, ["r"], sampled_version=0, weights={}, version=1) == pytest.approx({
        "accept/rl_batch_length": 1.8, "accept/rl_batch_length_at_k": 1.8, "adapt/published": 1.0})
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
