"""The RL step's boundary: what happens between one policy update and the next generation, in
one order, written once.

Every way of attaching draftadapt (the demo's synchronous and asynchronous loops, TRL's
GRPOTrainer, a Ray fleet of engines, verl, the sidecar over a spool) calls :class:`StepBoundary`;
none of them writes the adapter's calls itself (docs/design.md, "The step boundary";
tests/unit/test_boundary_owner.py fails on a module that does).

Synchronous RL, after the policy update::

    boundary = StepBoundary(adapter, engine)              # one engine, a list, or a DraftFleet
    res = boundary.after_update(gen.rollouts, sampled_version=v, weights=w, version=v + 1, handover=ho)

which runs, in this order: the new policy into every engine; the draft's integrity read back
from every engine (a policy sync that lost the draft is repaired); the rollouts and the trainer's
hand-over observed; the adapter's own policy copy updated; the adapter's round (train, validate,
publish); the newest draft each engine may serve swapped in.

Asynchronous RL splits it where the generation overlaps: :meth:`beside_generation` while the next
batch generates (the trained-on batch's acceptance reported, observe, update the adapter's policy,
the round), then, the generation done, :meth:`after_generation` (the policy into the engines,
integrity, swap).

``background=True`` runs the round in the adapter's thread while the next generation runs
(:meth:`DraftAdapter.start_round`): :meth:`before_generate` starts it, the next
:meth:`after_update` collects it and swaps its draft in first.

The sidecar (no engines; they pick up what it publishes) polls a spool: :meth:`after_poll` takes
the newest policy checkpoint that fits, observes the new shards and runs a round over them;
:meth:`resume` re-reads the shards consumed before a restart, then takes the policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence


Refuse = Callable[[Any, ValueError], None]  # what to do with input the adapter refused, and why


class EngineSet(Protocol):
    """Where the drafts are served: one or several engines, in this process or elsewhere.
    ``engine_set = True`` marks a class as one (a RolloutEngine is not)."""

    engine_set: bool

    def update_policy(self, weights: Any, version: int) -> None: ...

    def check_integrity(self, adapter) -> bool: ...

    def swap(self, adapter) -> list: ...


class LocalEngines:
    """Engines this process drives (``RolloutEngine`` or ``EngineProcess``), each given the same
    policy and the same draft; the adapter checks and swaps each one directly."""

    engine_set = True

    def __init__(self, engines: Sequence[Any]):
        self.engines = list(engines)

    def update_policy(self, weights: Any, version: int) -> None:
        for e in self.engines:
            e.update_policy(weights, version=version)

    def check_integrity(self, adapter) -> bool:
        return all([adapter.check_integrity(e) for e in self.engines])  # every engine, no short circuit

    def swap(self, adapter) -> list:
        return [s for s in (adapter.swap(e) for e in self.engines) if s is not None]


def as_engine_set(engines: Any) -> EngineSet | None:
    """An engine, a list of engines, or an :class:`EngineSet` (a DraftFleet) as an EngineSet."""
    if engines is None:
        return None
    if isinstance(engines, (list, tuple)):
        return LocalEngines(engines)
    if getattr(type(engines), "engine_set", False) is True:  # a DraftFleet, or your own EngineSet (a class flag)
        return engines
    return LocalEngines([engines])


@dataclass
class BoundaryResult:
    """What one boundary did: metrics for the step's row (``draft/integrity_ok``, the round's
    ``adapt/*`` ``train/*`` ``accept/simulated_*``, ``swap/ms``), the swaps it made (one per
    engine that took a new draft), and the seconds it spent on the engines' policy load and on
    the adapter (integrity, observe, round, swap)."""

    metrics: dict[str, float] = field(default_factory=dict)
    swaps: list = field(default_factory=list)
    policy_load_s: float = 0.0
    adapter_s: float = 0.0

    @property
    def swap(self):
        """The last swap made, or None (one engine: the swap)."""
        return self.swaps[-1] if self.swaps else None


@dataclass
class SpoolPoll:
    """What one poll of a spool did at the boundary (the sidecar's): the policy checkpoint the
    adapter took (None: none newer, or every newer one refused), the names of the shards it
    observed, the round's metrics, and the error the round raised (None: it ran; else its shards
    are the caller's to drop)."""

    policy: Any = None
    taken: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    error: Exception | None = None


class PausedWatch:
    """While the adapter is paused, which steps it watches on: hands over the step's held-out
    rollouts and simulates the draft it would serve on them (what turns drafting back on). A
    step watches while what the watch has spent since the pause began is within ``share`` of the
    pause's wall time (the first paused step always does), so the watch costs ``share`` of the run
    plus at most one watch, and a watch of w seconds in steps of T runs at least every
    ceil(w / (share x T)) + 1 steps (docs/design.md, "Stepping aside")."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter):
        self.share = share
        self.clock = clock
        self.since: float | None = None  # when the pause began (None: not paused)
        self.spent = 0.0  # the watch's seconds since then

    def due(self) -> bool:
        now = self.clock()
        if self.since is None:
            self.since, self.spent = now, 0.0
            return True
        return self.spent <= self.share * (now - self.since)

    def spend(self, seconds: float) -> None:
        self.spent += seconds

    def end(self) -> None:
        self.since = None

    def spent_share(self) -> float:
        """What the watch has spent over the pause's time so far (0 before a second)."""
        elapsed = 0.0 if self.since is None else self.clock() - self.since
        return self.spent / elapsed if elapsed >= 1.0 else 0.0


class StepBoundary:
    """The ordered adapter calls at an RL step's boundary (see the module docstring).

    adapter: a :class:`~draftadapt.adapter.DraftAdapter` (or its Ray actor's handle wrapper), or
    None for a run without draftadapt (the boundary then only loads the policy); engines: a
    RolloutEngine, an EngineProcess, a list of them, a ``DraftFleet`` (any :class:`EngineSet`),
    or None (the sidecar: no engine of its own); background: run the round beside the next
    generation (see :meth:`before_generate`).
    """

    def __init__(self, adapter, engines, background: bool = False):
        self.adapter = adapter
        self.engines = as_engine_set(engines)
        self.background = background
        self._round_due = False
        # Set by the caller while no engine drafts (an online k table of zeros: the drafter
        # idles): the adapter still observes and follows the policy, but trains no draft nobody
        # serves; it scores the draft it would serve on the step's rollouts instead, which says
        # when a draft would pay again (``accept/simulated_live``; docs/design.md, "Stepping aside").
        self.paused = False
        # Paused, whether this step watches (:meth:`plan`); a step that does not only follows the
        # policy: no hand-over, no observe, no simulation, no integrity read-back.
        self.watching = True
        self.watch: PausedWatch | None = None

    # ------------------------------------------------------------------ events the caller tells

    def plan(self, online_k, engine, rollouts: Sequence[Any], sampled_version: int) -> list[int] | None:
        """Before the policy update's forward over one step's ``rollouts``: whether the adapter is
        paused this step (``online_k.pause_adapter``: ``engine``'s drafter idles and even a fresh
        draft would not pay; no ``online_k``: never), and what the trainer's hand-over keeps. None:
        every rollout (not paused). Paused, on a step the watch affords (:class:`PausedWatch`,
        ``online_k.watch_share``): the held-out rollouts its simulated acceptance scores
        (``DraftAdapter.heldout_subset``); on the others nothing, and :attr:`hands_over` is False:
        make no hand-over, and :meth:`after_update` only moves the adapter's policy on."""
        a = self.adapter
        self.paused = (a is not None and online_k is not None
                       and online_k.pause_adapter(engine, a.fresh_length(), a.cfg.k))
        if not self.paused:
            if self.watch is not None:
                self.watch.end()
            self.watching = True
            return None
        if self.watch is None:
            self.watch = PausedWatch(online_k.watch_share)
        self.watching = self.watch.due()
        return a.heldout_subset(rollouts, sampled_version) if self.watching else []

    @property
    def hands_over(self) -> bool:
        """Whether this step's update should hand its states over (False: paused, not watching)."""
        return self.adapter is not None and (not self.paused or self.watching)

    def report(self, acceptance) -> dict[str, float]:
        """The engine's acceptance counters of the RL batch just generated (free; they feed the
        adapter's drift trigger). ``acceptance``: an AcceptanceStats."""
        if self.adapter is None or not acceptance.drafts:
            return {}
        first = acceptance.reached_rates[0] if acceptance.accepted_per_pos else None
        # the drift trigger reads the draft at the adapter's k: the raw length mixes the lengths
        # a per-batch-size k table drafted, and moved 20% a step with the table alone
        at_k, positions = acceptance.length_at(self.adapter.cfg.k)
        self.adapter.report_measured(at_k, first, positions)
        return {"accept/rl_batch_length": acceptance.length, "accept/rl_batch_length_at_k": at_k}

    def before_generate(self) -> None:
        """background: start the round the last boundary left due, beside this generation."""
        if self._round_due:
            self.adapter.start_round()
            self._round_due = False

    # ------------------------------------------------------------------ synchronous RL

    def after_update(self, rollouts: Sequence[Any] | None, sampled_version: int, weights: Any, version: int,
                     handover=None, integrity: bool = True) -> BoundaryResult:
        """Synchronous RL, right after the trainer's update to policy ``version``: the whole
        boundary in its order (module docstring). ``rollouts`` None: the engines get the policy
        and nothing else happens (no batch was generated since the last boundary)."""
        res = BoundaryResult(policy_load_s=self._load_policy(weights, version))
        a = self.adapter
        if a is None or rollouts is None:
            return res
        t0 = time.perf_counter()
        # paused and not watching: nothing drafts, and a draft lost meanwhile is read back on the
        # next step that watches, before the table could draft again
        integrity = integrity and self.watching
        if self.background:
            # the round started before this step's generation: its draft first, then the checks
            res.metrics.update(a.finish_round())
            self._swap(res)
            if integrity:
                res.metrics["draft/integrity_ok"] = float(self.engines.check_integrity(a))
            # the round is left due ({}), or, paused, what the adapter simulated instead
            res.metrics.update(self._learn(rollouts, sampled_version, weights, version, handover))
        else:
            if integrity:
                res.metrics["draft/integrity_ok"] = float(self.engines.check_integrity(a))
            res.metrics.update(self._learn(rollouts, sampled_version, weights, version, handover))
            self._swap(res)
        res.adapter_s = time.perf_counter() - t0
        if self.paused and self.watch is not None:
            if self.watching:  # all of it: the hand-over inside the trainer's forward too
                self.watch.spend(res.adapter_s + getattr(handover, "seconds", 0.0))
            res.metrics["adapt/watch_share"] = self.watch.spent_share()
        return res

    # ------------------------------------------------------------------ asynchronous RL

    def beside_generation(self, acceptance, rollouts: Sequence[Any], sampled_version: int, weights: Any,
                          version: int, handover=None) -> dict[str, float]:
        """Asynchronous RL, while the next batch generates: the acceptance the engine measured on
        ``rollouts`` reported, then the adapter learns from them (:meth:`_learn`). Metrics of the
        report and the round ({} without an adapter)."""
        if self.adapter is None:
            return {}
        metrics = self.report(acceptance)
        metrics.update(self._learn(rollouts, sampled_version, weights, version, handover))
        return metrics

    def after_generation(self, weights: Any, version: int, integrity: bool = True) -> BoundaryResult:
        """Asynchronous RL, the generation done: policy ``version`` into every engine, then the
        live draft's integrity and the newest draft each engine may serve (:meth:`_serve`)."""
        res = BoundaryResult(policy_load_s=self._load_policy(weights, version))
        return self._serve(res, integrity)

    # ------------------------------------------------------------------ a spool (the sidecar)

    def after_poll(self, checkpoints: Iterable[Any], shards: Iterable[Any], refuse_policy: Refuse,
                   refuse_shard: Refuse) -> SpoolPoll:
        """One poll of a spool, in its order: the adapter's policy copy at the first of
        ``checkpoints`` it takes (newest first), each of ``shards`` observed, then a round over
        those taken (none taken: no round). A checkpoint or shard the adapter refuses (a
        ValueError) goes to ``refuse_policy`` / ``refuse_shard`` with the error; a round that
        raises comes back in ``error``. Shards and checkpoints as the spool reads them
        (``RolloutShard``, ``PolicyCheckpoint``)."""
        poll = SpoolPoll(policy=self._take_policy(checkpoints, refuse_policy),
                         taken=self._observe_shards(shards, refuse_shard))
        if not poll.taken:
            return poll
        try:
            poll.metrics = self.adapter.run_round()
            # the sidecar marks these shards consumed next: its version written first, so a write
            # that fails is this round's failure (engines elsewhere read the store for it)
            self.adapter.wait_published()
        except Exception as exc:  # noqa: BLE001 - whatever a round raises, the caller drops its shards
            poll.error = exc
        return poll

    def resume(self, consumed: Iterable[Any], checkpoints: Iterable[Any], skip_shard: Refuse,
               refuse_policy: Refuse) -> SpoolPoll:
        """After a restart: the shards consumed before it observed again (the replay buffer as it
        was; one refused now goes to ``skip_shard``), then the policy as :meth:`after_poll` takes
        it. No round."""
        taken = self._observe_shards(consumed, skip_shard)
        return SpoolPoll(policy=self._take_policy(checkpoints, refuse_policy), taken=taken)

    # ------------------------------------------------------------------ the pieces the orders are made of

    def _load_policy(self, weights: Any, version: int) -> float:
        """The new policy into every engine; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.engines is not None:
            self.engines.update_policy(weights, version)
        return time.perf_counter() - t0

    def _learn(self, rollouts: Sequence[Any], sampled_version: int, weights: Any, version: int,
               handover=None) -> dict[str, float]:
        """The adapter's side of a step: observe the rollouts (sampled at ``sampled_version``)
        with the trainer's hand-over, load the policy's ``version`` into its own copy, run its
        round (or leave it due, background). Metrics of the round."""
        a = self.adapter
        if self.paused and not self.watching:  # the watch's budget is spent: only follow the policy
            a.update_policy(weights, version=version)
            return {"adapt/paused": 1.0, "adapt/watched": 0.0}
        a.observe(rollouts, policy_version=sampled_version, handover=handover)
        a.update_policy(weights, version=version)
        if self.paused:
            live = a.simulate_live()
            return {"adapt/paused": 1.0, "adapt/watched": 1.0,
                    **({} if live is None else {"accept/simulated_live": live})}
        if self.background:
            self._round_due = True
            return {}
        return a.run_round()

    def _serve(self, res: BoundaryResult, integrity: bool = True) -> BoundaryResult:
        """Engine side: the live draft's integrity read back (repaired if a sync lost it), then
        the newest draft each engine may serve swapped in."""
        if self.adapter is None:
            return res
        t0 = time.perf_counter()
        if integrity:
            res.metrics["draft/integrity_ok"] = float(self.engines.check_integrity(self.adapter))
        self._swap(res)
        res.adapter_s += time.perf_counter() - t0
        return res

    def _swap(self, res: BoundaryResult) -> None:
        swaps = self.engines.swap(self.adapter)
        res.swaps.extend(swaps)
        if swaps:
            res.metrics["swap/ms"] = max(s.ms for s in swaps)

    def _take_policy(self, checkpoints: Iterable[Any], refuse: Refuse) -> Any:
        """The adapter's policy copy at the first checkpoint it takes; the checkpoint, or None."""
        for ckpt in checkpoints:
            try:
                self.adapter.update_policy(ckpt.state_dict(), ckpt.version)
            except ValueError as exc:
                refuse(ckpt, exc)
                continue
            return ckpt
        return None

    def _observe_shards(self, shards: Iterable[Any], refuse: Refuse) -> list[str]:
        """Each shard's rollouts (and hidden states) observed under its name; the names taken."""
        taken = []
        for shard in shards:
            try:
                self.adapter.observe([(p, r) for p, r in zip(shard.prompt_ids, shard.response_ids)],
                                     policy_version=shard.policy_version, hidden_states=shard.aux_hidden,
                                     source=shard.name)
            except ValueError as exc:
                refuse(shard, exc)
                continue
            taken.append(shard.name)
        return taken
