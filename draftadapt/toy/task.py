"""The toy task family: column arithmetic with a worked answer and a checkable result.

A problem is a prompt such as ``"347+85="``; its response works the columns right to
left and ends in the final answer after ``#``::

    347+85=   7+5=12 4+8+1=13 3+1=4 #432                      (style "terse")
              c1 7+5=12, c2 4+8+1=13, c3 3+1=4, so #432       (style "verbose")
    4096*7=   6*7=42 9*7+4=67 0*7+6=6 4*7=28 #28672           (style "terse")

Two operations share the same right-to-left column walk: ``a+b`` (a, b up to 4 digits)
and ``a*d`` (a up to 4 digits, d one digit). The training data mixes the styles at
random, so a policy has a style choice that RL can shift; the reward checks only the
final answer. Responses are 15-75 characters of mostly predictable text (the worked
steps), which is what a speculative draft can learn to guess.

Everything here is pure and deterministic given a seed: ``sample_problems(n, seed)``
returns the same list on every machine.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

STYLES = ("terse", "verbose")
OPS = ("+", "*")
MAX_DIGITS = 4  # operand length; responses stay under 80 characters at this size

# Every character a prompt or a response can contain; the tokenizer is built from it.
ALPHABET = "0123456789+*=#:,. cos"

_PROMPT_RE = re.compile(r"^\s*(\d+)([+*])(\d+)=\s*$")
_FINAL_RE = re.compile(r"#(\d+)\s*$")


def _digits(rng: random.Random, lo: int, hi: int) -> int:
    """A number whose length is uniform in [lo, hi] digits (no leading zero)."""
    n = rng.randint(lo, hi)
    return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)


def solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operation {op!r}; the toy task has {OPS}")


def _column_steps(a: int, op: str, b: int) -> list[str]:
    """One string per column, right to left: ``"4+8+1=13"`` (the carry in comes last)."""
    steps, carry = [], 0
    if op == "+":
        # The shorter operand is padded with zeros so every column reads "x+y" or "x+y+c".
        width = max(len(str(a)), len(str(b)))
        da, db = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
        for x, y in zip(da, db):
            total = int(x) + int(y) + carry
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
            carry = total // 10
    else:
        for ch in str(a)[::-1]:
            total = int(ch) * b + carry
            steps.append(f"{ch}*{b}" + (f"+{carry}" if carry else "") + f"={total}")
            carry = total // 10
    return steps


def format_response(a: int, op: str, b: int, style: str) -> str:
    """The worked answer for ``a op b`` in one of ``STYLES``."""
    steps = _column_steps(a, op, b)
    answer = solve(a, op, b)
    if style == "terse":
        return " ".join(steps) + f" #{answer}"
    if style == "verbose":
        return ", ".join(f"c{i + 1} {s}" for i, s in enumerate(steps)) + f", so #{answer}"
    raise ValueError(f"unknown style {style!r}; the toy task has {STYLES}")


def make_problem(rng: random.Random, style: str | None = None) -> dict:
    """One problem: ``{"prompt", "answer", "response", "style"}`` drawn from ``rng``.

    ``answer`` is the final result as a decimal string; ``response`` the worked answer
    in ``style`` (drawn at random from ``STYLES`` when None).
    """
    op = rng.choice(OPS)
    if op == "+":
        a, b = _digits(rng, 1, MAX_DIGITS), _digits(rng, 1, MAX_DIGITS)
    else:
        a, b = _digits(rng, 1, MAX_DIGITS), rng.randint(2, 9)
    style = style if style is not None else rng.choice(STYLES)
    return {
        "prompt": f"{a}{op}{b}=",
        "answer": str(solve(a, op, b)),
        "response": format_response(a, op, b, style),
        "style": style,
    }


def sample_problems(n: int, seed: int, style: str | None = None) -> list[dict]:
    """``n`` problems from ``random.Random(seed)``: the same list for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng, style) for _ in range(n)]


def answer_for(prompt: str) -> str:
    """The correct final answer for a prompt such as ``"347+85="``."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(
            f"prompt {prompt!r} is not a toy problem; expected digits, '+' or '*', digits, '='"
        )
    return str(solve(int(m.group(1)), m.group(2), int(m.group(3))))


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
    return float(got is not None and got.lstrip("0") == str(answer).lstrip("0"))


def style_of(completion: str) -> str:
    """Which style a completion is written in (``"verbose"`` if it numbers its columns)."""
    return "verbose" if completion.lstrip().startswith("c1 ") else "terse"


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
