"""One Eagle-3 training step, draftadapt's unroll against speculators' model, on the same head and tokens.

    .venv/bin/python scripts/bench_speculators.py --toy DIR --draft DIR

``--draft``: an Eagle-3 draft directory in the speculators format (a speculators ``save_pretrained``
or a draftadapt export). Both sides get the toy target's own aux states over the same 16 toy-task
sequences, three TTT steps, forward and backward, one thread: draftadapt as a padded [16, T]
batch (``Eagle3Head.unroll``), speculators as its trainer packs them, one row with document ids
(``Eagle3DraftModel.forward``, eager attention, its KL loss). Prints the token counts and the
median of 10 steps each (docs/design.md, "speculators").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test's helpers: tests/integration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", required=True, help="the toy target (draftadapt toy build --out DIR)")
    ap.add_argument("--draft", required=True, help="an Eagle-3 draft directory in the speculators format")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from speculators.losses import resolve_loss_config

    from draftadapt.drafts.formats import load_eagle3
    from tests.integration.test_speculators import TTT_STEPS, Features, speculators_model

    target, draft = Path(args.toy), Path(args.draft)
    head = load_eagle3(draft, target).train()
    model = speculators_model(draft).train()
    features = Features(target, list(head.cfg.aux_layer_ids))
    packed = features.packed(args.seqs, seed=3)
    rows = features.sequences(args.seqs, seed=3)
    t = max(len(ids) for ids, _ in rows) - 1
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    aux = torch.zeros(len(rows), t, packed["hidden_states"].shape[-1])
    for i, (seq, _) in enumerate(rows):
        ids[i, :len(seq) - 1] = torch.tensor(seq[1:])
        aux[i, :len(seq) - 1] = features.forward(seq)[0][0, :-1]
    loss_config = resolve_loss_config("kl_div", "eager")

    def ours():
        steps = head.unroll(ids, aux, TTT_STEPS)
        sum(s.logsumexp(-1).mean() for s in steps).backward()

    def theirs():
        _, loss, _ = model(**packed, ttt_steps=TTT_STEPS, loss_config=loss_config)
        loss.backward()

    def median_ms(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    print(f"tokens: speculators packed {packed['input_ids'].shape[1]}, draftadapt padded {ids.numel()}")
    print(f"draftadapt unroll, forward+backward: {median_ms(ours):.0f} ms")
    print(f"speculators eager, forward+loss+backward: {median_ms(theirs):.0f} ms")


if __name__ == "__main__":
    main()
