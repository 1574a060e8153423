"""``draftadapt simulate RECIPE [key=value ...] [--json] [--plot PNG]``.

    draftadapt simulate recipes/sim_qwen3_8b_sync.yaml
    draftadapt simulate recipes/sim_qwen3_235b_async.yaml spec.accept_length=3.5 --plot out.png
    draftadapt simulate recipes/sim_qwen3_8b_think_sync.yaml calibration.telemetry=run/telemetry.jsonl

prints the step-time table per pipeline and configuration, each published figure beside
its projection, and (with adaptation on) what adapting now would gain. With
calibration.telemetry set it first fits the recipe's free parameters to that run and
prints the fit and its error.
"""

from __future__ import annotations

import json
import sys

from draftadapt.config import ConfigError, load_config, to_dict
from draftadapt.sim.calibrate import FITTED_STAGES, calibrate
from draftadapt.sim.config import SimConfig
from draftadapt.sim.costbenefit import adapt_gain, step_time_fn
from draftadapt.sim.model import decayed_length, simulate
from draftadapt.sim.report import ceiling_check, compare, format_comparisons, format_table
from draftadapt.sim.telemetry import TelemetryError, read_telemetry


def _adapt_line(cfg: SimConfig) -> tuple[str, dict] | None:
    """What adapting gains when the frozen draft has drifted for every_steps steps."""
    s, a = cfg.spec, cfg.adapt
    if not a.enabled or s.k == 0:
        return None
    fresh = a.accept_length if a.accept_length is not None else s.accept_length
    current = decayed_length(s.accept_length, s.k, s.drift_per_step, a.every_steps, s.accept_floor)
    cost = a.train_s * a.exposed_frac + a.swap_ms * 1e-3
    d = adapt_gain(current, s.drift_per_step, cost, restored_accept=fresh, k=s.k,
                   step_time=step_time_fn(cfg), horizon_steps=a.horizon_steps,
                   accept_floor=s.accept_floor)
    when = f"pays back after {d.break_even_steps} steps" if d.break_even_steps else "does not pay back"
    line = (f"adapting at acceptance {current:.2f} (after {a.every_steps} steps of drift "
            f"{s.drift_per_step:g}/step) back to {fresh:.2f}, cost {cost:.2f} s on the critical path: "
            f"{d.gain_s:+.1f} s over {d.horizon_steps} steps, {when}")
    return line, {"current_accept": current, "restored_accept": fresh, "cost_s": cost,
                  "gain_s": d.gain_s, "adapt_now": d.adapt_now, "break_even_steps": d.break_even_steps}


def run(recipe: str, overrides: list[str], json_out: bool = False, plot: str | None = None) -> int:
    fit = None
    try:
        cfg = load_config(SimConfig, recipe, overrides)
        if cfg.calibration.telemetry:
            records = read_telemetry(cfg.calibration.telemetry)
            fit = calibrate(cfg, records, cfg.calibration.free)
            cfg = fit.config
            # published variants are re-read from the recipe: they get the fitted values too
            overrides = list(overrides) + [f"{k}={v!r}" for k, v in fit.params.items()]
        result = simulate(cfg)
        comparisons = compare(recipe, overrides, cfg, result)
        adapt = _adapt_line(cfg)
    except (ConfigError, TelemetryError) as exc:
        print(f"draftadapt simulate: {exc}", file=sys.stderr)
        return 2
    if plot:
        from draftadapt.sim.plot import plot as write_png

        write_png(result, plot, comparisons)
    gated = [c for c in comparisons if c.gated]
    off = [c for c in gated if not c.ok]
    if json_out:
        print(json.dumps({
            "recipe": recipe,
            "overrides": overrides,
            **result.to_dict(),
            "published": [c.to_dict() for c in comparisons],
            "adapt_decision": adapt[1] if adapt else None,
            "calibration": None if fit is None else {
                "params": fit.params, "start": fit.start, "rms_rel_err": fit.rms(),
                "max_abs_rel_err": fit.max_abs_err,
                "rms_rel_err_by_stage": {s: fit.rms(s) for s in FITTED_STAGES
                                         if any(r.stage == s for r in fit.residuals)},
            },
            "assumptions": cfg.assumptions,
            "config": to_dict(cfg),
        }, indent=1))
        return 0
    if fit is not None:
        print(f"calibrated to {cfg.calibration.telemetry}")
        print(fit.summary())
    print(format_table(cfg, result))
    for line in ceiling_check(result):
        print(f"WARNING: {line}")
    if adapt:
        print(adapt[0])
    if comparisons:
        print(format_comparisons(comparisons))
    if cfg.assumptions:
        print("assumptions (not published):")
        for line in cfg.assumptions:
            print(f"  - {line}")
    if plot:
        print(f"wrote {plot}")
    if gated:
        print(f"{len(gated) - len(off)}/{len(gated)} gated published figures within tolerance")
    return 0
