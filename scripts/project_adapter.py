"""Project a demo run's adapter onto the paper's cluster settings: what it would cost and give there.

    python scripts/project_adapter.py --run runs/demo [--recipe recipes/sim_qwen3_8b_sync.yaml ...] [--json]

Reads the run's ``summary.json`` (a finished ``draftadapt demo``) and calibrates three things
from it:

- the adapter's seconds per RL step relative to the policy update's (``end_to_end``), which
  moves to another model in proportion to the draft's size next to the policy's (the same
  schedule trains the same share of each step's tokens with the same TTT depth, so the rest of
  the ratio carries over); the head's kernels are assumed to run at ``--head-efficiency`` of
  the policy's utilisation (small GEMMs do worse on a GPU);
- acceptance: the adapted draft is taken to hold the recipe's published in-domain acceptance
  (the run's adapted/fresh ratio, capped at 1: no credit for beating a fresh draft), and the
  frozen draft to fall from it by the run's measured adapted/frozen ratio over the last third
  (the toy's drift is a whole change of answer style: a strong drift);
- nothing else: the generation and update times at scale come from the simulator's recipe
  (``draftadapt simulate``), and on a colocated synchronous cluster the adapter sits on the
  critical path (no overlap assumed), in an asynchronous one on the trainer side.

Prints one row per recipe and pipeline mode: the RL step with no speculation, with the frozen
draft, and with the adapted draft plus the adapter's seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_RECIPES = ("recipes/sim_qwen3_8b_sync.yaml", "recipes/sim_qwen3_235b_async.yaml")


def size_ratio(target: "Arch", draft_vocab: int, head_intermediate: int | None = None) -> float:  # noqa: F821
    """Eagle-3 head parameters per policy parameter a token goes through (matmul FLOPs ratio)."""
    from draftadapt.sim.hardware import eagle3_params

    return eagle3_params(target, draft_vocab, head_intermediate) / target.active_params


def toy_arch(policy_dir: Path):
    """The run's target as a simulator Arch (from its HF config.json)."""
    from draftadapt.sim.hardware import Arch

    c = json.loads((policy_dir / "config.json").read_text())
    heads = c["num_attention_heads"]
    return Arch(name="toy", layers=c["num_hidden_layers"], hidden=c["hidden_size"], q_heads=heads,
                kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                intermediate=c["intermediate_size"], vocab=c["vocab_size"])


def calibration(run: Path) -> dict:
    """What the projection takes from the run (errors name the missing piece)."""
    f = run / "summary.json"
    if not f.is_file():
        raise SystemExit(f"error: {f} not found; pass --run the OUT of a finished `draftadapt demo` (spec=true)")
    s = json.loads(f.read_text())
    e2e, third = s.get("end_to_end"), s.get("last_third")
    if not s.get("spec", True) or not e2e or not third or not e2e.get("adapt_s"):
        raise SystemExit(f"error: {run} is not a finished draftadapt run (spec=false, or no adapter time)")
    import yaml

    used = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    draft_dir = Path(used.get("draft") or run / "draft0")
    draft_meta = json.loads((draft_dir / "config.json").read_text()) if (draft_dir / "config.json").is_file() else {}
    toy = toy_arch(run / "final_policy")  # the policy the run ended with: the target's shape
    head_inter = (draft_meta.get("transformer_layer_config") or {}).get("intermediate_size") or draft_meta.get("intermediate_size")
    draft_vocab = draft_meta.get("draft_vocab_size") or toy.vocab
    return {
        "adapt_over_update": e2e["adapt_s"] / e2e["train_s"],
        "adapted_over_frozen": third["adapted_over_frozen_acceptance"],
        "adapted_over_fresh": third["adapted_over_fresh_final_acceptance"],
        "toy_gen_share": e2e["gen_share"],
        "toy_size_ratio": size_ratio(toy, int(draft_vocab), head_inter),
    }


def project(cal: dict, recipe: str, head_efficiency: float) -> list[dict]:
    from draftadapt.config import load_config
    from draftadapt.sim.config import SimConfig
    from draftadapt.sim.hardware import MODELS
    from draftadapt.sim.model import learner_times, simulate_step

    cfg = load_config(SimConfig, recipe, [])
    arch = MODELS[cfg.target.model]
    big_ratio = size_ratio(arch, cfg.spec.draft_vocab)
    lt = learner_times(cfg)
    update_s = lt.logprob_s + lt.train_s
    adapt_s = cal["adapt_over_update"] * (big_ratio / cal["toy_size_ratio"]) / head_efficiency * update_s
    adapted = cfg.spec.accept_length * min(1.0, cal["adapted_over_fresh"])
    frozen = max(1.0, adapted / cal["adapted_over_frozen"])
    rows = []
    for mode in cfg.pipeline.modes:
        plain = simulate_step(cfg, mode, None)
        fro = simulate_step(cfg, mode, frozen)
        ada = simulate_step(cfg, mode, adapted, adapt_s=adapt_s)
        rows.append({
            "recipe": recipe, "mode": mode, "model": cfg.target.model,
            "head_size_ratio": big_ratio, "update_s": update_s, "adapter_s": adapt_s,
            "accept_frozen": frozen, "accept_adapted": adapted,
            "step_plain_s": plain.step_s, "step_frozen_s": fro.step_s, "step_adapted_s": ada.step_s,
            "adapter_share": adapt_s / ada.step_s,
            "speedup_adapted": plain.step_s / ada.step_s, "speedup_frozen": plain.step_s / fro.step_s,
            "gen_share_plain": plain.gen_share,
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="OUT of a finished `draftadapt demo` (spec=true)")
    ap.add_argument("--recipe", action="append", default=None, help=f"simulator recipes (default: {', '.join(DEFAULT_RECIPES)})")
    ap.add_argument("--head-efficiency", type=float, default=0.5,
                    help="the head's GPU utilisation relative to the policy update's (assumption; default 0.5)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 0 < args.head_efficiency <= 1:
        print("error: --head-efficiency must be in (0, 1]", file=sys.stderr)
        return 2
    cal = calibration(args.run)
    rows = [r for recipe in (args.recipe or DEFAULT_RECIPES) for r in project(cal, recipe, args.head_efficiency)]
    if args.json:
        print(json.dumps({"calibration": cal, "head_efficiency": args.head_efficiency, "rows": rows}))
        return 0
    print(f"calibrated on {args.run}: adapter/update {cal['adapt_over_update']:.3f} at a head {cal['toy_size_ratio']:.3f}x "
          f"the policy; adapted/frozen {cal['adapted_over_frozen']:.3f}, adapted/fresh {cal['adapted_over_fresh']:.3f}; "
          f"generation {cal['toy_gen_share']:.0%} of the toy's step")
    print(f"{'setting':34s} | head/policy | accept frozen -> adapted | step: no spec | frozen | adapted + adapter | adapter | vs no spec")
    for r in rows:
        name = f"{r['model']} {r['mode']}"
        print(f"{name:34s} | {r['head_size_ratio']:11.4f} | {r['accept_frozen']:6.2f} -> {r['accept_adapted']:4.2f}        | "
              f"{r['step_plain_s']:11.1f} s | {r['step_frozen_s']:6.1f} | {r['step_adapted_s']:17.1f} | "
              f"{r['adapter_s']:5.2f} s ({r['adapter_share']:.1%}) | {r['speedup_adapted']:.2f}x (frozen {r['speedup_frozen']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
