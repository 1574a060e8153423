"""How far the policy's next-token distribution moves in one RL step, on a recorded spool.

    python scripts/policy_shift.py --spool SPOOL --target POLICY_DIR [--steps 3,5] [--max-seqs 256] [--json]

For each recorded RL step t whose sampling policy (version v) and the next policy (v + 1) are both
in the spool, both policies run over step t's rollouts and, per response token, the total
variation and KL(new || old) between their next-token distributions are averaged. A small shift
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

from replay_adapter import recorded_steps  # noqa: E402

from draftadapt.capture.policy import PolicyCopy  # noqa: E402
from draftadapt.data.sequences import Sequence, collate  # noqa: E402
from draftadapt.spool import SpoolReader  # noqa: E402


@torch.no_grad()
def response_logp(model, seqs: list[Sequence], pad_id: int, micro_batch: int = 32) -> list[torch.Tensor]:
    """Per sequence, [len(response), V] log-probs of the policy's next token at each response slot."""
    out = []
    for lo in range(0, len(seqs), micro_batch):
        chunk = seqs[lo: lo + micro_batch]
        batch = collate(chunk, pad_id)
        logp = torch.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float(), -1)
        for row, s in zip(logp, chunk):
            p = len(s.prompt_ids)
            out.append(row[p - 1: p - 1 + len(s.response_ids)])
    return out


def shift(old: list[torch.Tensor], new: list[torch.Tensor]) -> dict[str, float]:
    """Mean over response tokens of TV(new, old) and KL(new || old)."""
    tv = kl = 0.0
    n = 0
    for a, b in zip(old, new):
        pb = b.exp()
        tv += float(0.5 * (pb - a.exp()).abs().sum())
        kl += float((pb * (b - a)).sum())
        n += a.shape[0]
    return {"tv_per_token": tv / max(n, 1), "kl_per_token": kl / max(n, 1), "tokens": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spool", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path, help="the policy's model directory")
    ap.add_argument("--steps", default="", help="comma-separated RL steps (default: every step with both policies)")
    ap.add_argument("--max-seqs", type=int, default=256, help="rollouts per step, spread evenly over it")
    ap.add_argument("--json", action="store_true", help="one JSON object per step")
    args = ap.parse_args(argv)
    reader = SpoolReader(args.spool)
    policies = {ref.version: ref for ref in reader.policies()}
    wanted = {int(s) for s in args.steps.split(",") if s.strip()}
    steps = [(t, v, seqs) for t, v, seqs in recorded_steps(reader)
             if v in policies and v + 1 in policies and (not wanted or t in wanted)]
    if not steps:
        have = sorted(policies)
        raise SystemExit(f"policy_shift: no recorded step in {args.spool} has its policy and the next one "
                         f"(policy versions in the spool: {have}); record the spool with every policy update")
    model = PolicyCopy.load_model(args.target)
    pad_id = int(model.config.pad_token_id or 0)

    def at(version: int) -> None:
        model.load_state_dict(reader.load_policy(policies[version]).state_dict(), strict=False)

    for t, v, seqs in steps:
        seqs = seqs[:: max(1, len(seqs) // args.max_seqs)][: args.max_seqs]
        at(v)
        old = response_logp(model, seqs, pad_id)
        at(v + 1)
        row = {"step": t, "policy_version": v, "sequences": len(seqs), **shift(old, response_logp(model, seqs, pad_id))}
        print(json.dumps(row) if args.json else
              f"step {t} (policy {v} -> {v + 1}, {len(seqs)} rollouts): TV {row['tv_per_token']:.4f} "
              f"KL {row['kl_per_token']:.4f} per response token", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
