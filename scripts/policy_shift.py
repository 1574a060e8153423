"""How far the policy's next-token distribution moves in one RL step, on a recorded spool.

    python scripts/policy_shift.py --spool SPOOL --target POLICY_DIR [--steps 3,5] [--max-seqs 256] [--json]

For each recorded RL step t whose sampling policy (version v) and the next policy (v + 1) are both
in the spool, both policies run over step t's rollouts and, per response token, the total
variation and KL(new || old) between their next-token distributions (temperature 1) are
averaged; one line per step is printed (``--json``: one object with tv_per_token, kl_per_token,
tokens), and the mean TV on stderr. A small shift
per token while the draft's acceptance falls fast says the drift is in *which text* the policy
writes, not in how it continues a given text (docs/design.md, "Prioritized replay").
``POLICY_DIR``: the model directory the spool's checkpoints are weights for (config, tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_adapter import recorded_steps, spread  # noqa: E402

from draftadapt.capture.policy import PolicyCopy  # noqa: E402
from draftadapt.data.sequences import Sequence, collate  # noqa: E402
from draftadapt.progress import progress  # noqa: E402
from draftadapt.spool import SpoolReader  # noqa: E402


@torch.no_grad()
def shift(old, new, seqs: list[Sequence], pad_id: int, micro_batch: int = 32) -> dict[str, float]:
    """Mean over the response tokens of ``seqs`` of TV(new, old) and KL(new || old) between the two
    models' next-token distributions (temperature 1), a micro-batch at a time."""
    tv = kl = 0.0
    n = 0
    for lo in range(0, len(seqs), micro_batch):
        chunk = seqs[lo: lo + micro_batch]
        batch = collate(chunk, pad_id)
        # right padded: slot u predicts token u + 1, a response token where loss_mask says so
        mask = batch["loss_mask"]
        a, b = (torch.log_softmax(m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float(), -1)[mask]
                for m in (old, new))
        pb = b.exp()
        tv += float(0.5 * (pb - a.exp()).abs().sum())
        kl += float((pb * (b - a)).sum())
        n += int(mask.sum())
    return {"tv_per_token": tv / max(n, 1), "kl_per_token": kl / max(n, 1), "tokens": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spool", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path, help="the policy's model directory")
    ap.add_argument("--steps", default="", help="comma-separated RL steps (default: every step with both policies)")
    ap.add_argument("--max-seqs", type=int, default=256, help="rollouts per step, spread evenly over it")
    ap.add_argument("--json", action="store_true", help="one JSON object per step")
    args = ap.parse_args(argv)
    if args.max_seqs < 1:
        ap.error(f"--max-seqs must be >= 1, got {args.max_seqs}")
    try:
        wanted = {int(s) for s in args.steps.split(",") if s.strip()}
    except ValueError:
        ap.error(f"--steps takes comma-separated RL step numbers such as 3,5; got {args.steps!r}")
    reader = SpoolReader(args.spool)
    policies = {ref.version: ref for ref in reader.policies()}
    recorded = recorded_steps(reader)
    steps = [(t, v, seqs) for t, v, seqs in recorded
             if v in policies and v + 1 in policies and (not wanted or t in wanted)]
    if not steps:
        raise SystemExit(
            f"policy_shift: no recorded step{' of ' + args.steps if wanted else ''} in {args.spool} has both its "
            f"policy and the next one (steps recorded: {[t for t, _, _ in recorded]}, policy versions: "
            f"{sorted(policies)}); record the spool with a policy checkpoint at every update")
    old, new = (PolicyCopy(PolicyCopy.load_model(args.target), args.target) for _ in range(2))
    loaded: dict[int, int] = {}  # id of a copy -> the spool version in it

    def load(copy: PolicyCopy, version: int) -> None:
        # checked like any policy update (names, shapes, finite): a checkpoint that did not load
        # would read as no shift at all
        if loaded.get(id(copy)) != version:
            copy.update(reader.load_policy(policies[version]).state_dict(), version)
            loaded[id(copy)] = version

    rows = []
    for t, v, seqs in progress(iterable=steps, desc="policy shift", unit="step"):
        seqs = spread(seqs, args.max_seqs)
        if loaded.get(id(new)) == v:  # consecutive steps: the last step's new policy is this one's old
            old, new = new, old
        load(old, v)
        load(new, v + 1)
        row = {"step": t, "policy_version": v, "sequences": len(seqs), **shift(old.model, new.model, seqs, old.pad_id)}
        rows.append(row)
        print(json.dumps(row) if args.json else
              f"step {t} (policy {v} -> {v + 1}, {len(seqs)} rollouts): TV {row['tv_per_token']:.4f} "
              f"KL {row['kl_per_token']:.4f} per response token", flush=True)
    mean_tv = sum(r["tv_per_token"] for r in rows) / len(rows)
    print(f"policy_shift: {len(rows)} steps, mean TV {mean_tv:.4f} per response token", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
