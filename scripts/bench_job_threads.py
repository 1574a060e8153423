"""Does a background writer's thread slow a CPU engine's later generations? (docs/design.md,
"Publishing beside the next round")

    python scripts/bench_job_threads.py --target runs/before/toy --json

Each arm runs in a process of its own: a vLLM engine on ``--target`` (no draft) times
``--repeats`` generations, then one writer job (a ``torch.save`` of a few MB, as a publish's
trainer-state save) runs as the arm says, then the same generations are timed again:

- ``none``: no job (the machine's own drift between the two timings);
- ``pool``: the job in a ``ThreadPoolExecutor(max_workers=1)`` whose thread stays alive (the
  publisher before draftadapt/threads.py);
- ``job_thread``: the job in ``JobThreads`` (a thread that ends with the job; what the publisher
  and background rounds use).

Prints one line per arm (median generation seconds before / after, and their ratio) and, with
``--json``, one JSON line at the end. Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ARMS = ("none", "pool", "job_thread")


def run_arm(arm: str, target: str, repeats: int, threads: int) -> dict:
    """This process's measurement: generation seconds before and after the writer job."""
    import io

    import torch

    from draftadapt.engine.rollout import RolloutEngine
    from draftadapt.threads import JobThreads

    engine = RolloutEngine(target, None, method=None, threads=threads)
    prompts = [f"{a}+1 x5=" for a in range(10, 74)]

    def timed() -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, max_tokens=64, seed=0)
            out.append(time.perf_counter() - t0)
        return out

    def job() -> int:
        state = torch.randn(1000, 1000)
        buf = io.BytesIO()
        torch.save({"weights": state.to(torch.bfloat16), "moments": state * 2}, buf)
        return len(buf.getvalue())

    before = timed()
    if arm == "pool":
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=1)  # kept alive, as a writer's pool is
        pool.submit(job).result()
    elif arm == "job_thread":
        JobThreads("bench-writer").submit(job).result()
    time.sleep(1.0)
    after = timed()
    engine.close()
    b, a = statistics.median(before), statistics.median(after)
    return {"arm": arm, "before_s": round(b, 4), "after_s": round(a, 4), "after_over_before": round(a / b, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a target model directory (the toy's `toy build` dir)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--repeats", type=int, default=5, help="generations timed before and after the job")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this arm here and print its JSON
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in ARMS]
    if unknown or not arms:
        ap.error(f"--arms {a.arms}: choose from {', '.join(ARMS)}")
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: give at least 1")
    if a.one:
        print("RESULT " + json.dumps(run_arm(a.one, a.target, a.repeats, a.threads)), flush=True)
        return 0
    results = []
    for arm in arms:  # each in a fresh process: a pool's thread, once started, outlives the arm
        proc = subprocess.run([sys.executable, __file__, "--target", a.target, "--repeats", str(a.repeats),
                               "--threads", str(a.threads), "--one", arm], capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.stderr.write(proc.stderr[-3000:])
            raise SystemExit(f"error: arm {arm} failed (exit {proc.returncode}); its stderr is above")
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        print(f"{arm:11s} generation {r['before_s']:.3f} s before, {r['after_s']:.3f} s after the job: "
              f"{r['after_over_before']:.3f}x", flush=True)
    if a.json:
        print(json.dumps({"arms": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
