"""Online k: re-choose the draft length per batch size as acceptance moves during RL.

    engine = RolloutEngine(policy, draft, num_speculative_tokens=5, k_schedule=[(1, 64, 3)])
    online = OnlineK.calibrate(engine, prompts)      # a few seconds: this engine's step costs
    for step in rl_steps:
        result = engine.generate(prompts, ...)
        online.update(engine, result.acceptance)    # the next generations draft the chosen k

The engine is started at the largest k with vLLM's per-batch-size k table
(``num_speculative_tokens_per_batch_size``); every update recomputes the acceptance length of
each k from the engine's own per-position counters of the step just generated (free: the RL
batch's ``GenerateResult.acceptance``), combines it with the step-cost model fitted at start
(``metrics/kcost.py``) and writes the argmax k per batch size into the running engine's table,
0 where no draft pays (docs/design.md, "Online k").
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

from draftadapt.config import ConfigError
from draftadapt.metrics.acceptance import AcceptanceStats
from draftadapt.metrics.kcost import (
    KSchedule,
    StepCostModel,
    as_schedule,
    best_k_per_batch,
    fit_step_costs,
    k_at,
    step_seconds,
)


@contextlib.contextmanager
def collector_off():
    """Python's cyclic collector off for a run of timed generations, after one pass: a pass over
    the host's heap inside a sub-second timing would land on whichever cell it hits. One pass for
    the run, not one a generation: in a process holding a trainer's imports a pass took ~0.5 s, and
    one per generation made a 77-generation calibration ~40 s longer."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class OnlineKConfig:
    k_max: int = 5  # the engine starts with this many speculative tokens; the table picks 0..k_max
    # batch sizes the step costs are measured at, at start (capped at the engine's max_num_seqs);
    # between them the cost model is linear in the batch size
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128, 256])
    calibrate_tokens: int = 32  # response budget of each calibration generation
    # generations per calibration cell; the fastest counts (a busy machine's noise only slows)
    repeats: int = 2
    # weight of the earlier steps' acceptance counts against the newest step's (a decayed sum:
    # an RL batch holds thousands of drafts, so this smooths the policy's drift, not noise)
    decay: float = 0.5
    # a longer draft must beat the best shorter one by this fraction of predicted tokens/s: the
    # cost model is linear in k and has missed steps where a longer draft cost more than that
    # (docs/design.md, "Choosing k": k = 4 costing what k = 5 did at 32 sequences), and a near
    # tie is not worth the longer draft's risk
    margin: float = 0.03
    # A position's rate counts as measured where at least this share of the (decayed) drafts
    # reached it; past the last measured position the rates are extrapolated from its
    # conditional acceptance. A position the table stops drafting gets few or no new counts, so
    # its rate would stay what it was when the draft was drifted and the table could never give
    # an improved draft the longer k back (measured: docs/design.md, "Online k").
    min_reach: float = 0.25
    # A newly swapped-in draft starts from the acceptance its adapter simulated on held-out
    # rollouts (``new_draft``), counted as this many drafts: the next RL batch's thousands then
    # outweigh it. Without it a table that had turned drafting off for a weak draft would never
    # measure the better one that replaced it.
    prior_drafts: int = 64
    # Where no k pays at any batch size, draft at none: the engine's drafter then idles (no pass
    # at all, RolloutEngine.set_k_schedule) and the step costs what a plain one does. While idle
    # the engine measures nothing, so what says a draft would pay again is the adapter's
    # simulated acceptance of the draft it would serve (``OnlineK.simulated``, on the steps its
    # watch runs: ``watch_share``).
    # False keeps one token drafted at a single sequence instead, measured by the engine itself.
    step_aside: bool = True
    # With step_aside and a known RL batch: stop the calibration after k = 0, 1 and 2 where
    # they show that no k can pay at the RL batch's size (see OnlineK.calibrate); the longer k
    # are measured the first time a table would draft. On SmolLM2 (2 cores) k = 0-5 at 1-32
    # sequences took minutes, most of it in the longest k that such a head never drafts.
    early_stop: bool = True
    # While the adapter is paused (no batch size drafts), the share of the run's wall time its
    # watch may spend: the hand-over of the step's held-out rollouts and the simulated acceptance
    # of the draft it would serve, which is what turns drafting back on. A step watches while
    # what the watch spent since the pause began is within this share of the pause's time, so a
    # watch of w seconds runs at least every ceil(w / (watch_share x step)) + 1 steps: every
    # step where it is cheap next to the step (a GPU's), every few on a 2-core CPU, where it was
    # 2.2% of TRL's SmolLM2 step (StepBoundary.plan; docs/design.md, "Stepping aside").
    watch_share: float = 0.005

    def validate(self) -> None:
        if self.k_max < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"online_k: k_max >= 1 and batch sizes >= 1 (got k_max={self.k_max}, "
                              f"batch_sizes={self.batch_sizes})")
        if self.calibrate_tokens < 4 or self.repeats < 1 or not 0 <= self.decay < 1 or self.margin < 0:
            raise ConfigError(f"online_k: calibrate_tokens >= 4, repeats >= 1, 0 <= decay < 1 and margin >= 0 "
                              f"(got {self.calibrate_tokens}, {self.repeats}, {self.decay}, {self.margin})")
        if self.prior_drafts < 1:
            raise ConfigError(f"online_k: prior_drafts >= 1 (got {self.prior_drafts})")
        if not 0 < self.min_reach <= 1:
            raise ConfigError(f"online_k: 0 < min_reach <= 1 (got {self.min_reach})")
        if not 0 <= self.watch_share <= 1:
            raise ConfigError(f"online_k: 0 <= watch_share <= 1, a share of the run's time (got {self.watch_share})")


# The early stop's first round (OnlineK.calibrate): where the bound holds with the drafted cells
# read this much slow, the calibration's other rounds are not run. The bound holds by far for a
# head that cannot pay, and two rounds of three cells were ~40 of SmolLM2's 41-43 s calibration
# (2 cores, bf16, session 46), where two runs' calibrations read the same cells 2-3% apart
# (k = 1 at 32 sequences: 165.6 and 162.3 ms, each the lower of two rounds) and the bound held
# with room: k = 1 cost 2.8-2.9 plain steps, where an untrained head needs 1 + 1.25 r.
ONE_ROUND_SLACK = 0.25

# a calibration cell's step is the median of its timed decode steps where the engine timed at
# least this many at the cell's whole batch (_Calibration.measure); fewer fall back to the call's time
MIN_TIMED_STEPS = 3


def schedule_text(schedule: KSchedule) -> str:
    """'1-6:5 7-40:3 41-64:0': batch-size ranges and their k, for a log line."""
    return " ".join(f"{lo}-{hi}:{k}" if lo != hi else f"{lo}:{k}" for lo, hi, k in schedule)


class OnlineK:
    """The acceptance counts (a decayed sum), the fitted step-cost model, and the k table they give."""

    def __init__(self, model: StepCostModel, max_batch: int, k_max: int, decay: float = 0.5,
                 counts: AcceptanceStats | None = None, margin: float = 0.0, min_reach: float = 0.25,
                 prior_drafts: int = 64, step_aside: bool = False, rl_batch: int | None = None,
                 watch_share: float = 0.005):
        self.model = model
        self.step_aside = step_aside
        self.watch_share = watch_share  # the paused adapter's watch, a share of the run (StepBoundary.plan)
        # the sequences an RL generation starts with (None: not known); see choose()
        self.rl_batch = rl_batch
        self.min_reach = min_reach
        self.prior_drafts = prior_drafts
        self.max_batch = max_batch
        self.k_max = k_max
        self.decay = decay
        self.margin = margin
        self.counts = counts if counts is not None else AcceptanceStats(k_max)
        self.calibrate_s = 0.0
        self.pending: _Calibration | None = None  # an early-stopped calibration's left-out k

    @property
    def sizes(self) -> list[int]:
        """The calibration's batch sizes (``update`` reports the k at each): the cost model's,
        or an early-stopped calibration's, which measured only the RL batch's so far."""
        return list(self.pending.bss if self.pending is not None else self.model.batch_sizes)

    @property
    def rates(self) -> list[float]:
        """P(positions 0..i accepted) per position, from the decayed counts where at least
        ``min_reach`` of the drafts reached the position, else extrapolated: each further
        position accepted with the last measured conditional rate r_i / r_(i-1) (r_0 itself when
        only position 0 is measured). Optimistic on purpose: a longer k it earns is measured at
        once, and corrected if it does not hold, while a pessimistic guess is never revisited.
        But never above the position's own rate while the counts still hold ``prior_drafts``
        drafts that reached it (a share of them too small to count as measured, but recent: the
        decay halves them every step nothing drafts there): without that cap the table chose k = 4
        at 64 sequences on an extrapolated 0.61 one step after the same draft measured 0.42
        there, then k = 3 again, then 4 (toy, seed 173: the online table ended 0.905x fixed k = 3
        at the RL batch; docs/design.md, "Online k")."""
        measured = self.counts.reached_rates
        recent = self._recent()
        out = measured[: max(1, self.measured_positions)]  # position 0 as counted, even unmeasured
        for i in range(len(out), len(measured)):
            prev = out[i - 1]
            cond = prev / out[i - 2] if i >= 2 and out[i - 2] > 0 else prev
            guess = prev * min(1.0, cond) if prev == prev else prev
            out.append(min(guess, recent[i]) if recent[i] == recent[i] else guess)
        return out

    def _recent(self) -> list[float]:
        """Per position, its rate from the counts where at least ``prior_drafts`` drafts reached
        it, nan elsewhere: what caps a guess there (:attr:`rates`, :meth:`_tail`)."""
        reached = self.counts.drafts_per_position(self.k_max)
        return [r if d >= self.prior_drafts else float("nan") for r, d in zip(self.counts.reached_rates, reached)]

    def _tail(self) -> list[float]:
        """Per position, the conditional rate r_i / r_(i-1) the current counts measured where at
        least ``prior_drafts`` drafts reached it (nan elsewhere): what :meth:`_seeded` caps the
        positions the adapter's simulation does not score at."""
        rates, recent = self.counts.reached_rates, self._recent()
        return [float("nan")] + [recent[i] / rates[i - 1] if rates[i - 1] > 0 and recent[i] == recent[i]
                                 else float("nan") for i in range(1, len(rates))]

    @property
    def measured_positions(self) -> int:
        """Leading positions whose rate is measured, not extrapolated (see ``rates``)."""
        measured = self.counts.reached_rates
        reached = self.counts.drafts_per_position(self.k_max)
        n = 0
        while n < len(measured) and measured[n] == measured[n] and reached[n] >= self.min_reach * reached[0]:
            n += 1
        return n

    def observe(self, acceptance: AcceptanceStats) -> None:
        """Fold one generation's counters in (older ones weigh ``decay`` per step)."""
        if acceptance.k and acceptance.k != self.k_max:
            raise ValueError(f"acceptance counts for k={acceptance.k} from an engine started at k_max={self.k_max}")
        self.counts = self.counts.scaled(self.decay) + acceptance

    def choose(self) -> KSchedule:
        """The k table for the current counts: the argmax k per batch size. Where no batch size
        pays: all zeros with ``step_aside`` (the drafter idles; the adapter's simulated
        acceptance says when to draft again), else one draft token at a single sequence, so the
        engine's counters keep measuring the draft at the cheapest place to draft.

        With ``step_aside`` and a known ``rl_batch``: where no k pays at the RL batch's own size,
        no batch size drafts. A table that drafts anywhere keeps vLLM's drafter pass at its k = 0
        sizes, which the cost model does not price (its k = 0 cells are the idle drafter's); on
        SmolLM2 that pass cost 1.04x a plain step at 32 sequences and 1.06x at 8 (geometric
        mean of four runs, docs/results.md "Stepping aside"), paid on every step the RL batch
        runs at, while a k that pays only at small sizes gains on the few steps of its tail."""
        ks = best_k_per_batch(self.model, self.rates, self.max_batch, self.k_max, self.margin)
        if self.step_aside and self.rl_batch and not ks[min(self.rl_batch, len(ks)) - 1]:
            ks = [0] * len(ks)
        if not any(ks) and not self.step_aside:
            ks[0] = 1
        return as_schedule(ks)

    def simulated(self, engine, acceptance_length: float, k: int) -> dict[str, float]:
        """While the engine's drafter idles (no batch size drafts) its counters measure nothing:
        the acceptance length the adapter simulated for the draft it serves, on this step's
        rollouts, takes their place (as :meth:`new_draft` seeds a new draft), and the table is
        re-chosen. Does nothing while the engine drafts: its own counters are better."""
        if not getattr(engine, "drafter_idle", False):
            return {}
        out = self.new_draft(engine, acceptance_length, k)
        return {"k/idle_simulated_length": float(acceptance_length), "k/idle_rate": out["k/seeded_rate"],
                "k/resumed": out["k/changed_on_swap"], "k/calibrate_s": self.calibrate_s}

    def _seeded(self, acceptance_length: float, k: int) -> tuple[float, AcceptanceStats]:
        """The counts of a draft whose first ``k`` positions are accepted with the same
        conditional rate c, c chosen so a ``k``-token draft has ``acceptance_length``, weighted
        as ``prior_drafts`` drafts; (c, counts). The positions past ``k``, which the simulation
        did not score, take the lower of c and the conditional rate the engine measured there
        for the draft before (:meth:`_tail`): drafts trained ``k`` deep fall off past it (toy,
        seed 173, step 16: conditional 0.63 at position 3 after 0.93 and 0.87 at 1 and 2), and
        a c carried on chose k = 4 at 64 sequences for the last new draft, where the RL batch ran
        0.905x as fast as at k = 3."""
        if not acceptance_length >= 1.0 or k < 1:
            raise ValueError(f"a seeded draft needs an acceptance length >= 1 at k >= 1 (got {acceptance_length}, k={k})")
        target = min(acceptance_length - 1.0, float(k))
        lo, hi = 0.0, 1.0
        for _ in range(60):  # sum_{i=1..k} c^i is increasing in c: bisect
            c = (lo + hi) / 2
            lo, hi = (c, hi) if sum(c ** i for i in range(1, k + 1)) < target else (lo, c)
        c = (lo + hi) / 2
        tail = self._tail()
        rates, r = [], 1.0
        for i in range(self.k_max):
            r *= c if i < k or not tail[i] == tail[i] else min(c, tail[i])
            rates.append(r)
        n = float(self.prior_drafts)
        return c, AcceptanceStats(self.k_max, n, [n * ri for ri in rates], n * self.k_max, [n] * self.k_max)

    def new_draft(self, engine, acceptance_length: float, k: int) -> dict[str, float]:
        """Another draft serves in ``engine`` now: the counts of the one before no longer describe
        it. Start from the rates of a draft whose every position is accepted with the same
        conditional rate c, c chosen so a ``k``-token draft has ``acceptance_length`` (the
        adapter's simulated length on held-out rollouts, ``DraftAdapter.simulated_length``),
        weighted as ``prior_drafts`` drafts; re-choose and write the table."""
        c, self.counts = self._seeded(acceptance_length, k)
        return {"k/seeded_rate": c, "k/changed_on_swap": float(self._write(engine))}

    def would_pay(self, acceptance_length: float, k: int) -> bool:
        """Whether a draft of ``acceptance_length`` at ``k`` (simulated) would draft at some batch
        size: the table :meth:`choose` gives it (the RL-batch rule included), nothing written."""
        saved = self.counts
        try:
            self.counts = self._seeded(acceptance_length, k)[1]
            return any(kk for _, _, kk in self.choose())
        finally:
            self.counts = saved

    def pause_adapter(self, engine, fresh_length: float | None, k: int) -> bool:
        """Whether the adapter's round should wait (``StepBoundary.paused``): while the engine's
        drafter idles, unless a draft as good as the adapter's newest was when it was published
        (``fresh_length``: its simulated length then, ``DraftAdapter.fresh_length``) would
        draft. Where no draft pays even fresh (a weak head, a CPU that speculation cannot pay
        on) the adapter trains nothing nobody serves; where the served draft fell out of pay
        because the policy moved, the rounds go on, since a fresh draft would serve
        (docs/design.md, "Stepping aside"). Without a publish to go by (the starting draft),
        paused while idle."""
        if not getattr(engine, "drafter_idle", False):
            return False
        return fresh_length is None or not self.would_pay(fresh_length, k)

    def _write(self, engine) -> bool:
        """Write the current choice into ``engine`` if it differs from what it serves; True if it did.
        A table that drafts, chosen on a calibration that stopped early, first measures the k it
        left out (:meth:`finish_calibration`) and is chosen again on the whole model."""
        schedule = self.choose()
        if self.pending is not None and any(k for _, _, k in schedule):
            self.finish_calibration(engine)
            schedule = self.choose()
        changed = schedule != engine.k_schedule
        if changed:
            engine.set_k_schedule(schedule)
        return changed

    def update(self, engine, acceptance: AcceptanceStats) -> dict[str, float]:
        """Fold ``acceptance`` (the step's ``GenerateResult.acceptance``) in, re-choose, and write
        the table into ``engine`` in place when it changed. Returns metrics: the k at each
        calibrated batch size (``k/b<N>``), whether the table changed, and the rates the choice used."""
        self.observe(acceptance)
        changed = self._write(engine)
        out = {f"k/b{b}": float(k_at(engine.k_schedule, b)) for b in self.sizes}
        out["k/changed"] = float(changed)
        out.update({f"k/rate_pos_{i}": r for i, r in enumerate(self.rates)})
        out["k/measured_positions"] = float(self.measured_positions)
        out["k/calibrate_s"] = self.calibrate_s  # all of it so far, an early stop's remainder included
        return out

    @classmethod
    def calibrate(cls, engine, prompts: Sequence[str] | Sequence[Sequence[int]], cfg: OnlineKConfig | None = None,
                  temperature: float = 1.0, seed: int = 0, rl_batch: int | None = None) -> "OnlineK":
        """Fit the step-cost model on ``engine`` itself: its table set to one k at a time (every k
        from 0 to the engine's: the cost is convex in k at large batches, and a line through
        three lengths over-priced the middle ones there, docs/design.md "Online k"),
        ``cfg.calibrate_tokens`` tokens for each calibration batch size of
        ``prompts`` (reused in order when there are fewer). The k = 0 cell is this engine's with
        its drafter idle (a table of zeros runs no drafter: a plain step's cost, docs/design.md
        "Stepping aside"); in a table that drafts at some other batch size vLLM's first pass
        still runs at k = 0, which this cell does not price. The
        k_max generations also give the first acceptance counts; the engine then serves the
        table they choose (its own table again if the calibration fails). ``rl_batch``: the
        sequences an RL generation starts with (see ``choose``); no batch size above it is
        measured, since none runs.

        Early stop (``cfg.early_stop``, with ``step_aside``, ``rl_batch`` and k_max > 2): after
        k = 0, 1 and 2, at the RL batch's size b (when the calibration sizes reach it; no early
        stop otherwise), with c0, c1, c2 their step costs and r the first position's acceptance
        rate in the k = 2 generations: a k-token draft accepts at most 1 + k r tokens a step
        (no later position is accepted more often than the first), and where the cost's
        increments in k do not shrink past k = 1 (a fixed drafter cost, then a cost per draft
        token that grows with k: measured on this CPU at 8 sequences and up, docs/design.md
        "Online k") a step costs at least c1 + (k - 1)(c2 - c1). If (1 + r') c0 <= c1 and
        r' c0 <= c2 - c1, with r' = 1.25 r (room for the timings' noise), no k beats the plain
        step at b: nothing drafts (``choose``), and the longer k are measured only once a table
        would draft (:meth:`finish_calibration`). Until then the counts are the k = 2
        generations' (later positions extrapolated). These three cells are measured one round
        first; where the bound holds even with their drafted cells read ``ONE_ROUND_SLACK``
        slow, the other ``cfg.repeats - 1`` rounds are left out (on SmolLM2, 2 cores, about
        half of the calibration)."""
        cfg = cfg or OnlineKConfig()
        cfg.validate()
        before = engine.k_schedule
        if before is None:
            raise ValueError("online k needs an engine started with a k table: RolloutEngine(..., "
                             f"num_speculative_tokens={cfg.k_max}, k_schedule=[(1, MAX_NUM_SEQS, K)])")
        if not prompts:
            raise ValueError("online k calibration needs at least one prompt")
        k_max = engine.k
        # an RL generation never runs more sequences than it starts with: sizes past rl_batch are
        # not measured (on SmolLM2, 2 cores, the 64-sequence column was ~half the calibration)
        cap = min(engine.max_num_seqs, rl_batch or engine.max_num_seqs)
        bss = sorted({min(b, cap) for b in cfg.batch_sizes})
        plan = _Calibration([prompts[i % len(prompts)] for i in range(max(bss))], bss, cfg, temperature, seed)
        t0 = time.perf_counter()
        done = False
        try:
            head = list(range(min(k_max, 2) + 1))  # k = 0, 1, 2
            longer = [(k, b) for k in range(3, k_max + 1) for b in bss]
            # the bound holds where it is computed: only at the RL batch's own size (measured when
            # the calibration sizes reach it), not extrapolated from a smaller one. That size is
            # measured first: where no k pays there, no size drafts (``choose``), and the other
            # sizes wait with the longer k (on verl's toy at 256 sequences a server, the smaller
            # sizes were ~half of a 120 s calibration that chose no draft)
            if cfg.early_stop and cfg.step_aside and rl_batch is not None and k_max > 2 and bss[-1] == cap:
                points, counts = plan.rl_batch_first(engine, head, longer, cap, k_max)
            else:
                first, counts2 = plan.measure(engine, [(k, b) for k in head for b in bss], k_max)
                rest, counts = plan.measure(engine, longer, k_max) if longer else ([], counts2)
                points = first + rest
            plan.points = points
            online = cls(fit_step_costs(points), engine.max_num_seqs, k_max, cfg.decay, counts, cfg.margin,
                         cfg.min_reach, cfg.prior_drafts, cfg.step_aside, rl_batch, cfg.watch_share)
            online.pending = plan if plan.left else None
            engine.set_k_schedule(online.choose())
            done = True
        finally:
            if not done:
                engine.set_k_schedule(before)
        online.calibrate_s = time.perf_counter() - t0
        return online

    def finish_calibration(self, engine) -> None:
        """Measure the k an early-stopped calibration left out (on its prompts and batch sizes),
        fold their k_max generations' counts in, and refit the cost model on every point."""
        plan, self.pending = self.pending, None
        if plan is None:
            return
        t0 = time.perf_counter()
        rest, counts = plan.measure(engine, plan.left, self.k_max)
        self.model = fit_step_costs(_lowest(plan.points + rest))
        self.counts = self.counts + counts
        self.calibrate_s += time.perf_counter() - t0


def _no_k_pays(points: list[tuple[int, int, float]], counts: AcceptanceStats, b: int, slack: float = 0.0) -> bool:
    """The early stop's bound (OnlineK.calibrate): at batch size ``b`` no k can beat the plain
    step, given the k = 0, 1, 2 costs (``points``) and the k = 2 generations' counts. ``slack``:
    the bound must also hold with the drafted cells' costs (k = 1, 2) divided by 1 + slack, what
    a cell read slow by that much would really cost (a busy machine only slows a timing: the
    plain cell read slow makes the bound harder to meet, never easier)."""
    cost = {k: s for k, bb, s in points if bb == b}
    r = counts.reached_rates[0] if counts.drafts else float("nan")
    if not {0, 1, 2} <= set(cost) or not r == r:
        return False
    r = min(1.0, 1.25 * r)
    c1, c2 = cost[1] / (1 + slack), cost[2] / (1 + slack)
    return (1 + r) * cost[0] <= c1 and r * cost[0] <= c2 - cost[1]


def _lowest(points: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """Per (k, batch size), the lowest of the points measured for it (rounds measured apart)."""
    low: dict[tuple[int, int], float] = {}
    for k, b, s in points:
        low[(k, b)] = min(s, low.get((k, b), s))
    return [(k, b, s) for (k, b), s in sorted(low.items())]


class _Calibration:
    """What a calibration measures on (prompts, batch sizes, settings), the points so far, and
    the k it has left to measure."""

    def __init__(self, pool: list, bss: list[int], cfg: OnlineKConfig, temperature: float, seed: int):
        self.pool, self.bss, self.cfg, self.temperature, self.seed = pool, bss, cfg, temperature, seed
        self.points: list[tuple[int, int, float]] = []
        self.left: list[tuple[int, int]] = []  # (k, batch size) cells an early stop left out
        self.first: dict[int, float] = {}  # call_seconds, per batch size

    def _generate(self, engine, b: int, max_tokens: int):
        return engine.generate(self.pool[:b], temperature=self.temperature, max_tokens=max_tokens, seed=self.seed)

    def call_seconds(self, engine, bss: list[int]) -> dict[int, float]:
        """Per batch size, what a generation costs before its first decode step: the call, the
        prefill and the first token (a one-token generation, drafter idle, fastest of
        ``cfg.repeats``), measured once a size, for the cells whose engine timed no steps
        (:meth:`measure`). Left in the step cost it would count once per
        call in every step, and more per step the fewer steps a call takes: a k that accepts L
        tokens a step takes 1/L of the steps, so a calibration of ``calibrate_tokens`` tokens
        charged drafting more of it than an RL generation of a few hundred tokens pays
        (docs/design.md, "Online k")."""
        missing = [b for b in bss if b not in self.first]
        if missing:
            engine.set_k_schedule([(1, engine.max_num_seqs, 0)])
            with collector_off():
                for _ in range(self.cfg.repeats):  # in rounds, as the cells (see measure)
                    for b in missing:
                        s = self._generate(engine, b, 1).seconds
                        self.first[b] = min(s, self.first.get(b, s))
        return self.first

    def rl_batch_first(self, engine, head: list[int], longer: list[tuple[int, int]], cap: int,
                       k_max: int) -> tuple[list[tuple[int, int, float]], AcceptanceStats]:
        """The early stop (OnlineK.calibrate): k = 0, 1, 2 (``head``) at the RL batch's size
        ``cap``, one round first; where the bound holds even with the drafted cells read
        ONE_ROUND_SLACK slow, the other rounds cannot change the answer. Where no k pays, the
        other sizes, the ``longer`` k and the left-out rounds wait in :attr:`left` (measured the
        first time a table would draft, each cell's lowest kept); else every cell is measured now.
        Returns (points, counts)."""
        cells = [(k, cap) for k in head]
        first, counts2 = self.measure(engine, cells, k_max, repeats=1)
        one_round = self.cfg.repeats == 1 or _no_k_pays(first, counts2, cap, slack=ONE_ROUND_SLACK)
        if not one_round:
            more, extra = self.measure(engine, cells, k_max, repeats=self.cfg.repeats - 1)
            first, counts2 = _lowest(first + more), counts2 + extra
        others = [(k, b) for k in head for b in self.bss if b != cap]
        if _no_k_pays(first, counts2, cap):
            self.left = others + longer + (cells if self.cfg.repeats > 1 and one_round else [])
            return first, counts2
        more = self.measure(engine, others, k_max)[0] if others else []
        rest, counts = self.measure(engine, longer, k_max)
        return first + more + rest, counts

    def measure(self, engine, cells: list[tuple[int, int]], k_max: int,
                repeats: int | None = None) -> tuple[list[tuple[int, int, float]], AcceptanceStats]:
        """Step-cost points for the (k, batch size) ``cells``, and the acceptance counts of the
        generations at the largest k among them (the k_max ones give the rates). ``repeats``:
        rounds of them (default ``cfg.repeats``).

        A point is the engine's own step: the median wall time of the cell's decode steps at its
        whole batch (``GenerateResult.decode_step_seconds``: no prompt beside them, every sequence
        still running), the lowest of ``cfg.repeats`` medians. A cell whose engine reports no
        steps (a Ray fleet) falls back to its fastest generation's time less its
        :meth:`call_seconds`, over its decode steps (``calibrate_tokens - 1`` tokens a sequence
        at the k's acceptance length a step). The fallback is a small difference of two timings:
        on a 2-core AVX2 AMD EPYC a cell moved 25-60% between calibrations that way (session 42),
        where a median of a dozen steps is not moved by one slow step nor by the call's cost."""
        points, counts = [], AcceptanceStats(k_max)
        cells = sorted(set(cells))
        top = max(k for k, _ in cells)
        best: dict[tuple[int, int], object] = {}
        stepped: dict[tuple[int, int], float] = {}  # the lowest median decode step, per cell
        with collector_off():
            # in rounds: every cell once a round, so a cell's repeats are a round apart rather than
            # back to back, and a slow spell of the machine slows one repeat of many cells instead
            # of every repeat of one (the lowest counts). Back to back, one calibration of the toy
            # on a 2-core AVX2 AMD EPYC priced k = 3 at 64 sequences at 2.8 plain steps and k = 2
            # at 1.5, where 96-token generations measured 1.7 and 1.65 (session 42); the demo's
            # table then drafted one token at 15-64 sequences, where three made 1.26-1.38x its
            # tokens/s
            for _ in range(self.cfg.repeats if repeats is None else repeats):
                for k in sorted({k for k, _ in cells}):
                    engine.set_k_schedule([(1, engine.max_num_seqs, k)])
                    for b in [b for kk, b in cells if kk == k]:
                        res = self._generate(engine, b, self.cfg.calibrate_tokens)
                        if k == top and k > 0:
                            counts = counts + res.acceptance
                        steps = res.decode_step_seconds(b, k)
                        if len(steps) >= MIN_TIMED_STEPS:
                            step = statistics.median(steps)
                            stepped[(k, b)] = min(step, stepped.get((k, b), step))
                        if (k, b) not in best or res.tokens_per_s > best[(k, b)].tokens_per_s:
                            best[(k, b)] = res
        untimed = sorted({b for (k, b) in best if (k, b) not in stepped})
        first = self.call_seconds(engine, untimed) if untimed else {}
        for (k, b), res in sorted(best.items()):
            if (k, b) in stepped:
                points.append((k, b, stepped[(k, b)]))
                continue
            length = res.acceptance.length if k else 1.0
            decoded = res.num_tokens - b  # the first token of each sequence came with the prefill
            net = res.seconds - first[b]
            if decoded > 0 and net > 0:
                step = b * length * net / decoded
            else:  # nothing decoded past the first token, or a timing below the call's own
                step = step_seconds(b, res.tokens_per_s, length)
            points.append((k, b, step))
        return points, counts
