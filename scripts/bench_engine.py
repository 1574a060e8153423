"""Engine benchmark: in-place draft swap latency and tokens/s with and without speculation.

    .venv/bin/python scripts/bench_engine.py --toy DIR [--draft DIR] [--swaps 50] [--json]

Prints swap latency p50/p95 over ``--swaps`` swaps of the toy Eagle-3 head (goal: p95 < 50 ms),
then tokens/s at temperature 1 on the toy target's held-out prompts: plain, and with the draft
(a fresh head from `draft init` unless ``--draft`` names a trained one), plus the measured
acceptance length; by default for both executors (vLLM in this process, the CPU default, and
vLLM's engine-core + worker processes). Ratios come from one run on one machine; the engines run
one after the other, never at the same time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--toy", default=None, help="toy target dir (built into a temp dir if absent)")
    ap.add_argument("--draft", default=None, help="Eagle-3 draft dir to measure (default: fresh head)")
    ap.add_argument("--swaps", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="timed generate rounds per engine")
    ap.add_argument("--executor", choices=["in_process", "multiprocess", "both"], default="both",
                    help="vLLM in this process (the CPU default) or in engine-core + worker processes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from draftadapt.drafts.formats import META_FILE
    from draftadapt.draft_init import init_draft
    from draftadapt.engine.rollout import RolloutEngine, median, percentile
    from draftadapt.toy.task import load_heldout

    work = Path(tempfile.mkdtemp(prefix="draftadapt-bench-"))
    toy = Path(args.toy) if args.toy else None
    if toy is None:
        from draftadapt.toy.build import build

        toy = work / "toy"
        build(str(toy))
    prompts = [p["prompt"] for p in load_heldout(toy / "heldout.jsonl")][: args.prompts]

    draft = Path(args.draft) if args.draft else init_draft(toy, "eagle3", work / "v0", seed=0)
    # a second version with other weights and the same shapes, to alternate with
    alt = work / "alt"
    shutil.copytree(draft, alt)
    from safetensors.torch import load_file, save_file

    from draftadapt.fileio import file_sha256

    sd = load_file(str(alt / "model.safetensors"))
    sd = {k: (v * 1.01 if v.is_floating_point() else v) for k, v in sd.items()}
    save_file(sd, str(alt / "model.safetensors"))
    meta = json.loads((alt / META_FILE).read_text())
    meta.update(version=int(meta.get("version") or 0) + 1, sha256=file_sha256(alt / "model.safetensors"))
    (alt / META_FILE).write_text(json.dumps(meta))

    results: dict = {"k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens}

    def timed(engine) -> tuple[float, object]:
        engine.generate(prompts[:8], temperature=1.0, max_tokens=16, seed=0)  # warm up
        tok, sec, acceptance = 0, 0.0, None
        for r in range(args.rounds):
            res = engine.generate(prompts, temperature=1.0, max_tokens=args.max_tokens, seed=1000 * r)
            tok += res.num_tokens
            sec += res.seconds
            acceptance = res.acceptance if acceptance is None else acceptance + res.acceptance
        return tok / sec, acceptance

    def bench(in_process: bool) -> dict:
        r: dict = {}
        eng = RolloutEngine(toy, draft, method="eagle3", num_speculative_tokens=args.k, in_process=in_process)
        try:
            ms = []
            checks = set()
            for i in tqdm(range(args.swaps), desc="swaps", file=sys.stderr):
                res = eng.swap_draft(alt if i % 2 == 0 else draft)
                ms.append(res.ms)
                checks.add(res.checksum)
            r["swap_ms_p50"] = round(median(ms), 2)
            r["swap_ms_p95"] = round(percentile(ms, 95), 2)
            r["swap_distinct_checksums"] = len(checks)
            eng.swap_draft(draft)
            tps_spec, acceptance = timed(eng)
            r["tokens_per_s_spec"] = round(tps_spec, 1)
            r["acceptance_length"] = round(acceptance.length, 3)
            r["per_position_acceptance"] = [round(x, 3) for x in acceptance.per_position]
        finally:
            eng.close()
        plain = RolloutEngine(toy, None, in_process=in_process)
        try:
            tps_plain, _ = timed(plain)
        finally:
            plain.close()
        r["tokens_per_s_plain"] = round(tps_plain, 1)
        r["speedup"] = round(tps_spec / tps_plain, 3)
        return r

    executors = ["in_process", "multiprocess"] if args.executor == "both" else [args.executor]
    for name in executors:
        results[name] = bench(name == "in_process")
    shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(results))
    else:
        for name in executors:
            r = results[name]
            print(f"[{name}] swap latency over {args.swaps} swaps: p50 {r['swap_ms_p50']} ms, "
                  f"p95 {r['swap_ms_p95']} ms (goal p95 < 50 ms)")
            print(f"[{name}] tokens/s at T=1: plain {r['tokens_per_s_plain']}, speculative "
                  f"{r['tokens_per_s_spec']} (x{r['speedup']}), acceptance length "
                  f"{r['acceptance_length']} {r['per_position_acceptance']}")
        if len(executors) == 2:
            a, b = results["in_process"], results["multiprocess"]
            print(f"in-process over multiprocess tokens/s: plain x{a['tokens_per_s_plain'] / b['tokens_per_s_plain']:.3f}, "
                  f"speculative x{a['tokens_per_s_spec'] / b['tokens_per_s_spec']:.3f}")
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
