"""The RL step's boundary: what happens between one policy update and the next generation, in
one order, written once.

Every way of attaching draftadapt (the demo's synchronous and asynchronous loops, TRL's
GRPOTrainer, a Ray fleet of engines, verl) calls :class:`StepBoundary`; none of them writes the
adapter's calls itself (docs/design.md, "The step boundary").

Synchronous RL, after the policy update::

    boundary = StepBoundary(adapter, engine)              # one engine, a list, or a DraftFleet
    res = boundary.after_update(gen.rollouts, sampled_version=v, weights=w, version=v + 1, handover=ho)

which runs, in this order: the new policy into every engine; the draft's integrity read back
from every engine (a policy sync that lost the draft is repaired); the rollouts and the trainer's
hand-over observed; the adapter's own policy copy updated; the adapter's round (train, validate,
publish); the newest draft each engine may serve swapped in.

Asynchronous RL splits it where the generation overlaps: :meth:`learn` beside the generation
(observe, update the adapter's policy, the round), then at the boundary :meth:`load_policy` and
:meth:`serve` (integrity, swap).

``background=True`` runs the round in the adapter's thread while the next generation runs
(:meth:`DraftAdapter.start_step`): :meth:`before_generate` starts it, the next
:meth:`after_update` collects it and swaps its draft in first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


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


class StepBoundary:
    """The ordered adapter calls at an RL step's boundary (see the module docstring).

    adapter: a :class:`~draftadapt.adapter.DraftAdapter` (or its Ray actor's handle wrapper), or
    None for a run without draftadapt (the boundary then only loads the policy); engines: a
    RolloutEngine, an EngineProcess, a list of them, or a ``DraftFleet``; background: run the
    round beside the next generation (see :meth:`before_generate`).
    """

    def __init__(self, adapter, engines, background: bool = False):
        self.adapter = adapter
        self.engines = as_engine_set(engines)
        self.background = background
        self._round_due = False

    # ------------------------------------------------------------------ pieces, in order

    def report(self, spec) -> dict[str, float]:
        """The engine's acceptance counters of the RL batch just generated (free; they feed the
        adapter's drift trigger). ``spec``: an AcceptanceStats."""
        if self.adapter is None or not spec.drafts:
            return {}
        self.adapter.report_measured(spec.length)
        return {"accept/rl_batch_length": spec.length}

    def before_generate(self) -> None:
        """background: start the round the last boundary left due, beside this generation."""
        if self._round_due:
            self.adapter.start_step()
            self._round_due = False

    def load_policy(self, weights: Any, version: int) -> float:
        """The new policy into every engine; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.engines is not None:
            self.engines.update_policy(weights, version)
        return time.perf_counter() - t0

    def learn(self, rollouts: Sequence[Any], sampled_version: int, weights: Any, version: int,
              handover=None) -> dict[str, float]:
        """The adapter's side of a step: observe the rollouts (sampled at ``sampled_version``)
        with the trainer's hand-over, load the policy's ``version`` into its own copy, run its
        round (or leave it due, background). Metrics of the round."""
        a = self.adapter
        a.observe(rollouts, policy_version=sampled_version, handover=handover)
        a.update_policy(weights, version=version)
        if self.background:
            self._round_due = True
            return {}
        return a.step()

    def serve(self, res: BoundaryResult | None = None, integrity: bool = True) -> BoundaryResult:
        """Engine side: the live draft's integrity read back (repaired if a sync lost it), then
        the newest draft each engine may serve swapped in."""
        res = res or BoundaryResult()
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

    # ------------------------------------------------------------------ the whole boundary

    def after_update(self, rollouts: Sequence[Any] | None, sampled_version: int, weights: Any, version: int,
                     handover=None, integrity: bool = True) -> BoundaryResult:
        """Synchronous RL, right after the trainer's update to policy ``version``: the whole
        boundary in its order (module docstring). ``rollouts`` None: the engines get the policy
        and nothing else happens (no batch was generated since the last boundary)."""
        res = BoundaryResult(policy_load_s=self.load_policy(weights, version))
        a = self.adapter
        if a is None or rollouts is None:
            return res
        t0 = time.perf_counter()
        if self.background:
            # the round started before this step's generation: its draft first, then the checks
            res.metrics.update(a.finish_step())
            self._swap(res)
            if integrity:
                res.metrics["draft/integrity_ok"] = float(self.engines.check_integrity(a))
            self.learn(rollouts, sampled_version, weights, version, handover)
        else:
            if integrity:
                res.metrics["draft/integrity_ok"] = float(self.engines.check_integrity(a))
            res.metrics.update(self.learn(rollouts, sampled_version, weights, version, handover))
            self._swap(res)
        res.adapter_s = time.perf_counter() - t0
        return res
