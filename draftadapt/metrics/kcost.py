"""Which draft length k pays at which batch size: a step-cost model fitted from measurements.

Pure functions, no engine (``draftadapt eval --ks ... --batch-sizes ...`` measures the inputs).
With b sequences decoding together, a step emits b tokens without speculation and b * L(k) with
k draft tokens (L = acceptance length), so

    tokens/s(k, b) = b * L(k) / c(k, b)

where c(k, b) is the wall time of one step: k draft forwards plus one target forward verifying
k + 1 tokens per sequence (k = 0: one plain forward). On a compute-bound target (the toy on a
CPU) c grows with k and with b, so the k that pays falls as the batch grows (docs/design.md,
"Choosing k").

The model, per measured batch size b:

    c(0, b) = plain(b)
    c(k, b) = plain(b) + max(0, fixed(b) + k * per_k(b) + k^2 * per_k2(b))      (k >= 1)

``fixed`` is what any speculative step adds (the drafter's bookkeeping, the rejection sampler),
``per_k`` one more draft forward plus one more verified token per sequence. Three measured
lengths (0, the smallest and the largest k >= 1) determine the linear part; ``per_k2`` is fitted
only where five or more lengths were measured (one more than its four coefficients, so a noisy
cell is smoothed, not interpolated): on this CPU a step's cost grows faster than
linearly in k once the batch is large (docs/design.md, "Choosing k"), and a line through k = 1
and k = 5 then over-prices the k in between. Between measured batch sizes each coefficient is
interpolated linearly in b (extrapolated from the end segments).

Acceptance needs one engine: vLLM's per-position rates at k_max, r_i = P(positions 0..i all
accepted), give L(k) = 1 + sum_{i<k} r_i for every k <= k_max (the first k positions of a
k_max draft are a k draft). The walk over drafting starts differs slightly between k's (a draft
that accepts all k resumes k + 1 later), which is what the measured table checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def step_seconds(batch_size: int, tokens_per_s: float, acceptance_length: float) -> float:
    """Effective seconds per engine step from a measured generation: the time of one step had
    all ``batch_size`` sequences decoded in lockstep (b * L tokens per step). Sequences that
    finish early and the prompt's prefill are folded into it, the same way for every k."""
    return batch_size * acceptance_length / tokens_per_s


def fit_ks(ks: list[int]) -> list[int]:
    """The draft lengths whose engines the cost model is fitted on: 0, the smallest and the
    largest k >= 1 among ``ks`` (the rest are predicted)."""
    drafting = sorted(k for k in set(ks) if k > 0)
    return sorted({k for k in ks if k == 0} | set(drafting[:1]) | set(drafting[-1:]))


@dataclass
class StepCostModel:
    """c(k, b) = plain(b) + [k > 0] fixed(b) + k per_k(b) + k^2 per_k2(b), coefficients per
    measured batch size."""

    batch_sizes: list[int]  # ascending
    plain: list[float]  # seconds per plain step, per batch size
    fixed: list[float]  # seconds a speculative step adds whatever k
    per_k: list[float]  # seconds per extra draft token
    per_k2: list[float] | None = None  # the curvature in k (None: a line in k)

    def to_dict(self) -> dict[str, list]:
        out = {"batch_sizes": self.batch_sizes, "plain_s": self.plain, "spec_fixed_s": self.fixed,
               "per_k_s": self.per_k}
        if self.per_k2 is not None:
            out["per_k2_s"] = self.per_k2
        return out


def fit_step_costs(points: list[tuple[int, int, float]]) -> StepCostModel:
    """Least-squares fit of the step-cost model to measured (k, batch_size, seconds/step) points.

    Per batch size, the features of k are [1, k > 0, k], and k^2 where five or more distinct k
    were measured there and its coefficient comes out positive (a negative one is noise: the
    step would get cheaper per draft token as k grows); each point is weighted by 1/seconds so the fit minimises relative
    error. With fewer than three distinct k at a batch size the minimum-norm solution is taken:
    exact at the measured k, and the measured k are then the only ones asked for. Every batch
    size needs k = 0 measured (the plain step anchors it).
    """
    by_b: dict[int, list[tuple[int, float]]] = {}
    for k, b, s in points:
        if k < 0 or b < 1 or not s > 0:
            raise ValueError(f"step-cost point (k={k}, batch_size={b}, seconds={s}): need k >= 0, "
                             "batch_size >= 1 and seconds > 0")
        by_b.setdefault(int(b), []).append((int(k), float(s)))
    if not by_b:
        raise ValueError("no step-cost points to fit; measure at least k=0 at one batch size")
    bss = sorted(by_b)
    plain, fixed, per_k, per_k2 = [], [], [], []
    for b in bss:
        rows = by_b[b]
        if not any(k == 0 for k, _ in rows):
            raise ValueError(f"batch size {b} has no k=0 (plain) measurement; the model is anchored on it")
        y = np.array([s for _, s in rows])
        w = 1.0 / y
        coef = None
        if len({k for k, _ in rows}) >= 5:
            x = np.array([[1.0, float(k > 0), float(k), float(k * k)] for k, _ in rows])
            coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
            if coef[3] < 0:  # a step never gets cheaper per draft token as k grows: that is noise
                coef = None
        curved = coef is not None
        if coef is None:
            x = np.array([[1.0, float(k > 0), float(k)] for k, _ in rows])
            coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        plain.append(float(coef[0]))
        fixed.append(float(coef[1]))
        per_k.append(float(coef[2]))
        per_k2.append(float(coef[3]) if curved else 0.0)
    return StepCostModel(bss, plain, fixed, per_k, per_k2 if any(per_k2) else None)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in x through (xs, ys), extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0]
    i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def step_cost(model: StepCostModel, k: int, batch_size: int) -> float:
    """Predicted seconds per step at draft length ``k`` (0 = no speculation) and ``batch_size``.

    A speculative step never costs less than the plain one: it runs the same target forward,
    verifying k + 1 tokens a sequence instead of one, and the drafter on top. A fit whose
    speculative part comes out negative (timings on a loaded machine: in one CI run a k = 1
    generation of 8 tokens at 8 sequences measured faster than the plain one) is held at the plain
    step, so a draft that accepts nothing (L = 1) can never look as if it paid."""
    bss = model.batch_sizes
    c = _interp(bss, model.plain, batch_size)
    if k > 0:
        extra = _interp(bss, model.fixed, batch_size) + k * _interp(bss, model.per_k, batch_size)
        if model.per_k2 is not None:
            extra += k * k * _interp(bss, model.per_k2, batch_size)
        c += max(0.0, extra)
    return c


def acceptance_length_at(per_position: list[float], k: int) -> float:
    """Expected acceptance length of a k-token draft from per-position rates measured at
    k_max >= k: per_position[i] = P(positions 0..i all accepted). k = 0: 1.0 (no draft)."""
    if k > len(per_position):
        raise ValueError(f"acceptance at k={k} needs per-position rates measured at k >= {k}; "
                         f"got {len(per_position)} positions (measure the largest k asked for)")
    return 1.0 + float(sum(per_position[:k]))


def predicted_tokens_per_s(model: StepCostModel, k: int, batch_size: int, acceptance_length: float) -> float:
    """b * L / c(k, b): tokens per second at draft length k and batch size b."""
    return batch_size * acceptance_length / step_cost(model, k, batch_size)


def choose_k(tokens_per_s: dict[tuple[int, int], float]) -> dict[int, int]:
    """Per batch size, the k with the most tokens/s in a {(k, batch_size): tokens/s} table; a
    tie goes to the smaller k (less draft work for the same speed)."""
    best: dict[int, tuple[float, int]] = {}
    for (k, b), tps in sorted(tokens_per_s.items()):
        if tps is None or not np.isfinite(tps):
            continue
        if b not in best or tps > best[b][0]:
            best[b] = (tps, k)
    return {b: k for b, (_, k) in sorted(best.items())}


# vLLM's num_speculative_tokens_per_batch_size: inclusive (batch_from, batch_to, k) ranges that
# start at 1; the engine drafts k tokens at a step whose running batch falls in the range.
KSchedule = list[tuple[int, int, int]]


def best_k_per_batch(model: StepCostModel, per_position: list[float], max_batch: int,
                     k_max: int | None = None, margin: float = 0.0) -> list[int]:
    """The k in 0..k_max with the most predicted tokens/s at every batch size 1..max_batch (a
    tie to the smaller k): element b - 1 is the k for b sequences. ``margin``: a longer draft
    is chosen only if it beats every shorter one by this fraction. ``per_position``: rates
    measured at k >= k_max (``AcceptanceStats.reached_rates``); a nan rate (a position no draft
    reached) counts as 0. A k whose predicted step cost is not positive (the linear cost model
    extrapolated too far from the measured batches) is not chosen, and where the plain step's
    cost is not positive the batch size takes the k of the one before it."""
    k_max = len(per_position) if k_max is None else k_max
    if k_max > len(per_position):
        raise ValueError(f"k_max={k_max} needs per-position rates for {k_max} positions, got {len(per_position)}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
    rates = [r if np.isfinite(r) else 0.0 for r in per_position]
    out = []
    for b in range(1, max_batch + 1):
        if out and not step_cost(model, 0, b) > 0:
            # the plain step's line extrapolated to no cost: nothing is compared there (a drafted
            # k would win by default); the k chosen at the largest batch the model still covers
            out.append(out[-1])
            continue
        best, best_k = -np.inf, 0
        for k in range(k_max + 1):
            c = step_cost(model, k, b)
            if not c > 0:
                continue
            tps = b * acceptance_length_at(rates, k) / c
            if tps > best * (1 + margin) if best > 0 else tps > best:
                best, best_k = tps, k
        out.append(best_k)
    return out


def as_schedule(ks: list[int]) -> KSchedule:
    """[k for b = 1, 2, ...] -> vLLM's ranges: one (batch_from, batch_to, k) per run of equal k."""
    if not ks:
        raise ValueError("no batch sizes to make a k schedule of")
    out: KSchedule = []
    for b, k in enumerate(ks, start=1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, k))
    return out


def k_at(schedule: KSchedule, batch_size: int) -> int:
    """The k a schedule gives ``batch_size`` sequences (the last range's k past its end, as vLLM)."""
    k = schedule[0][2]
    for lo, _, rk in schedule:
        if batch_size >= lo:
            k = rk
    return k
