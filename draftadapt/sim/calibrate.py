"""Fit the simulator's free parameters to a real run's telemetry and report the fit error.

    from draftadapt.sim.calibrate import calibrate
    fit = calibrate(cfg, read_telemetry("runs/x/telemetry.jsonl"))
    print(fit.summary())

Each telemetry line becomes the recipe as that step saw it: its sequence count and mean
response length (gen/tokens / gen/num_seqs), its k and acceptance. The model predicts the
step's stage times and a least-squares fit on log(predicted / measured) moves the free
parameters (dotted recipe fields, e.g. ``engine.draft_overhead_ms``). What the telemetry
cannot tell apart stays as the recipe states it: the defaults free only parameters that the
logged stages pin down.

    pred = predict_demo_async(read_telemetry("OUT/metrics.jsonl"))  # a demo async_lag=1 run
    print(pred.summary())

fits the shared-cores model of the demo's asynchronous step (model.shared_async_step) and
predicts each step leave-one-out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass, replace

import numpy as np

from draftadapt.config import ConfigError
from draftadapt.sim.config import SharedCoresConfig, SimConfig
from draftadapt.sim.model import (
    StageCosts, learner_times, median_for_mean, rel_err, shared_async_step, simulate_step,
)
from draftadapt.sim.telemetry import StepRecord

FITTED_STAGES = ("prepare_s", "gen_s", "logprob_s", "train_s")

# search range of each parameter the fit may move (anything else: [0, inf))
BOUNDS: dict[str, tuple[float, float]] = {
    "workload.sigma": (0.05, 3.0),
    "workload.median_tokens": (16.0, 1e6),
    "engine.bw_eff": (0.05, 1.0),
    "engine.flops_eff": (0.05, 1.0),
    "learner.logprob_mfu": (0.01, 1.0),
    "learner.train_mfu": (0.01, 1.0),
}


def get_param(cfg: SimConfig, name: str) -> float:
    section, _, field_name = name.partition(".")
    obj = getattr(cfg, section, None)
    if obj is None or not is_dataclass(obj) or field_name not in {f.name for f in fields(obj)}:
        raise ConfigError(f"cannot fit {name!r}: not a section.field of the recipe")
    value = getattr(obj, field_name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"cannot fit {name!r}: it is not a number ({value!r})")
    return float(value)


def set_params(cfg: SimConfig, values: dict[str, float]) -> SimConfig:
    for name, value in values.items():
        section, _, field_name = name.partition(".")
        obj = getattr(cfg, section)
        if isinstance(getattr(obj, field_name), int) and not isinstance(getattr(obj, field_name), bool):
            value = int(round(value))
        cfg = replace(cfg, **{section: replace(obj, **{field_name: value})})
    return cfg


def record_config(cfg: SimConfig, rec: StepRecord) -> SimConfig:
    """The recipe as the step of ``rec`` ran it: its batch, mean length, k and acceptance."""
    if rec.num_seqs:
        cfg = replace(cfg, workload=replace(cfg.workload, rollouts=rec.num_seqs))
    mean = rec.mean_response
    if mean is not None:
        cfg = replace(cfg, workload=replace(cfg.workload, median_tokens=median_for_mean(cfg, mean)))
    if rec.speculative:
        alpha = rec.accept_length if rec.accept_length is not None else cfg.spec.accept_length
        cfg = replace(cfg, spec=replace(cfg.spec, k=rec.k, accept_length=min(alpha, rec.k + 1.0),
                                        accept_pos=None, accept_floor=1.0, drift_per_step=0.0))
    return cfg


def predict(cfg: SimConfig, rec: StepRecord, mode: str | None = None) -> dict[str, float]:
    """Stage times the model gives for the step of ``rec``."""
    run = record_config(cfg, rec)
    return {"gen_s": _gen_s(run, rec, mode), **_learner_s(run)}


def _gen_s(run: SimConfig, rec: StepRecord, mode: str | None) -> float:
    mode = mode or run.pipeline.modes[0]
    return simulate_step(run, mode, run.spec.accept_length if rec.speculative else None).gen_s


def _learner_s(run: SimConfig) -> dict[str, float]:
    lt = learner_times(run)
    return {"prepare_s": lt.prepare_s, "logprob_s": lt.logprob_s, "train_s": lt.train_s}


@dataclass
class Residual:
    record: int  # index in the telemetry
    stage: str
    measured: float
    predicted: float

    @property
    def rel_err(self) -> float:
        return rel_err(self.predicted, self.measured)


@dataclass
class Fit:
    params: dict[str, float]  # fitted values by dotted name
    start: dict[str, float]  # the recipe's values before the fit
    config: SimConfig  # the recipe with the fitted values
    residuals: list[Residual]

    def rms(self, stage: str | None = None) -> float:
        errs = [r.rel_err for r in self.residuals if stage is None or r.stage == stage]
        return float(np.sqrt(np.mean(np.square(errs)))) if errs else math.nan

    @property
    def max_abs_err(self) -> float:
        return max(abs(r.rel_err) for r in self.residuals)

    def summary(self) -> str:
        lines = ["calibration:"]
        for name, value in self.params.items():
            lines.append(f"  {name:32s} {self.start[name]:>10.4g} -> {value:.4g}")
        for stage in FITTED_STAGES:
            n = sum(r.stage == stage for r in self.residuals)
            if n:
                lines.append(f"  fit error {stage:10s} rms {self.rms(stage):6.1%} over {n} steps")
        lines.append(f"  fit error overall    rms {self.rms():6.1%}, worst {self.max_abs_err:.1%}")
        return "\n".join(lines)


def default_free(records: list[StepRecord]) -> list[str]:
    """Parameters the logged stages pin down: the tail shape from plain generation, the draft
    overhead from speculative generation, the learner's MFUs and the fixed weight-sync time."""
    free = []
    if any(r.gen_s is not None for r in records):
        free.append("workload.sigma")
    if any(r.gen_s is not None and r.speculative and r.accept_length for r in records):
        free.append("engine.draft_overhead_ms")
    if any(r.logprob_s is not None for r in records):
        free.append("learner.logprob_mfu")
    if any(r.train_s is not None for r in records):
        free.append("learner.train_mfu")
    if any(r.prepare_s is not None for r in records):
        free.append("learner.prepare_fixed_s")
    return free


def _usable(rec: StepRecord, stage: str) -> bool:
    measured = getattr(rec, stage)
    if measured is None or measured <= 0:
        return False
    return not (stage == "gen_s" and rec.speculative and rec.accept_length is None)


def evaluate(cfg: SimConfig, records: list[StepRecord], mode: str | None = None,
             gen_cache: dict | None = None) -> list[Residual]:
    """Model vs telemetry for every logged stage. Generation does not depend on the learner's
    parameters, so a fit that only moves those reuses ``gen_cache``."""
    gen_cache = {} if gen_cache is None else gen_cache
    out = []
    for i, rec in enumerate(records):
        stages = [s for s in FITTED_STAGES if _usable(rec, s)]
        if not stages:
            continue
        run = record_config(cfg, rec)
        predicted = _learner_s(run)
        if "gen_s" in stages:
            key = (rec.num_seqs, rec.mean_response, rec.k if rec.speculative else 0,
                   rec.accept_length if rec.speculative else None, mode,
                   repr((cfg.target, cfg.spec, cfg.engine, cfg.workload, cfg.cluster, cfg.pipeline)))
            if key not in gen_cache:
                gen_cache[key] = _gen_s(run, rec, mode)
            predicted["gen_s"] = gen_cache[key]
        out.extend(Residual(i, s, getattr(rec, s), predicted[s]) for s in stages)
    return out


def calibrate(
    cfg: SimConfig,
    records: list[StepRecord],
    free: list[str] | None = None,
    mode: str | None = None,
) -> Fit:
    """Least-squares fit of ``free`` (dotted recipe fields) to the telemetry's stage times."""
    from scipy.optimize import least_squares

    free = list(default_free(records) if free is None else free)
    if "workload.median_tokens" in free and any(r.mean_response is not None for r in records):
        raise ConfigError(
            "workload.median_tokens is set by gen/tokens and gen/num_seqs in the telemetry; "
            "drop it from the free parameters"
        )
    start = {name: get_param(cfg, name) for name in free}
    if not evaluate(cfg, records, mode):
        raise ConfigError("the telemetry logs no stage time the model predicts (stage/*_s)")
    # work in units of the starting value (or of the bound's scale when it starts at 0)
    scale = np.array([abs(v) if v else max(1.0, BOUNDS.get(n, (0, 1.0))[0]) for n, v in start.items()])
    low = np.array([BOUNDS.get(n, (0.0, math.inf))[0] for n in free]) / scale
    high = np.array([BOUNDS.get(n, (0.0, math.inf))[1] for n in free]) / scale
    x0 = np.clip(np.array(list(start.values())) / scale, low + 1e-9, high - 1e-9)

    gen_cache: dict = {}

    def residuals(x: np.ndarray) -> np.ndarray:
        trial = set_params(cfg, dict(zip(free, x * scale)))
        return np.array([math.log(r.predicted / r.measured)
                         for r in evaluate(trial, records, mode, gen_cache)])

    if free:
        sol = least_squares(residuals, x0, bounds=(low, high), diff_step=1e-4, xtol=1e-6, ftol=1e-6)
        fitted = dict(zip(free, (sol.x * scale).tolist()))
    else:
        fitted = {}
    final = set_params(cfg, fitted)
    return Fit(params=fitted, start=start, config=final, residuals=evaluate(final, records, mode))


def synthetic_telemetry(
    cfg: SimConfig,
    steps: int,
    *,
    plain_steps: int = 2,
    growth_per_step: float = 0.01,
    adapt_every: int | None = None,
    noise: float = 0.0,
    seed: int = 0,
) -> list[StepRecord]:
    """Telemetry the model itself would log for a run of ``cfg`` (for tests and the sample).

    The first ``plain_steps`` steps run without speculation (an A/B probe pins the length
    tail); mean response length grows by ``growth_per_step`` per step as RL lengthens
    answers; acceptance decays by spec.drift_per_step and, every ``adapt_every`` steps, an
    adapted draft restores it. Stage times get multiplicative Gaussian noise of ``noise``.
    """
    from draftadapt.sim.model import beta_for_length, decayed_length, geometric_pos, mean_response

    rng = np.random.default_rng(seed)
    s = cfg.spec
    base_mean = mean_response(cfg)
    records = []
    version, since = 0, 0
    for t in range(steps):
        spec = t >= plain_steps and s.k > 0
        if spec and adapt_every and since >= adapt_every:
            version, since = version + 1, 0
        mean = base_mean * (1.0 + growth_per_step * t)
        rec = StepRecord(step=t, policy_version=t, num_seqs=cfg.workload.rollouts,
                         tokens=round(mean * cfg.workload.rollouts), k=s.k if spec else 0)
        if spec:
            alpha = decayed_length(s.accept_length, s.k, s.drift_per_step, since, s.accept_floor)
            pos = geometric_pos(beta_for_length(alpha, s.k), s.k)
            rec.accept_pos = [round(float(p), 4) for p in pos]
            rec.accept_length = round(1.0 + sum(rec.accept_pos), 4)
            rec.simulated_length = round(alpha, 4)  # the model knows the expected value exactly
            rec.draft_version = version
            since += 1
        for stage, value in predict(cfg, rec).items():
            setattr(rec, stage, round(value * float(np.exp(noise * rng.standard_normal())), 3))
        if spec and adapt_every and since == 1 and version > 0:
            rec.swap_ms = round(cfg.adapt.swap_ms, 1)
            rec.adapt_s = round(cfg.adapt.train_s, 2)
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# the demo's asynchronous step on shared cores (docs/design.md "Simulator: asynchronous
# steps", "The demo's step on shared cores")

SHARED_FREE = ("gen_slowdown", "train_slowdown", "boundary_s")
# a job is never faster beside the other one than alone on every core (assumption)
SHARED_BOUNDS = {"gen_slowdown": (1.0, 20.0), "train_slowdown": (1.0, 20.0), "boundary_s": (0.0, 60.0)}
_ASYNC_KEYS = ("gen_s", "train_s", "adapt_s", "exposed_gen_s", "rl_step_s")


def demo_async_steps(records: list[StepRecord]) -> tuple[list[int], list[int]]:
    """(steady, last) record indices of an async_lag=1 demo run: record 0 is the first step
    (it also waits for the pipeline fill), a step with no generation beside it (stage/gen_s 0:
    the run's last) is a last step, the rest are steady."""
    for i, rec in enumerate(records):
        missing = [f"stage/{k}" for k in _ASYNC_KEYS if getattr(rec, k) is None]
        if missing:
            raise ConfigError(f"async telemetry record {i} (step {rec.step}) lacks {missing}; "
                              "give the metrics.jsonl of a `draftadapt demo async_lag=1` run")
        lag = rec.extra.get("async/trainer_version"), rec.extra.get("async/rollout_version")
        if None in lag:
            raise ConfigError(f"async telemetry record {i} (step {rec.step}) has no async/trainer_version "
                              "and async/rollout_version: not an asynchronous run (async_lag=0?)")
        if i and lag[0] - lag[1] != 1:
            raise ConfigError(f"async telemetry record {i}: rollouts {lag[0] - lag[1]:g} versions behind the "
                              "trainer; the shared-cores model covers async_lag=1 only")
    last = [i for i, r in enumerate(records) if i and r.gen_s == 0]
    steady = [i for i in range(1, len(records)) if i not in last]
    if len(steady) < 3:
        raise ConfigError(f"async telemetry has {len(steady)} steady step(s) (a generation beside the trainer, "
                          "not the first); the leave-one-out fit needs at least 3: run more steps")
    return steady, last


def fit_shared_cores(costs: dict[int, StageCosts], records: list[StepRecord], fit: list[int]) -> SharedCoresConfig:
    """Least squares on log(predicted / measured) of the steps ``fit`` (indices into records,
    each with its all-core costs in ``costs``): their overlapped generation, policy update and
    step times pin the two slowdowns and the boundary."""
    from scipy.optimize import least_squares

    def step(x: np.ndarray, i: int):
        return shared_async_step(costs[i], SharedCoresConfig(*x))

    def residuals(x: np.ndarray) -> np.ndarray:
        out = []
        for i in fit:
            p, rec = step(x, i), records[i]
            out += [math.log(p.gen_s / rec.gen_s), math.log(p.train_s / rec.train_s),
                    math.log(p.step_s / rec.rl_step_s)]
        return np.array(out)

    low = np.array([SHARED_BOUNDS[n][0] for n in SHARED_FREE])
    high = np.array([SHARED_BOUNDS[n][1] for n in SHARED_FREE])
    gen0 = float(np.median([records[i].gen_s / costs[i].gen_s for i in fit]))
    rest = float(np.median([records[i].rl_step_s - records[i].train_s - records[i].adapt_s
                            - records[i].exposed_gen_s for i in fit]))
    x0 = np.clip([gen0, 1.5, max(rest, 0.0)], low + 1e-9, high - 1e-9)
    sol = least_squares(residuals, x0, bounds=(low, high), xtol=1e-10, ftol=1e-10)
    cores = SharedCoresConfig(*(float(v) for v in sol.x))
    cores.validate()
    return cores


@dataclass
class DemoAsyncPrediction:
    """The demo's asynchronous step times, measured and predicted step by step."""

    source: str  # where the all-core stage costs come from: "async" (the run itself) or "sync"
    cores: SharedCoresConfig  # fitted on every steady step (the predictions use leave-one-out fits) or given
    fitted: bool  # False: ``cores`` came from another run, nothing here was fitted
    steps: list[int]  # telemetry step of each predicted step
    kinds: list[str]  # "first", "steady" or "last"
    measured: list[float]  # stage/rl_step_s
    predicted: list[float]

    def _mean(self, values: list[float], steady_only: bool) -> float:
        return float(np.mean([v for v, k in zip(values, self.kinds) if k == "steady" or not steady_only]))

    @property
    def run_measured_s(self) -> float:
        return self._mean(self.measured, False)

    @property
    def run_predicted_s(self) -> float:
        return self._mean(self.predicted, False)

    @property
    def steady_measured_s(self) -> float:
        return self._mean(self.measured, True)

    @property
    def steady_predicted_s(self) -> float:
        return self._mean(self.predicted, True)

    def summary(self) -> str:
        c = self.cores
        n = self.kinds.count("steady")
        how = f"fitted (all {n} steady steps)" if self.fitted else "given (fitted on another run)"
        loo = "each predicted by a fit on the others" if self.fitted else "none fitted"
        return "\n".join([
            f"demo async step from the {self.source} run's all-core stages: {how} "
            f"gen_slowdown {c.gen_slowdown:.3f}, train_slowdown {c.train_slowdown:.3f}, "
            f"boundary_s {c.boundary_s:.3f} (--demo-cores {c.gen_slowdown:.4g},{c.train_slowdown:.4g},{c.boundary_s:.4g})",
            f"  steady steps ({n}, {loo}): measured {self.steady_measured_s:.3f} s, "
            f"predicted {self.steady_predicted_s:.3f} s ({rel_err(self.steady_predicted_s, self.steady_measured_s):+.1%})",
            f"  whole run ({len(self.steps)} steps): measured {self.run_measured_s:.3f} s, "
            f"predicted {self.run_predicted_s:.3f} s ({rel_err(self.run_predicted_s, self.run_measured_s):+.1%})",
            "  per step (measured/predicted): " + " ".join(
                f"{s}{'f' if k == 'first' else 'l' if k == 'last' else ''}:{m:.2f}/{p:.2f}"
                for s, k, m, p in zip(self.steps, self.kinds, self.measured, self.predicted)),
        ])


def _sync_costs(sync: list[StepRecord], records: list[StepRecord], last: list[int]) -> dict[int, StageCosts]:
    """All-core costs of async step t from a sync run on the same world: its step t's policy
    update and adapter round, and its step t+1's generation (the prompts and seed the async step
    generates beside its trainer, there sampled one policy version older); the fill is its step
    0's generation (the very same rollouts)."""
    for i, rec in enumerate(sync):
        missing = [f"stage/{k}" for k in ("gen_s", "train_s", "adapt_s") if getattr(rec, k) is None]
        if missing or "async/trainer_version" in rec.extra:
            raise ConfigError(f"sync telemetry record {i}: " + (f"lacks {missing}" if missing else
                              "is from an asynchronous run") + "; give a `draftadapt demo` (async_lag=0) metrics.jsonl")
    # both runs train their first step on the same rollouts (policy 0, same prompts and seed)
    ours, theirs = records[0].extra.get("rl/reward"), sync[0].extra.get("rl/reward")
    if ours is not None and theirs is not None and abs(ours - theirs) > 1e-6:
        raise ConfigError(f"the sync run's first step has reward {theirs:.6g}, the async run's {ours:.6g}: not the "
                          "same world and seed; give the sync run made with the async run's toy, seed and settings")
    costs = {}
    for t in range(min(len(records), len(sync))):
        if t in last:
            costs[t] = StageCosts(0.0, sync[t].train_s, sync[t].adapt_s)
        elif t + 1 < len(sync):
            costs[t] = StageCosts(sync[t + 1].gen_s, sync[t].train_s, sync[t].adapt_s)
    return costs


def _async_costs(records: list[StepRecord], steady: list[int], last: list[int],
                 fit: list[int]) -> dict[int, StageCosts]:
    """All-core costs from the async run itself: the generation is the fill's (record 0's
    exposed generation: step 0's rollouts on every core, the trainer outlasting its overlapped
    generation as in every steady step), the policy update the final step's (nothing beside it),
    the adapter round the mean over ``fit``."""
    train = records[last[-1]].train_s if last else records[-1].train_s
    adapt = float(np.mean([records[i].adapt_s for i in fit]))
    costs = {i: StageCosts(records[0].exposed_gen_s, train, adapt) for i in [0] + steady}
    costs.update({i: StageCosts(0.0, records[i].train_s, records[i].adapt_s) for i in last})
    return costs


def predict_demo_async(records: list[StepRecord], sync: list[StepRecord] | None = None,
                       cores: SharedCoresConfig | None = None) -> DemoAsyncPrediction:
    """Each step of an async_lag=1 demo run predicted by the shared-cores model.

    The slowdowns and the boundary are fitted leave-one-out: a steady step is predicted by a
    fit on the other steady steps, the first and last steps by the fit on all of them. The
    all-core stage costs come from ``sync`` (a synchronous run on the same world: nothing the
    async run measured enters a prediction but through the fit on other steps) or, without it,
    from the async run's own all-core moments (the fill and the last step: their predictions
    then read their own stage times, so only the steady steps are predictions proper).
    ``cores``: slowdowns fitted on another run (with the same kind of all-core costs): no fit,
    every step predicted with them."""
    steady, last = demo_async_steps(records)
    if sync is not None:
        paired = _sync_costs(sync, records, last)
        fill = sync[0].gen_s
        missing = [records[i].step for i in steady if i not in paired]
        steady, last = [i for i in steady if i in paired], [i for i in last if i in paired]
        if len(steady) < 3:
            raise ConfigError(f"the sync telemetry pairs {len(steady)} steady async step(s) (async steps "
                              f"{missing} have no sync step t+1); the fit needs 3: give a sync run as long as the async one")
    else:
        fill = records[0].exposed_gen_s

    def costs(fit: list[int]) -> dict[int, StageCosts]:
        return paired if sync is not None else _async_costs(records, steady, last, fit)

    everyone = cores or fit_shared_cores(costs(steady), records, steady)
    order = ([0] if 0 in costs(steady) else []) + steady + last
    kinds, predicted = [], []
    for i in order:
        if i in steady:
            others = [j for j in steady if j != i]
            fit = cores or fit_shared_cores(costs(others), records, others)
            step = shared_async_step(costs(others)[i], fit)
        else:
            step = shared_async_step(costs(steady)[i], everyone, fill if i == 0 else 0.0)
        kinds.append("steady" if i in steady else "first" if i == 0 else "last")
        predicted.append(step.step_s)
    return DemoAsyncPrediction(
        source="sync" if sync is not None else "async", cores=everyone, fitted=cores is None,
        steps=[records[i].step if records[i].step is not None else i for i in order], kinds=kinds,
        measured=[records[i].rl_step_s for i in order], predicted=predicted)
