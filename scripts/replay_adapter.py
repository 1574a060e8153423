"""Replay a recorded RL run through adapter configs, offline, and score each on what came next.

    python scripts/replay_adapter.py --spool SPOOL --target POLICY_DIR --draft DRAFT_DIR \\
        --try "" --try "train.batch_size=16 schedule.train_steps=20 train.lr=2e-3" [--last 4] [--json]

SPOOL is a spool directory an RL run wrote (``draftadapt.spool.SpoolWriter``; the demo writes one
with ``spool=DIR``): rollout shards per step and the policy checkpoint after each step. Every
config (``--try``: AdapterConfig overrides, ``key=value`` separated by spaces; "" = the library
defaults; ``targets=current`` recaptures against the newest policy instead of taking the
sampling policy's states over, as a hand-over from the RL trainer's forward does) sees exactly the same inputs, in the order the run produced them:
observe(step s's rollouts, version v) -> update_policy(v + 1) -> run_round(), then the live draft
is scored (simulated acceptance length, vLLM's greedy drafting) on the rollouts of step s + 1,
which the new policy sampled and no config has trained on yet. The starting draft is scored on
the same sets ("frozen"). In a live run the trajectory itself depends on the draft (rejection
sampling draws differently), so comparing configs live mixes their effect with a different
trajectory; here only the config differs.

A replay has no RL step whose time the adapter shares, so ``--base toy`` turns the toy
adapter's cost cap off, unless ``--rl-step-s S`` emulates it: each step then counts S seconds
of generation and policy update (a demo's mean ``stage/gen_s + stage/train_s``) besides the
adapter's own measured calls, the replay's own forwards and scores count nowhere, and the live
draft's simulated acceptance on each step's rollouts reaches the drift trigger as the engine's
measurement would. The rounds then wait, run and catch up as the live loop's would; the JSON
adds ``adapt_share`` and ``deferred`` (docs/design.md, "Replaying under the cap").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftadapt.adapter import AdapterConfig, DraftAdapter
from draftadapt.capture.hidden import CapturedBatch
from draftadapt.config import ConfigError, load_config
from draftadapt.data.sequences import Sequence, collate
from draftadapt.spool import SpoolReader
from draftadapt.progress import progress
from draftadapt.train.trainer import score_draft


def recorded_steps(reader: SpoolReader) -> list[tuple[int, int, list[Sequence]]]:
    """(step, policy version, sequences) per RL step, in step order (a step may span shards)."""
    by_step: dict[int, tuple[int, list[Sequence]]] = {}
    for ref in reader.shards():
        shard = reader.load(ref)
        version, seqs = by_step.setdefault(shard.step, (shard.policy_version, []))
        if shard.policy_version != version:
            raise ValueError(f"step {shard.step} has shards of policy versions {version} and {shard.policy_version}")
        seqs.extend(s for s in shard.sequences() if s.response_ids)
    return [(step, v, seqs) for step, (v, seqs) in sorted(by_step.items())]


def spread(seqs: list[Sequence], n: int) -> list[Sequence]:
    """At most ``n`` of ``seqs``, spread evenly over them."""
    return seqs[:: max(1, len(seqs) // n)][:n]


def eval_batches(adapter: DraftAdapter, seqs: list[Sequence], n: int) -> list[CapturedBatch]:
    """``n`` sequences spread evenly over ``seqs``, captured against the adapter's current policy."""
    picked = sorted(spread(seqs, n), key=len)
    bs = adapter.cfg.train.batch_size
    return [adapter.capture.capture(collate(picked[i: i + bs], adapter.pad_id)) for i in range(0, len(picked), bs)]


def handed_over(adapter: DraftAdapter, seqs: list[Sequence], micro_batch: int = 32):
    """What the RL trainer's own forward would hand over: the rollouts run through the adapter's
    policy copy, which is at their sampling version when they are observed (not counted as the
    adapter's time, except the hand-over's own)."""
    ho = adapter.handover(adapter.policy)
    with ho, torch.no_grad():
        for lo in range(0, len(seqs), micro_batch):
            idx = list(range(lo, min(lo + micro_batch, len(seqs))))
            batch = collate([seqs[i] for i in idx], adapter.pad_id)
            logits = adapter.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ho.add(idx, logits, batch["attention_mask"])
    return ho


def adapter_config(base: str, overrides: list[str], keep_cap: bool = False) -> AdapterConfig:
    """``overrides`` on the library's defaults (``base="library"``) or on the adapter the toy
    world's RL runs attach (``"toy"``: the demo's and the TRL recipe's, ``toy_adapter(method)``,
    the method the overrides name). ``keep_cap``: leave the toy adapter's cost cap on (a replay
    that emulates the RL step's time)."""
    if base == "library":
        return load_config(AdapterConfig, None, overrides)
    from draftadapt.config import parse_overrides, save_config
    from draftadapt.rl.config import toy_adapter

    method = dict(parse_overrides(overrides)).get("method", "eagle3")
    with tempfile.TemporaryDirectory(prefix="replay_cfg_") as tmp:
        save_config(toy_adapter(method), Path(tmp) / "adapter.yaml")
        # the cost cap shares the RL step's time, which a replay does not have: off unless set
        # (or emulated)
        cap_off = [] if keep_cap else ["schedule.max_share=0"]
        return load_config(AdapterConfig, Path(tmp) / "adapter.yaml", cap_off + overrides)


def replay(spool: Path, target: Path, draft: Path, overrides: list[str], eval_seqs: int = 96,
           base: str = "library", rl_step_s: float = 0.0) -> dict:
    """``rl_step_s`` > 0 emulates the live loop's cost cap: each recorded step counts that many
    seconds of the RL step's own work (generation and policy update) on the adapter's clock, the
    replay's own forwards and scores count nowhere, and the live draft's simulated acceptance on
    each step's rollouts (the draft that generated them) reaches the drift trigger as the
    engine's measurement would."""
    cfg = adapter_config(base, overrides, keep_cap=rl_step_s > 0)
    reader = SpoolReader(spool)
    steps = recorded_steps(reader)
    if len(steps) < 2:
        raise ValueError(f"{spool} holds {len(steps)} step(s) of rollouts; replaying needs at least 2 "
                         "(each step is scored on the next one)")
    with tempfile.TemporaryDirectory(prefix="replay_drafts_") as out:
        adapter = DraftAdapter(target, draft, out, cfg, policy_version=steps[0][1])
        frozen = adapter.live_draft()
        rows, adapt_s = [], 0.0
        emulate = rl_step_s > 0

        def not_counted():  # the replay's own work: on the emulated clock, neither the run's nor the adapter's
            return adapter.not_counted() if emulate else contextlib.nullcontext()
        for i, (step, version, seqs) in enumerate(progress(iterable=steps[:-1], desc="replay", unit="step")):
            if adapter.policy_version != version:
                raise ValueError(f"{spool}: step {step}'s rollouts are of policy version {version}, the replay "
                                 f"holds version {adapter.policy_version}; replaying needs the run's checkpoints in order")
            if emulate:
                with not_counted():
                    measured = rows[-1]["adapted"] if rows else score_draft(
                        frozen, eval_batches(adapter, seqs, eval_seqs), adapter.cfg.k)[0].length
                adapter.report_measured(measured)
            with not_counted():
                ho = handed_over(adapter, seqs) if cfg.targets == "sampling" else None
            adapter.observe([(s.prompt_ids, s.response_ids) for s in seqs], policy_version=version, handover=ho)
            adapt_s += ho.seconds if ho is not None else 0.0
            nxt_version = steps[i + 1][1]
            if nxt_version > adapter.policy_version:
                with not_counted():
                    ckpt = reader.policy(nxt_version)
                if ckpt is None:
                    raise ValueError(f"{spool} has rollouts of policy version {nxt_version} but no checkpoint of it")
                adapter.update_policy(ckpt.state_dict(), version=nxt_version)
            t0 = time.perf_counter()
            m = adapter.run_round()
            adapt_s += time.perf_counter() - t0
            if emulate:
                adapter.cost.credit(rl_step_s)
            with not_counted():
                held = eval_batches(adapter, steps[i + 1][2], eval_seqs)
                adapter.refresh_shared_embeddings(frozen)
                rows.append({
                    "step": step, "policy_version": adapter.policy_version,
                    "adapted": score_draft(adapter.live_draft(), held, adapter.cfg.k)[0].length,
                    "frozen": score_draft(frozen, held, adapter.cfg.k)[0].length,
                    "published": int(m.get("adapt/published", 0.0)),
                    "simulated_length": m.get("accept/simulated_length"),  # the round's candidate, on its held-out set
                    "simulated_live": m.get("accept/simulated_live"),  # the live draft on the same set
                    "train_steps": int(m.get("adapt/train_steps", 0.0)),
                    "deferred": int(m.get("adapt/deferred", 0.0)),  # a due round waited (the emulated cap)
                })
        share = adapter.cost.share() if emulate else None
    return {"overrides": overrides, "steps": rows, "adapt_seconds": adapt_s, "share": share}


def summarize(res: dict, last: int) -> dict:
    steps = res["steps"]
    tail = steps[-last:]
    start = steps[0]["frozen"]  # the starting draft on the first scored set: what "retention" divides by
    adapted = [r["adapted"] for r in steps]
    out = {"try": " ".join(res["overrides"]) or "(defaults)",
           "adapted_last": sum(r["adapted"] for r in tail) / len(tail),
           "frozen_last": sum(r["frozen"] for r in tail) / len(tail),
           # the demo's whole-run figures, on the replay's scores
           "worst_over_start": min(adapted) / start,
           "mean_over_start": sum(adapted) / len(adapted) / start,
           "published": sum(r["published"] for r in steps),
           "adapt_seconds": res["adapt_seconds"]}
    if res.get("share") is not None:  # --rl-step-s: the emulated cap's share and its waits
        out["adapt_share"] = res["share"]
        out["deferred"] = sum(r["deferred"] for r in steps)
    return out


def over_seeds(label: str, runs: list[dict]) -> dict:
    """Config ``label``'s summaries over its ``train.seed``s (--seeds): the mean of each figure,
    and the lowest worst step and mean (a single replay's spread is as large as most settings'
    effects; docs/design.md, "Replaying under the cap")."""
    out = {"try": label, "seeds": len(runs)}
    for key in ("worst_over_start", "mean_over_start", "adapted_last", "adapt_seconds", "adapt_share", "deferred"):
        if key in runs[0]:
            out[key] = sum(r[key] for r in runs) / len(runs)
    out["min_worst_over_start"] = min(r["worst_over_start"] for r in runs)
    out["min_mean_over_start"] = min(r["mean_over_start"] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spool", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path, help="the policy the run started from (HF dir)")
    ap.add_argument("--draft", required=True, type=Path, help="the draft the run started from")
    ap.add_argument("--try", dest="tries", action="append", default=None,
                    help='AdapterConfig overrides for one config, e.g. "train.batch_size=16 train.lr=2e-3" ("" = defaults); repeat')
    ap.add_argument("--base", choices=("library", "toy"), default="library",
                    help="what --try overrides: the library's AdapterConfig defaults, or the toy world's "
                         "adapter (the demo's and the TRL recipe's)")
    ap.add_argument("--last", type=int, default=4, help="summarise the mean over the last N scored steps")
    ap.add_argument("--eval-seqs", type=int, default=96, help="sequences of the next step each step is scored on")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rl-step-s", type=float, default=0.0,
                    help="emulate the live run's cost cap (--base toy keeps its schedule.max_share): each step "
                         "counts this many seconds of generation and policy update (a demo's mean of "
                         "stage/gen_s + stage/train_s), and the live draft's simulated acceptance on each "
                         "step's rollouts stands in for the engine's measurement; 0 = cap off")
    ap.add_argument("--seeds", type=int, default=1,
                    help="replay each config with train.seed=0..N-1 and summarise it over them (mean, and "
                         "the lowest worst step and mean); a --try that sets train.seed runs once")
    ap.add_argument("--json", action="store_true", help="print one JSON object per config instead of a table "
                                                         "(with --seeds: one a seed, then one over the seeds)")
    args = ap.parse_args(argv)
    for p, what in ((args.spool, "--spool"), (args.target, "--target"), (args.draft, "--draft")):
        if not p.is_dir():
            print(f"error: {what} {p} is not a directory", file=sys.stderr)
            return 2
    if args.last < 1 or args.eval_seqs < 1 or args.rl_step_s < 0 or args.seeds < 1:
        print("error: --last, --eval-seqs and --seeds must be >= 1, --rl-step-s >= 0", file=sys.stderr)
        return 2
    tries = [shlex.split(t) for t in (args.tries or [""])]
    try:
        for t in tries:  # every config is checked before the first one runs for minutes
            adapter_config(args.base, t, keep_cap=args.rl_step_s > 0)
    except ConfigError as exc:
        print(f"error: --try: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows = []  # a summary a config (over its seeds with --seeds)
    for t in tries:
        seeded = args.seeds > 1 and not any(o.startswith("train.seed=") for o in t)
        runs = []
        for extra in ([[f"train.seed={seed}"] for seed in range(args.seeds)] if seeded else [[]]):
            overrides = t + extra
            try:
                res = replay(args.spool, args.target, args.draft, overrides, args.eval_seqs, args.base, args.rl_step_s)
            except (ValueError, ConfigError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            runs.append(summarize(res, args.last))
            if args.json:
                print(json.dumps({**runs[-1], "per_step": res["steps"]}), flush=True)
        rows.append(over_seeds(" ".join(t) or "(defaults)", runs) if seeded else runs[0])
        if args.json and seeded:
            print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print(f"{'config':60s} | seeds | worst / start | mean / start | adapted last {args.last} | adapt s")
        for s in rows:
            lows = f" ({s['min_worst_over_start']:.3f})" if "seeds" in s else ""
            print(f"{s['try'][:60]:60s} | {s.get('seeds', 1):5d} | {s['worst_over_start']:.3f}{lows:8s} | "
                  f"{s['mean_over_start']:12.3f} | {s['adapted_last']:14.3f} | {s['adapt_seconds']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
