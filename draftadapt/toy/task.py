"""The toy task family: repeated addition or subtraction, worked one step at a time.

A problem is a prompt such as ``"37+8 x4="`` (start at 37, add 8 four times); its
response works the steps, each labelled with how many remain, and ends in the final
answer after ``#``::

    37+8 x4=   4:37+8=45 3:45+8=53 2:53+8=61 1:61+8=69 #69               (style "terse")
               4: 37+8=45, 3: 45+8=53, 2: 53+8=61, 1: 61+8=69, so #69    (style "verbose")
    62-13 x3=  3:62-13=49 2:49-13=36 1:36-13=23 #23

Starts are 0-99, steps +1 or -1 (``MAX_STEP``), repeats 2-``MAX_REPEATS``; every value
stays in 0-99. The training data has slips (a step written 1 or 10 off, see
``make_problem``), so the trained target solves part of the task at temperature 1 (about
half) and RL has room to improve: fewer slips, more solved problems. The training
data mixes the two styles at random, so a policy has a style choice that RL can shift;
the reward checks only the final answer. Each step copies the previous total and the
step, then adds: responses are mostly predictable text, which is what a speculative
draft learns to guess.

Why this shape: a tiny model trained for three minutes on 2 CPU cores does not learn
to fetch digits counted from the end of an operand (column arithmetic), the n-th term
of a long expression, or to count its own steps; here everything a step needs sits
in the step before it (the countdown label says when to stop).

Everything here is pure and deterministic given a seed: ``sample_problems(n, seed)``
returns the same list on every machine.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

STYLES = ("terse", "verbose")
MAX_REPEATS = 7  # 7 two-digit steps, verbose: <= 112 tokens with <s> and </s>
# Step sizes 1..MAX_STEP. Measured on 2 CPU cores (300 steps, 4 minutes): with steps up to 3
# or 9 the 5M-parameter target copies every number but its units digit stays at chance
# (accuracy at T=1 about 3%); with +/-1 it reaches 47% (greedy 77%).
MAX_STEP = 1
MAX_VALUE = 99  # every total stays in 0..MAX_VALUE, so numbers are 1-2 digits

# Every character a prompt or a response can contain; the tokenizer is built from it.
ALPHABET = "0123456789+-=#:,x so"

_PROMPT_RE = re.compile(r"^\s*(\d+)([+-])(\d+) x(\d+)=\s*$")
_FINAL_RE = re.compile(r"#(\d+)\s*$")


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """``"37+8 x5="`` -> (start 37, signed step 8, repeats 5)."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(
            f"prompt {prompt!r} is not a toy problem; expected start, '+' or '-', step, "
            "' x', repeats, '=' as in '37+8 x5='"
        )
    step = int(m.group(3)) * (1 if m.group(2) == "+" else -1)
    return int(m.group(1)), step, int(m.group(4))


def format_prompt(start: int, step: int, repeats: int) -> str:
    return f"{start}{'+' if step >= 0 else '-'}{abs(step)} x{repeats}="


def format_response(start: int, step: int, repeats: int, style: str,
                    totals: list[int] | None = None) -> str:
    """The worked answer in one of ``STYLES``. ``totals`` (one a step) overrides the
    running totals, which is how ``make_problem`` writes a response with slips."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; the toy task has {STYLES}")
    if totals is None:
        totals = [start + step * (i + 1) for i in range(repeats)]
    sign, parts = "+" if step >= 0 else "-", []
    for before, after in zip([start] + totals[:-1], totals):
        parts.append(f"{before}{sign}{abs(step)}={after}")
    # Countdown labels: the step after "1:" is the answer, so stopping needs no counting.
    if style == "terse":
        return " ".join(f"{repeats - i}:{p}" for i, p in enumerate(parts)) + f" #{totals[-1]}"
    return ", ".join(f"{repeats - i}: {p}" for i, p in enumerate(parts)) + f", so #{totals[-1]}"


def _slipped_totals(start: int, step: int, repeats: int, rng: random.Random, slip: float) -> list[int]:
    """Running totals where each step, with probability ``slip``, comes out 1 or 10 off
    (staying in 0..MAX_VALUE); later steps carry on from the wrong total, as a person would."""
    totals, total = [], start
    for _ in range(repeats):
        total += step
        if slip > 0 and rng.random() < slip:
            off = rng.choice((-10, -1, 1, 10))
            total = total + off if 0 <= total + off <= MAX_VALUE else total - off
        totals.append(total)
    return totals


def make_problem(rng: random.Random, style: str | None = None, slip: float = 0.0) -> dict:
    """One problem: ``{"prompt", "answer", "response", "style"}`` drawn from ``rng``.

    ``answer`` is the correct result as a decimal string; ``response`` the worked answer
    in ``style`` (drawn at random from ``STYLES`` when None). With ``slip`` > 0 each step
    of the response is wrong with that probability (training data for the toy target:
    its accuracy at temperature 1 stays partial, so RL has something to fix).
    """
    repeats = rng.randint(2, MAX_REPEATS)
    size = rng.randint(1, min(MAX_STEP, MAX_VALUE // repeats))
    step = size if rng.random() < 0.5 else -size
    span = size * repeats
    # start so that every total stays in 0..MAX_VALUE
    start = rng.randint(0, MAX_VALUE - span) if step > 0 else rng.randint(span, MAX_VALUE)
    style = style if style is not None else rng.choice(STYLES)
    totals = _slipped_totals(start, step, repeats, rng, slip) if slip > 0 else None
    return {
        "prompt": format_prompt(start, step, repeats),
        "answer": str(start + step * repeats),
        "response": format_response(start, step, repeats, style, totals),
        "style": style,
    }


def sample_problems(n: int, seed: int, style: str | None = None) -> list[dict]:
    """``n`` problems from ``random.Random(seed)``: the same list for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng, style) for _ in range(n)]


def answer_for(prompt: str) -> str:
    """The correct final answer for a prompt such as ``"37+8 x5="``."""
    start, step, repeats = parse_prompt(prompt)
    return str(start + step * repeats)


def extract_answer(completion: str) -> str | None:
    """The final answer a completion commits to: the digits after its last ``#``, if the
    completion ends there (trailing whitespace allowed). None when it does not."""
    m = _FINAL_RE.search(completion)
    return m.group(1) if m else None


def reward(problem: str | dict, completion: str) -> float:
    """1.0 when ``completion`` ends in ``#<correct answer>``, else 0.0.

    ``problem`` is a prompt string (the answer is recomputed from it) or a problem dict
    with an ``"answer"`` (as returned by ``make_problem`` or ``load_heldout``). Only the
    final answer counts: the worked steps and the style are not checked.
    """
    answer = problem["answer"] if isinstance(problem, dict) else answer_for(problem)
    got = extract_answer(completion)
    return float(got is not None and int(got) == int(answer))


def style_of(completion: str) -> str:
    """Which style a completion is written in: ``"verbose"`` if its first label is
    followed by a space (``"4: 37+8=45, ..."``), else ``"terse"`` (``"4:37+8=45 ..."``)."""
    return "verbose" if re.match(r"\s*\d+: ", completion) else "terse"


def write_heldout(path: str | Path, problems: list[dict]) -> None:
    """One JSON object a line, each with at least ``prompt`` and ``answer``."""
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps(p) + "\n")


def load_heldout(path: str | Path) -> list[dict]:
    """Read ``heldout.jsonl`` (a file, or a toy model directory that holds one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "heldout.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
