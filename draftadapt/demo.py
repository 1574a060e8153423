"""``draftadapt demo``: the RL loop (draftadapt/rl/loop.py) on the world ``world=`` names.

    draftadapt demo --out runs/demo                         # the toy world (default)
    draftadapt demo --out runs/smol world=smollm2           # SmolLM2-135M-Instruct, word problems

The loop takes any world (draftadapt/rl/world.py); this module is the one place that knows them
all, so nothing under rl/ imports a world.
"""

from __future__ import annotations

import json
import signal
import sys

from draftadapt.config import load_config
from draftadapt.rl.config import DemoConfig
from draftadapt.rl.summary import load_baseline, load_sync


def make_world(name: str):
    """The world ``name`` (DemoConfig.world) as the loop takes it."""
    if name == "toy":
        from draftadapt.toy.world import ToyRL

        return ToyRL()
    if name == "smollm2":
        from draftadapt.smollm2.world import SmolLM2

        return SmolLM2()
    raise ValueError(f"world={name}: give toy or smollm2")  # DemoConfig's Literal refuses it first


def demo_cli(overrides: list[str]) -> int:
    """``draftadapt demo``: ``overrides`` are DemoConfig's ``key=value`` (the command's flags
    arrive as their fields: --steps as grpo.steps). A bad key or baseline= raises ConfigError
    before anything starts."""
    cfg = load_config(DemoConfig, None, overrides)
    if cfg.baseline:
        load_baseline(cfg.baseline)
    if cfg.sync:
        load_sync(cfg.sync)
    # SIGTERM (a scheduler's kill, `kill PID`) unwinds like Ctrl-C, so run()'s finally closes the
    # vLLM engines: otherwise their EngineCore/Worker processes outlive us and keep polling a core.
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from draftadapt.rl.loop import run

    summary = run(cfg, make_world(cfg.world))
    e = summary["end_to_end"]
    line = {"world": cfg.world, "steps": summary["steps"], "seconds": round(summary["seconds"], 1),
            "total_seconds": round(summary["total_seconds"], 1), "spec": cfg.spec,
            **{k: round(v, 3) for k, v in summary.get("last_third", {}).items()},
            **{f"whole_run_{k}": round(v, 3) if isinstance(v, float) else v
               for k, v in summary.get("whole_run", {}).items()
               if k in ("adapted_over_frozen", "adapted_worst_over_start", "adapted_retention", "first_publish_step")},
            "rl_step_s": round(e["rl_step_s"], 2), "adapt_share": round(e["adapt_share"], 4),
            "gen_share": round(e["gen_share"], 3)}
    if "rl_batch_arms" in summary:
        line["rl_batch_adapted_over_plain_tokens_per_s"] = round(summary["rl_batch_arms"]["adapted_over_plain_tokens_per_s"], 3)
    if "vs_baseline" in summary:
        line.update({k: round(v, 3) for k, v in summary["vs_baseline"].items() if k != "baseline_rl_step_s"})
    if "async" in summary:
        a = summary["async"]
        line["async"] = {k: round(a[k], 3) for k in ("lag", "exposed_gen_s", "step_s", "overlap")}
        if "sync" in a:
            line["async"].update(sync_step_s=round(a["sync"]["step_s"], 3), speedup_over_sync=round(a["speedup_over_sync"], 3))
    line["out"] = cfg.out
    print(json.dumps(line))
    return 0

