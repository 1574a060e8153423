"""Draft length k after a demo: acceptance and tokens/s per k for the frozen, adapted and fresh drafts.

    .venv/bin/python scripts/bench_k.py --run DIR [--ks 3,4,5] [--prompts 32] [--rounds 5] [--json]

DIR is a finished `draftadapt demo --out DIR`. On its final policy, one engine per k serves the
drafts in turn (in-place swaps): the frozen pretrained draft (draft0), the newest adapted version
(drafts/LATEST) and, when the demo made one, the draft pretrained fresh on the final policy. The
plain engine is measured in the same rounds, arms interleaved, so each ratio comes from one run.

Why: longer drafts accept more and can run slower (the paper's k table, arXiv 2604.26779), and
on a small CPU target the draft's k sequential forwards are not cheap next to the target's
verify pass. The acceptance ratio adapted/frozen grows with k; whether tokens/s follows is what
this measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm


def run_drafts(run: Path):
    """The demo's config (its DemoConfig, as the run saved it) and its drafts by arm."""
    from draftadapt.config import load_config
    from draftadapt.data.store import DraftStore
    from draftadapt.rl.config import DemoConfig

    cfg_file = run / "config.yaml"
    if not cfg_file.is_file():
        raise SystemExit(f"error: {cfg_file} not found: --run takes the --out DIR of a finished `draftadapt demo`")
    cfg = load_config(DemoConfig, cfg_file)
    if not (run / "final_policy" / "config.json").is_file():
        raise SystemExit(f"error: {run / 'final_policy'} is missing: the demo did not finish; rerun it")
    latest = DraftStore(run / "drafts", readonly=True).latest()
    if latest is None:
        raise SystemExit(f"error: no complete draft version under {run / 'drafts'}")
    drafts = {"frozen": Path(cfg.draft or run / "draft0"), "adapted": latest.path}
    if (run / "draft_fresh_final" / "draftadapt.json").is_file():
        drafts["fresh"] = run / "draft_fresh_final"
    return cfg, drafts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a finished demo's --out DIR")
    ap.add_argument("--ks", default="3,4,5", help="comma-separated draft lengths")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts per generate (the demo's eval uses 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="response budget (default: the demo's eval budget, 96)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds; every arm once a round")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args()
    try:
        ks = [int(x) for x in args.ks.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --ks takes integers like 3,4,5 (got {args.ks!r})") from None
    if not ks or min(ks) < 1:
        raise SystemExit(f"error: --ks needs draft lengths >= 1 (got {args.ks!r})")

    import torch

    from draftadapt.engine.rollout import RolloutEngine
    from draftadapt.toy import arms as demo_arms
    from draftadapt.toy.task import load_heldout

    run = Path(args.run)
    cfg, drafts = run_drafts(run)
    if args.max_tokens is not None:
        cfg.eval.max_tokens = args.max_tokens
    toy = Path(cfg.toy or run / "toy")
    prompts = [p["prompt"] for p in load_heldout(toy / "heldout.jsonl")][: args.prompts]
    threads = cfg.engine_threads
    policy = run / "final_policy"

    def measure(engine, draft=None) -> tuple[int, float, float]:
        # the demo's own measurement: its sampling settings and eval seed, the GC held off
        m = demo_arms.measure(engine, prompts, cfg) if draft is None else demo_arms.measure_draft(engine, draft, prompts, cfg)
        return m["tokens"], m["seconds"], m["acceptance_length"]

    plain = RolloutEngine(policy, None, threads=threads, seed=0)
    torch.set_num_threads(threads)  # vLLM lowered it to one when it started in this process
    results: dict = {"run": str(run), "prompts": len(prompts), "rounds": args.rounds, "by_k": {}}
    try:
        for k in ks:
            spec_engine = RolloutEngine(policy, drafts["adapted"], method="eagle3", num_speculative_tokens=k,
                                 threads=threads, seed=0)
            tok: dict[str, list] = {}
            try:
                for _ in tqdm(range(args.rounds), desc=f"k={k}", file=sys.stderr):
                    tok.setdefault("plain", []).append(measure(plain))
                    for arm, path in drafts.items():
                        tok.setdefault(arm, []).append(measure(spec_engine, path))
            finally:
                spec_engine.close()
            tps = {arm: sum(t for t, _, _ in ms) / sum(s for _, s, _ in ms) for arm, ms in tok.items()}
            row = {arm: {"acceptance_length": round(ms[0][2], 3),  # same seeds every round: same tokens
                         "tokens_per_s": round(tps[arm], 1),
                         "over_plain_tokens_per_s": round(tps[arm] / tps["plain"], 3)}
                   for arm, ms in tok.items() if arm != "plain"}
            row["plain_tokens_per_s"] = round(tps["plain"], 1)
            row["adapted_over_frozen_acceptance"] = round(row["adapted"]["acceptance_length"]
                                                          / row["frozen"]["acceptance_length"], 3)
            results["by_k"][k] = row
    finally:
        plain.close()

    if not args.json:
        arms = list(drafts)
        print(f"{'k':>2} | " + " | ".join(f"{a} accept (tok/s vs plain)" for a in arms) + " | adapted/frozen accept")
        for k, row in results["by_k"].items():
            cells = [f"{row[a]['acceptance_length']:.3f} (x{row[a]['over_plain_tokens_per_s']:.3f})" for a in arms]
            print(f"{k:>2} | " + " | ".join(cells) + f" | {row['adapted_over_frozen_acceptance']:.3f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
