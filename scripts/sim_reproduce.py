"""Reproduce the paper's published figures with the RL step simulator.

    python scripts/sim_reproduce.py            # every recipes/sim_*.yaml
    python scripts/sim_reproduce.py --refit    # also redo the 8B calibration behind the recipes

prints, per recipe, each projected figure beside the published one with the relative error,
then one summary line; exits 1 if a gated figure is off by more than its tolerance (10%; 15% for
the k=5/7 and n-gram rows).
Figures marked "fitted" were used to calibrate the recipe; the rest are predictions.

The demo's asynchronous step (issue 18; docs/design.md "Simulator: asynchronous steps",
"The demo's step on shared cores")
is gated beside them at 15%: the shared-cores model fitted to recipes/demo_async_telemetry.jsonl
(a `draftadapt demo async_lag=1` run's metrics.jsonl) predicts its mean step time, and from the
stages of a synchronous run on the same world too when recipes/demo_sync_telemetry.jsonl exists.
Another run's telemetry:

    python scripts/sim_reproduce.py --demo-async RUN/metrics.jsonl [--demo-sync SYNC_RUN/metrics.jsonl]
        [--demo-cores G,T,B]    # slowdowns fitted on another run: a prediction with nothing fitted

    python scripts/sim_reproduce.py --write-sample recipes/sim_telemetry_sample.jsonl

regenerates the telemetry sample (synthetic: the model's own output for the RL-Think recipe
with drift, adaptation every 5 steps and 2% noise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from tqdm import tqdm  # noqa: E402

from draftadapt.config import ConfigError, load_config  # noqa: E402
from draftadapt.sim.config import SimConfig  # noqa: E402
from draftadapt.sim.model import simulate  # noqa: E402
from draftadapt.sim.report import Comparison, compare  # noqa: E402
from draftadapt.sim.telemetry import TelemetryError  # noqa: E402

DEMO_ASYNC = ROOT / "recipes" / "demo_async_telemetry.jsonl"
DEMO_SYNC = ROOT / "recipes" / "demo_sync_telemetry.jsonl"


def reproduce(recipes: list[Path]) -> list[tuple[str, object]]:
    rows = []
    for path in tqdm(recipes, desc="recipes", file=sys.stderr):
        cfg = load_config(SimConfig, path)
        result = simulate(cfg, sweep=False)
        rows.extend((path.name, c) for c in compare(str(path), [], cfg, result))
    return rows


def demo_async(async_path: Path, sync_path: Path | None, cores: str | None = None) -> list[tuple[str, Comparison]]:
    """The demo's measured async step times beside the shared-cores model's predictions: the
    steady steps' mean and the whole run's, from the run's own all-core stages and (with
    ``sync_path``) from the sync run's; ``cores`` ("gen_slowdown,train_slowdown,boundary_s",
    fitted on another run from the same kind of stages) replaces the fit."""
    from draftadapt.sim.calibrate import predict_demo_async
    from draftadapt.sim.config import SharedCoresConfig
    from draftadapt.sim.telemetry import read_telemetry

    given = None
    if cores:
        try:
            values = [float(v) for v in cores.split(",")]
            if len(values) != 3:
                raise ValueError(cores)
            given = SharedCoresConfig(*values)
        except ValueError:
            raise ConfigError(f"--demo-cores {cores!r}: give gen_slowdown,train_slowdown,boundary_s "
                          "(three numbers, as the fit prints them)") from None
        given.validate()
    records = read_telemetry(async_path)
    fits = []
    if sync_path is not None:
        fits.append((predict_demo_async(records, read_telemetry(sync_path), cores=given), "sync costs: "))
    if given is None or sync_path is None:
        fits.insert(0, (predict_demo_async(records, cores=given), ""))
    rows = []
    for fit, prefix in fits:
        print(fit.summary())
        own = "" if fit.source == "sync" else (
            "; the first and last steps' predictions read their own all-core stages (the fill, the "
            "last policy update)")
        for variant, measured, predicted, note in (
            ("steady steps" + (", leave-one-out" if fit.fitted else ", given slowdowns"), fit.steady_measured_s, fit.steady_predicted_s,
             "each steady step predicted by a fit on the others" if fit.fitted
             else "slowdowns fitted on another run: nothing fitted here"),
            ("whole run", fit.run_measured_s, fit.run_predicted_s, "the mean the demo reports" + own),
        ):
            rows.append((async_path.name, Comparison(
                figure="demo.async.step_s", published=measured, projected=predicted, source=str(async_path),
                overrides=[prefix + variant], gated=True, calibrated=False, tolerance=0.15, note=note)))
    return rows


def refit() -> None:
    from sim_paper import (  # beside this script
        ASYNC_RECIPE, THINK_RECIPE, ZERO_RECIPE, fit_async, fit_fallback, fit_ngram, fit_think, fit_zero,
    )
    from draftadapt.sim.calibrate import get_param

    think = fit_think()
    zero = fit_zero(think.params["engine.draft_overhead_ms"])
    for name, fit, recipe in (("RL-Think", think, THINK_RECIPE), ("RL-Zero", zero, ZERO_RECIPE)):
        held = load_config(SimConfig, recipe)
        print(f"{name} fit on {fit.residuals and len({r.record for r in fit.residuals})} paper row(s)")
        print(fit.summary())
        for param, value in fit.params.items():
            print(f"  {param:32s} fitted {value:.4g}   recipe {get_param(held, param):.4g}")
    think_cfg = load_config(SimConfig, THINK_RECIPE)
    print("speculative step costs (RL-Think engine): n-gram fit on RL-Think's n-gram row, "
          "the k>3 verify on the four k=5/7 rows")
    for param, value in (("engine.ngram_ns_per_token", fit_ngram()),
                         ("engine.fallback_ns_per_ctx", fit_fallback())):
        print(f"  {param:32s} fitted {value:.4g}   recipe {get_param(think_cfg, param):.4g}")
    async_cfg = load_config(SimConfig, ASYNC_RECIPE)
    print("8B async tail, fit on exposed generation 10.4 s")
    for param, value in fit_async().items():
        print(f"  {param:32s} fitted {value:.4g}   recipe {get_param(async_cfg, param):.4g}")


def write_sample(path: Path) -> None:
    from draftadapt.sim.calibrate import synthetic_telemetry
    from draftadapt.sim.telemetry import to_json

    cfg = load_config(SimConfig, ROOT / "recipes" / "sim_qwen3_8b_think_sync.yaml",
                      ["spec.drift_per_step=0.02", "spec.accept_floor=2.4", "adapt.train_s=12",
                       "published=[]"])
    records = synthetic_telemetry(cfg, 16, adapt_every=5, noise=0.02, seed=0)
    path.write_text("".join(json.dumps(to_json(r)) + "\n" for r in records))
    print(f"wrote {len(records)} steps to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", type=Path, help="default: recipes/sim_*.yaml")
    parser.add_argument("--refit", action="store_true", help="redo the 8B calibration and compare")
    parser.add_argument("--write-sample", type=Path, default=None, metavar="JSONL")
    parser.add_argument("--demo-async", type=Path, default=None, metavar="JSONL",
                        help=f"an async_lag=1 demo run's metrics.jsonl (default with no recipes: {DEMO_ASYNC.name})")
    parser.add_argument("--demo-sync", type=Path, default=None, metavar="JSONL",
                        help=f"a sync demo run's metrics.jsonl on the same world (default: {DEMO_SYNC.name} if present)")
    parser.add_argument("--demo-cores", default=None, metavar="G,T,B",
                        help="slowdowns fitted on another run (as its fit prints them): predict, do not fit")
    args = parser.parse_args()
    if args.write_sample:
        write_sample(args.write_sample)
        return 0
    if args.refit:
        refit()
    recipes = args.recipes or sorted((ROOT / "recipes").glob("sim_*.yaml"))
    rows = reproduce(recipes)
    if args.demo_async or not args.recipes:
        sync = args.demo_sync or (DEMO_SYNC if DEMO_SYNC.is_file() and not args.demo_async else None)
        try:
            rows += demo_async(args.demo_async or DEMO_ASYNC, sync, args.demo_cores)
        except (ConfigError, TelemetryError) as exc:
            print(f"sim_reproduce: demo async step: {exc}", file=sys.stderr)
            return 2
    print(f"{'recipe':30s} {'figure':28s} {'variant':36s} {'projected':>9s} {'published':>9s} "
          f"{'error':>7s}  status")
    gated = off = 0
    for recipe, c in rows:
        variant = " ".join(c.overrides) or "-"
        if len(variant) > 36:
            variant = variant[:33] + "..."
        if c.gated:
            gated += 1
            off += not c.ok
            status = "ok" if c.ok else "OFF"
        else:
            status = "not gated"
        status += " (fitted)" if c.calibrated else ""
        print(f"{recipe:30s} {c.figure:28s} {variant:36s} {c.projected:9.4g} {c.published:9.4g} "
              f"{c.rel_err:+7.1%}  {status}")
    if any(c.figure.startswith("demo.") for _, c in rows):
        print("demo.* rows: 'published' is the run's measured mean step time (stage/rl_step_s)")
    predicted = [c for _, c in rows if c.gated and not c.calibrated]
    worst = max((abs(c.rel_err) for c in predicted), default=0.0)
    print(f"{gated - off}/{gated} gated figures within tolerance ({len(predicted)} predicted, "
          f"{gated - len(predicted)} fitted; worst predicted error {worst:.1%}); "
          f"{len(rows) - gated} not gated, see the recipes' notes")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
