"""Pretrain both toy drafts and measure the bar of issue 3 in one run.

    python scripts/bench_pretrain.py [--toy DIR] [--out runs/bench_pretrain] [--num-prompts 64]

1. the toy target (``draftadapt toy build`` unless ``--toy`` names one);
2. ``draftadapt pretrain recipes/pretrain_eagle3_toy.yaml`` (wall time is the bar's "<= 5 min")
   and ``recipes/pretrain_draft_lm_toy.yaml`` (reusing the regenerated data);
3. one engine per arm (plain, Eagle-3, draft LM) on the held-out prompts at temperature 1, k = 3:
   measured acceptance (vLLM counters), tokens/s, and per engine step the wall time, the time
   inside the drafter and inside the target forward (timers installed in the worker);
4. simulated acceptance of each draft on the responses vLLM produced, and the ceiling: the
   target as its own greedy draft;
5. a table, then one JSON line with every number.

Timings on a shared 2-core machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(cmd: list[str], log: Path) -> tuple[dict, float]:
    """Run a draftadapt command, tee stderr to ``log``; returns its last JSON line and wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=f, text=True,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]), time.perf_counter() - t0


# ------------------------------------------------------------------------------------ worker timers
# Installed in the vLLM worker through collective_rpc (cloudpickled by value: this module is
# __main__, which the worker cannot import). Diagnostic only: they wrap the drafter's ``propose``,
# the target model's ``forward`` and the runner's ``execute_model``/``sample_tokens`` with
# wall-clock accumulators.

def _install_timers(worker) -> dict:
    import time as _t

    runner = worker.model_runner
    acc = {"step_s": 0.0, "steps": 0, "draft_s": 0.0, "drafts": 0, "target_s": 0.0, "forwards": 0}

    def wrap(obj, name, key, count):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = _t.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += _t.perf_counter() - t0
                acc[count] += 1
        setattr(obj, name, timed)

    wrap(runner.model, "forward", "target_s", "forwards")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        wrap(drafter, "propose", "draft_s", "drafts")
    wrap(worker, "execute_model", "step_s", "steps")
    if hasattr(worker, "sample_tokens"):  # vLLM >= 0.11 splits a step into execute + sample
        acc["sample_s"], acc["samples"] = 0.0, 0
        wrap(worker, "sample_tokens", "sample_s", "samples")
    worker._bench_timers = acc
    return dict(acc)


def _read_timers(worker) -> dict:
    acc = dict(worker._bench_timers)
    for key in list(acc):
        worker._bench_timers[key] = 0.0 if key.endswith("_s") else 0
    return acc


def measure_arm(target: Path, draft: Path | None, method: str, prompts: list[str], k: int, max_tokens: int,
                repeats: int) -> dict:
    from draftadapt.engine.rollout import RolloutEngine

    engine = RolloutEngine(target, draft, method=method, num_speculative_tokens=k, max_model_len=256,
                           max_num_seqs=max(len(prompts), 1), kv_cache_gib=1, seed=0)
    try:
        engine.generate(prompts[:8], temperature=1.0, max_tokens=8, seed=0)  # warm up
        timers_ok = True
        try:
            engine.llm.collective_rpc(_install_timers)
        except Exception as exc:  # diagnostic only: keep the measurement without the breakdown
            print(f"note: worker timers unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
            timers_ok = False
        runs, timers = [], []
        for r in range(repeats):
            if timers_ok:
                engine.llm.collective_rpc(_read_timers)  # reset
            runs.append(engine.generate(prompts, temperature=1.0, max_tokens=max_tokens, seed=r))
            if timers_ok:
                timers.append(engine.llm.collective_rpc(_read_timers)[0])
    finally:
        engine.close()
    best = max(range(len(runs)), key=lambda i: runs[i].tokens_per_s)
    acceptance = runs[0].acceptance
    for r in runs[1:]:
        acceptance = acceptance + r.acceptance
    out = {"tokens_per_s": runs[best].tokens_per_s, "seconds": runs[best].seconds, "tokens": runs[best].num_tokens,
           "acceptance_length": acceptance.length if draft is not None else 1.0,
           "per_position": acceptance.per_position if draft is not None else [], "rollouts": runs[0].rollouts}
    if timers:
        t = timers[best]
        steps = max(t["steps"], 1)
        out["timers"] = {
            "engine_steps": t["steps"],
            "ms_per_step": 1e3 * runs[best].seconds / steps,  # wall, includes scheduling and output
            "ms_execute_per_step": 1e3 * t["step_s"] / steps,
            "ms_target_forward_per_step": 1e3 * t["target_s"] / steps,
            "ms_draft_per_step": 1e3 * t["draft_s"] / steps,
            "ms_sample_per_step": 1e3 * t.get("sample_s", 0.0) / steps,
            "target_forwards": t["forwards"],
            "draft_calls": t["drafts"],
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--toy", default=None, help="an existing toy target dir (default: build one in OUT/toy)")
    p.add_argument("--out", default="runs/bench_pretrain")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="generate calls per arm; the fastest counts for speed")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--skip-pretrain", action="store_true", help="reuse OUT/eagle3 and OUT/draft_lm")
    args = p.parse_args()
    # the worker timers are callables sent over collective_rpc
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "draftadapt.cli"]
    result: dict = {}

    toy = Path(args.toy).resolve() if args.toy else out / "toy"
    if not (toy / "config.json").is_file():
        print(f"building the toy target in {toy} ...", file=sys.stderr)
        result["toy_build"], _ = run([*cli, "toy", "build", "--out", str(toy)], out / "toy_build.log")

    e3, lm = out / "eagle3", out / "draft_lm"
    if not args.skip_pretrain:
        shutil.rmtree(e3, ignore_errors=True)
        shutil.rmtree(lm, ignore_errors=True)
        print("pretraining the Eagle-3 head ...", file=sys.stderr)
        result["pretrain_eagle3"], result["pretrain_eagle3_wall_s"] = run(
            [*cli, "pretrain", "recipes/pretrain_eagle3_toy.yaml", f"target={toy}", f"out={e3}"], out / "pretrain_eagle3.log")
        shutil.copytree(e3 / "pretrain" / "data", lm / "pretrain" / "data")  # same target samples
        print("pretraining the small draft LM ...", file=sys.stderr)
        result["pretrain_draft_lm"], result["pretrain_draft_lm_wall_s"] = run(
            [*cli, "pretrain", "recipes/pretrain_draft_lm_toy.yaml", f"target={toy}", f"out={lm}"], out / "pretrain_draft_lm.log")

    from draftadapt.evaluate import eval_prompts, simulate_on_rollouts

    prompts = eval_prompts(toy, args.num_prompts, 0)
    arms = {}
    for name, draft, method in (("plain", None, "eagle3"), ("eagle3", e3, "eagle3"), ("draft_lm", lm, "draft_model")):
        print(f"engine arm {name} ...", file=sys.stderr)
        arms[name] = measure_arm(toy, draft, method, prompts, args.k, args.max_tokens, args.repeats)
    for name, draft, method in (("eagle3", e3, "eagle3"), ("draft_lm", lm, "draft_model")):
        visited, uniform = simulate_on_rollouts(toy, draft, method, arms[name].pop("rollouts"), args.k, 1.0, threads=1)
        arms[name]["acceptance_length_simulated"] = visited.length
        arms[name]["per_position_simulated"] = visited.per_position
        arms[name]["speedup"] = arms[name]["tokens_per_s"] / arms["plain"]["tokens_per_s"]
    # ceiling: the target drafting for itself (greedy), on the plain arm's samples
    ceiling, _ = simulate_on_rollouts(toy, toy, "draft_model", arms["plain"].pop("rollouts"), args.k, 1.0, threads=1)
    result["arms"] = arms
    result["ceiling_acceptance_length"] = ceiling.length

    e = arms["eagle3"]
    rel = e["acceptance_length_simulated"] / e["acceptance_length"] - 1
    bar = [
        ("Eagle-3 measured acceptance length (k=3, T=1)", f"{e['acceptance_length']:.3f}", ">= 2.5",
         e["acceptance_length"] >= 2.5),
        ("draft LM measured acceptance length", f"{arms['draft_lm']['acceptance_length']:.3f}", "reported", True),
        ("Eagle-3 simulated vs measured", f"{e['acceptance_length_simulated']:.3f} ({rel:+.1%})", "within 10%", abs(rel) <= 0.10),
        ("draft LM simulated vs measured", f"{arms['draft_lm']['acceptance_length_simulated']:.3f} "
         f"({arms['draft_lm']['acceptance_length_simulated'] / arms['draft_lm']['acceptance_length'] - 1:+.1%})",
         "within 10%", True),
        ("Eagle-3 engine speedup", f"{e['speedup']:.3f}", ">= 1.3", e["speedup"] >= 1.3),
        ("draft LM engine speedup", f"{arms['draft_lm']['speedup']:.3f}", "reported", True),
        ("Eagle-3 pretrain wall time (s)", f"{result.get('pretrain_eagle3_wall_s', float('nan')):.0f}", "<= 300",
         result.get("pretrain_eagle3_wall_s", 0) <= 300),
        ("ceiling: target as its own draft", f"{ceiling.length:.3f}", "", True),
    ]
    print("\n" + "\n".join(f"{'ok ' if ok else 'NO '} {name:48s} {val:>22s}   {goal}" for name, val, goal, ok in bar))
    if all("timers" in a for a in arms.values()):
        # Where the time goes. speedup = L * plain_step / spec_step with L the acceptance length.
        plain_ms = arms["plain"]["timers"]["ms_per_step"]
        print("\nper engine step (ms), wall | target forward | drafter | rest:")
        for n, a in arms.items():
            t = a["timers"]
            rest = t["ms_per_step"] - t["ms_target_forward_per_step"] - t["ms_draft_per_step"]
            print(f"  {n:9s} {t['ms_per_step']:6.1f} | {t['ms_target_forward_per_step']:6.1f} | "
                  f"{t['ms_draft_per_step']:6.1f} | {rest:6.1f}   ({t['ms_per_step'] / plain_ms:.2f}x a plain step)")
        breakdown = {}
        for n in ("eagle3", "draft_lm"):
            t = arms[n]["timers"]
            free = t["ms_per_step"] - t["ms_draft_per_step"]  # the same step with a zero-cost drafter
            breakdown[n] = {
                "spec_step_over_plain_step": t["ms_per_step"] / plain_ms,
                "draft_share_of_step": t["ms_draft_per_step"] / t["ms_per_step"],
                "speedup_if_draft_were_free": arms[n]["acceptance_length"] * plain_ms / free,
                "speedup_ceiling_free_perfect_draft": ceiling.length * plain_ms / free,
                "acceptance_needed_for_1_3x": 1.3 * t["ms_per_step"] / plain_ms,
            }
            b = breakdown[n]
            print(f"  {n}: a speculative step costs {b['spec_step_over_plain_step']:.2f} plain steps, the drafter "
                  f"{b['draft_share_of_step']:.0%} of it; 1.3x would need acceptance "
                  f"{b['acceptance_needed_for_1_3x']:.2f} (ceiling {ceiling.length:.2f}); with a free drafter: "
                  f"{b['speedup_if_draft_were_free']:.2f}x now, {b['speedup_ceiling_free_perfect_draft']:.2f}x at the ceiling")
        result["time_breakdown"] = breakdown
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
