"""What does a k drafted from a k_max engine's k table cost, against a fixed-k engine and a plain one?

    .venv/bin/python scripts/bench_k_table.py --target DIR --draft DIR [--world toy|smollm2] \
        [--k 3] [--k-max 5] [--batch-sizes 8,32] [--rounds 3] [--max-tokens 96] [--arms a,b,...] \
        [--precision auto|bf16|fp32] [--json]

Online k (docs/design.md "Online k") starts one engine at k_max and changes its per-batch-size
table; the cost model it uses assumes a k drafted that way costs what a fixed-k engine's step
costs. Engines on the same target and draft: one started at --k, one at --k-max whose table says
--k at every batch size (then --k-max, and 0), and a plain engine. k = 0 is measured twice: with
vLLM's own behaviour (its drafter's first pass still runs, ``table_k0_of_K``) and with the drafter
idle, as draftadapt serves a table of zeros (``table_k0_idle_of_K``; docs/design.md, "Stepping
aside"). Per batch size the arms take turns, --rounds times; the fastest round of each is kept.
Prints one JSON object: effective ms per step (b * acceptance length / tokens/s), acceptance
length, and the ratio to the plain arm's step, per arm and batch size.

The engines share one process, and the order they start in shows in their steps: on SmolLM2
(2-core AMD EPYC, cProfile) every kernel of the engine started first ran up to ~15% slower than
the same kernel in the one started after it, whichever kind it was. By default the speculative
engines start first (the order this script always had); ``--plain-first`` starts the plain one
first. Run both and quote both: the truth lies between them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def arm_table(k: int, k_max: int) -> dict[str, tuple[str, int | None, bool]]:
    """Arm name -> (engine, k written into its table or None, drafter idles at k = 0)."""
    return {"plain": ("plain", None, False), f"fixed_k{k}": ("fixed", None, False),
            f"table_k{k}_of_{k_max}": ("table", k, False), f"table_k{k_max}_of_{k_max}": ("table", k_max, False),
            f"table_k0_of_{k_max}": ("table", 0, False), f"table_k0_idle_of_{k_max}": ("table", 0, True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", "--toy", dest="target", required=True, help="the target model dir (a toy world's toy/ dir, "
                    "or `draftadapt smollm2 build`'s)")
    ap.add_argument("--draft", required=True, help="an Eagle-3 draft for it")
    ap.add_argument("--world", choices=["toy", "smollm2"], default="toy", help="whose held-out prompts to generate from")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="", help="comma-separated arm names (default: all; plain is always kept)")
    ap.add_argument("--plain-first", action="store_true", help="start the plain engine before the speculative ones "
                    "(the engine started first measures slower in this process; run both orders)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="the engines' weights, as the demo's engine_precision (auto: bf16 on a CPU with AMX-BF16 "
                         "or avx512_bf16 for a target at least 512 wide, else the target's dtype)")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args()
    if not 1 <= args.k <= args.k_max:
        raise SystemExit(f"error: need 1 <= --k <= --k-max (got {args.k}, {args.k_max})")
    bss = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    table = arm_table(args.k, args.k_max)
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(wanted) - set(table))
    if unknown:
        raise SystemExit(f"error: --arms {unknown} unknown; choose from {sorted(table)}")
    arms = {name: spec for name, spec in table.items() if not wanted or name in wanted or name == "plain"}

    from tqdm import tqdm

    from draftadapt.demo import make_world
    from draftadapt.engine.rollout import RolloutEngine
    from draftadapt.metrics.kcost import step_seconds
    from draftadapt.precision import engine_dtype

    pool = make_world(args.world).heldout_prompts(Path(args.target), max(bss))
    if not pool:
        raise SystemExit(f"error: {args.target} has no held-out prompts for world={args.world}")
    prompts = [pool[i % len(pool)] for i in range(max(bss))]
    kinds = {kind for kind, _, _ in arms.values()}
    max_seqs = max(64, max(bss))
    dtype = engine_dtype(args.precision, args.target)
    engines = {}
    try:
        if args.plain_first:
            engines["plain"] = RolloutEngine(args.target, None, threads=args.threads, max_num_seqs=max_seqs, dtype=dtype)
        if "fixed" in kinds:
            engines["fixed"] = RolloutEngine(args.target, args.draft, num_speculative_tokens=args.k,
                                             threads=args.threads, max_num_seqs=max_seqs, dtype=dtype)
        if "table" in kinds:
            engines["table"] = RolloutEngine(args.target, args.draft, num_speculative_tokens=args.k_max,
                                             threads=args.threads, max_num_seqs=max_seqs, dtype=dtype,
                                             k_schedule=[(1, max_seqs, args.k)])
        if not args.plain_first:
            engines["plain"] = RolloutEngine(args.target, None, threads=args.threads, max_num_seqs=max_seqs, dtype=dtype)
        best: dict[tuple[str, int], tuple[float, float]] = {}
        for b in bss:
            for _ in tqdm(range(args.rounds), desc=f"{b} sequences", unit="round", file=sys.stderr):
                for name, (kind, k, idle) in arms.items():
                    engine = engines[kind]
                    if k is not None:
                        engine.set_k_schedule([(1, max_seqs, k)], idle_drafter=idle)
                    res = engine.generate(prompts[:b], max_tokens=args.max_tokens, seed=0)
                    length = res.acceptance.length if res.acceptance.drafts else 1.0
                    ms = 1e3 * step_seconds(b, res.tokens_per_s, length)
                    if (name, b) not in best or ms < best[(name, b)][0]:
                        best[(name, b)] = (ms, length)
    finally:
        for engine in engines.values():
            engine.close()
    out = {name: {str(b): {"step_ms": round(best[(name, b)][0], 3), "acceptance_length": round(best[(name, b)][1], 4),
                           "over_plain": round(best[(name, b)][0] / best[("plain", b)][0], 4)}
                  for b in bss} for name in arms}
    if not args.json:
        for name in arms:
            print(f"{name:24s} " + "  ".join(f"b={b}: {out[name][str(b)]['step_ms']:8.2f} ms "
                                              f"({out[name][str(b)]['over_plain']:.3f}x plain)" for b in bss),
                  file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
