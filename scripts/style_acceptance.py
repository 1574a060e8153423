"""How a frozen draft accepts the target's own replies, grouped by answer style: which style, if an
RL reward amplified it, would the frozen draft follow worst? A way to choose a world's drifting
style by measurement before spending an RL run on it (docs/results.md, "A real model").

    python scripts/style_acceptance.py --target runs/smol/model --draft runs/smol/draft1 \
        --data runs/smol/draft1/pretrain/data --rows 200 --json

``--data``: a pretrain run's data/ directory (heldout.jsonl and train.jsonl, one reply a line as
``{"prompt_ids", "response_ids"}``: the target's own samples). Held-out replies come first, then
training ones, up to ``--rows``. With ``--instruction TEXT`` the replies are made first (when
``--data`` has none yet): the target answers ``--rows`` of the SmolLM2 world's problems (a draw of
its own, not the build's files) asked with TEXT in place of the task's instruction, at
``--temperature``, 128 tokens, plain vLLM; so a candidate task is scored before anything is
trained on it:

    python scripts/style_acceptance.py --target runs/smol/model --draft runs/smol/draft1 \
        --data runs/probe/french_or --rows 128 --temperature 0.7 \
        --instruction "Solve it in English or in French, then end with a line 'Answer: N'."
 Each reply is scored alone (simulated acceptance at ``--k``,
visited starts, temperature ``--temperature``), then the per-reply counts are summed per group.
Prints one line per style (share, acceptance with and without it, mean reply tokens), with
``--show N`` the N replies the draft accepts least and the N it accepts most (what separates them
is what a reward would have to move the policy towards), and, with ``--json``, one JSON line at
the end.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

# the styles a reward could pull a chat model's replies towards, each a test of the decoded reply
_ANSWER_LINE = re.compile(r"answer(?::| is:?)\s*(-?\d+)\s*\.?\s*$", re.IGNORECASE)
STYLES = {
    "answer_line": lambda text, n: bool(_ANSWER_LINE.search(text.strip().rsplit("\n", 1)[-1])),
    "short": lambda text, n: n < 60,
    "numbered_steps": lambda text, n: bool(re.search(r"^\s*(\d+\.|step \d)", text, re.IGNORECASE | re.MULTILINE)),
    "equation": lambda text, n: "=" in text,
    "markdown_bold": lambda text, n: "**" in text,
    "paragraphs": lambda text, n: "\n\n" in text,
    "french": lambda text, n: _is_french(text),
}


def _is_french(text: str) -> bool:
    from draftadapt.smollm2.task import is_french

    return is_french(text)


def make_replies(target: Path, data: Path, instruction: str, n: int, temperature: float, seed: int,
                 max_tokens: int = 128) -> None:
    """The target's replies to ``n`` of the SmolLM2 world's problems (drawn with ``seed`` + 4242)
    asked with ``instruction`` instead of the task's, written as ``data``/train.jsonl (and an
    empty heldout.jsonl) for :func:`load_replies`; nothing is done where train.jsonl exists."""
    if (data / "train.jsonl").is_file():
        return
    from transformers import AutoTokenizer

    from draftadapt.data.sequences import as_sequences, save_sequences
    from draftadapt.engine.rollout import RolloutEngine
    from draftadapt.smollm2 import task

    tok = AutoTokenizer.from_pretrained(str(target))
    problems = task.sample_problems(n, seed=seed + 4242)
    # the world's own chat framing (task.render), its instruction swapped for the candidate's
    prompts = [tok(task.render(tok, p["question"]).replace(task.INSTRUCTION, instruction)).input_ids for p in problems]
    engine = RolloutEngine(target, None, max_model_len=512, max_num_seqs=64, kv_cache_gib=1.0, seed=seed)
    try:
        result = engine.generate(prompts, temperature=temperature, max_tokens=max_tokens, seed=seed, progress=True)
    finally:
        engine.close()
    data.mkdir(parents=True, exist_ok=True)
    save_sequences(data / "heldout.jsonl", [])
    save_sequences(data / "train.jsonl", as_sequences(result.rollouts))  # last: its presence marks the data complete


def load_replies(data: Path, rows: int, seed: int) -> list[dict]:
    """Up to ``rows`` replies: every held-out one, then training ones in a seeded order."""
    def read(name):
        path = data / name
        if not path.is_file():
            raise SystemExit(f"error: {path} does not exist; --data is a pretrain run's data/ directory "
                             "(heldout.jsonl and train.jsonl)")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    train = read("train.jsonl")
    random.Random(seed).shuffle(train)
    return (read("heldout.jsonl") + train)[:rows]


def score_each(target: Path, draft: Path, replies: list[dict], k: int, temperature: float):
    """Per reply, the draft's simulated acceptance counts (AcceptanceStats), one target forward each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.capture.hidden import iter_captured
    from draftadapt.data.sequences import as_sequences, collate
    from draftadapt.progress import progress
    from draftadapt.train.methods import method_for
    from draftadapt.train.trainer import score_draft

    tok = AutoTokenizer.from_pretrained(str(target))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    method = method_for("eagle3")
    head = method.load(draft, target).eval()
    capture = method.target_capture(model, head, temperature)
    out = []
    for r in progress(iterable=replies, desc="replies"):
        seqs = as_sequences([r])
        visited, _ = score_draft(head, iter_captured(capture, [collate(seqs, pad)]), k)
        out.append((tok.decode(r["response_ids"], skip_special_tokens=True), len(r["response_ids"]), visited))
    return out


def group(scored, k: int) -> dict:
    from draftadapt.metrics.acceptance import AcceptanceStats

    def total(items):
        if not items:
            return None
        s = AcceptanceStats(k)
        for _, _, stats in items:
            s = s + stats
        return {"acceptance": round(s.length, 3), "replies": len(items),
                "mean_tokens": round(sum(n for _, n, _ in items) / len(items), 1)}

    result = {"all": total(scored), "styles": {}}
    for name, test in STYLES.items():
        yes = [x for x in scored if test(x[0], x[1])]
        no = [x for x in scored if not test(x[0], x[1])]
        result["styles"][name] = {"share": round(len(yes) / len(scored), 3), "with": total(yes), "without": total(no)}
    return result


def extremes(scored, n: int) -> tuple[list, list]:
    """The ``n`` replies with the lowest and the ``n`` with the highest acceptance, as
    (acceptance, tokens, text), lowest first in both."""
    ranked = sorted(((stats.length, tokens, text) for text, tokens, stats in scored), key=lambda x: x[0])
    return ranked[:n], ranked[-n:] if n else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's model directory")
    ap.add_argument("--draft", required=True, help="the frozen Eagle-3 head")
    ap.add_argument("--data", required=True, help="a pretrain run's data/ directory (the target's own replies)")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", type=int, default=0, help="also print the N hardest and N easiest replies")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--instruction", default="",
                    help="make --data first: the target's replies to --rows world problems asked with this instruction")
    a = ap.parse_args(argv)
    if a.rows < 1:
        ap.error(f"--rows {a.rows}: give at least 1")
    if a.show < 0:
        ap.error(f"--show {a.show}: give 0 (none) or the number of replies to print from each end")
    import torch

    torch.set_num_threads(a.threads)
    if a.instruction:
        make_replies(Path(a.target), Path(a.data), a.instruction, a.rows, a.temperature, a.seed)
    scored = score_each(Path(a.target), Path(a.draft), load_replies(Path(a.data), a.rows, a.seed), a.k, a.temperature)
    result = group(scored, a.k)
    print(f"all: {result['all']}")
    for name, g in result["styles"].items():
        w, wo = g["with"], g["without"]
        print(f"{name:15s} share {g['share']:.1%}  acceptance with {w and w['acceptance']} / without "
              f"{wo and wo['acceptance']}  tokens {w and w['mean_tokens']} / {wo and wo['mean_tokens']}")
    low, high = extremes(scored, a.show)
    for title, rows in (("hardest", low), ("easiest", high)):
        if rows:
            print(f"{title}:")
            for acc, tokens, text in rows:
                print(f"  {acc:.3f} {tokens:4d} tokens  {text[:100]!r}")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
