"""Profile one DraftAdapter round on a recorded run: where an adapter step's time goes.

    python scripts/profile_adapter.py --spool SPOOL --target POLICY_DIR --draft DRAFT_DIR \\
        [--steps 3] [--top 25] [--set "train.batch_size=16 schedule.train_steps=20"] [--no-handover]

Replays the first ``--steps`` recorded RL steps into an adapter (observe, update_policy, run_round),
as scripts/replay_adapter.py does, then runs one more step under cProfile and prints the
cumulative-time table of that step alone. With a hand-over (the default) the rollouts'
states come from a forward of the sampling policy, as the RL trainer's own pass hands them
over; that forward is not part of the profiled step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_adapter import handed_over, recorded_steps  # noqa: E402

from draftadapt.adapter import AdapterConfig, DraftAdapter  # noqa: E402
from draftadapt.config import ConfigError, load_config  # noqa: E402
from draftadapt.spool import SpoolReader  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spool", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=3, help="recorded steps replayed before the profiled one")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--set", default="", help="AdapterConfig overrides (key=value, space separated)")
    ap.add_argument("--no-handover", action="store_true", help="observe without the sampling policy's states")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(AdapterConfig, None, shlex.split(args.set))
    except ConfigError as exc:
        print(f"error: --set: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    reader = SpoolReader(args.spool)
    steps = recorded_steps(reader)
    if len(steps) < args.steps + 2:
        print(f"error: {args.spool} holds {len(steps)} steps; --steps {args.steps} needs {args.steps + 2}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="profile_adapter_") as out:
        adapter = DraftAdapter(args.target, args.draft, out, cfg, policy_version=steps[0][1])
        for i, (step, version, seqs) in enumerate(steps[: args.steps + 1]):
            pairs = [(s.prompt_ids, s.response_ids) for s in seqs]
            if args.no_handover:  # (also runs against adapters from before the hand-over existed)
                adapter.observe(pairs, policy_version=version)
            else:
                adapter.observe(pairs, policy_version=version, handover=handed_over(adapter, seqs))
            ckpt = reader.policy(steps[i + 1][1])
            adapter.update_policy(ckpt.state_dict(), version=steps[i + 1][1])
            if i == args.steps:
                break
            adapter.run_round()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        m = adapter.run_round()
        prof.disable()
        seconds = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.top)
    print(buf.getvalue())
    print(f"one adapter step: {seconds:.2f} s; published {int(m.get('adapt/published', 0))}, "
          f"train steps {int(m.get('adapt/train_steps', 0))}, policy forwards so far {getattr(adapter.capture, 'forwards', 'n/a')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
