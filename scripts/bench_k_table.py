"""Does a k drafted from a k_max engine's k table cost what an engine started at that k costs?

    .venv/bin/python scripts/bench_k_table.py --toy DIR --draft DIR [--k 3] [--k-max 5] \
        [--batch-sizes 8,32] [--rounds 3] [--max-tokens 96]

Online k (docs/design.md "Online k") starts one engine at k_max and changes its per-batch-size
table; the cost model it uses assumes a k drafted that way costs what a fixed-k engine's step
costs. Two engines on the same target and draft: one started at --k, one at --k-max whose table
says --k at every batch size (then --k-max, and 0, for reference), and a plain engine (what k = 0
in a speculative engine is compared with: its drafter's first pass still runs). Per batch size the arms take
turns, --rounds times; the fastest round of each is kept. Prints one JSON object: effective ms
per step (b * acceptance length / tokens/s) and acceptance length per arm and batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--toy", required=True, help="the target (a toy world's toy/ dir)")
    ap.add_argument("--draft", required=True, help="an Eagle-3 draft for it")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not 1 <= args.k <= args.k_max:
        raise SystemExit(f"error: need 1 <= --k <= --k-max (got {args.k}, {args.k_max})")
    bss = [int(b) for b in args.batch_sizes.split(",") if b.strip()]

    from tqdm import tqdm

    from draftadapt.engine.rollout import RolloutEngine
    from draftadapt.metrics.kcost import step_seconds
    from draftadapt.toy import task

    pool = [p["prompt"] for p in task.load_heldout(Path(args.toy))]
    prompts = [pool[i % len(pool)] for i in range(max(bss))]
    fixed = RolloutEngine(args.toy, args.draft, num_speculative_tokens=args.k, threads=args.threads)
    table = RolloutEngine(args.toy, args.draft, num_speculative_tokens=args.k_max, threads=args.threads,
                          k_schedule=[(1, 64, args.k)])
    plain = RolloutEngine(args.toy, None, threads=args.threads)
    arms = {"plain": (plain, None), f"fixed_k{args.k}": (fixed, None), f"table_k{args.k}_of_{args.k_max}": (table, args.k),
            f"table_k{args.k_max}_of_{args.k_max}": (table, args.k_max), f"table_k0_of_{args.k_max}": (table, 0)}
    best: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        for b in bss:
            for _ in tqdm(range(args.rounds), desc=f"{b} sequences", unit="round", file=sys.stderr):
                for name, (engine, k) in arms.items():
                    if k is not None:
                        engine.set_k_schedule([(1, 64, k)])
                    res = engine.generate(prompts[:b], max_tokens=args.max_tokens, seed=0)
                    length = res.acceptance.length if res.acceptance.drafts else 1.0
                    ms = 1e3 * step_seconds(b, res.tokens_per_s, length)
                    if (name, b) not in best or ms < best[(name, b)][0]:
                        best[(name, b)] = (ms, length)
    finally:
        for engine in (fixed, table, plain):
            engine.close()
    out = {name: {str(b): {"step_ms": round(best[(name, b)][0], 3), "acceptance_length": round(best[(name, b)][1], 4)}
                  for b in bss} for name in arms}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
