"""The toy task family: a chain of additions and subtractions, worked left to right.

A problem is a prompt such as ``"7+5-3+18-2="``; its response works the chain one term
at a time and ends in the final answer after ``#``::

    7+5-3+18-2=   7+5=12 12-3=9 9+18=27 27-2=25 #25                         (style "terse")
                  7+5 is 12, 12-3 is 9, 9+18 is 27, 27-2 is 25, so #25      (style "verbose")

Chains have 2-``MAX_TERMS`` terms, mostly single digits with some two-digit ones; the
running total never goes below zero. Longer chains and two-digit terms are harder, so a
small model trained for minutes solves part of the task: room for RL to improve. The
training data mixes the styles at random, so a policy has a style choice that RL can
shift; the reward checks only the final answer. Responses are mostly predictable text
(each step starts by copying the previous total and the next term from the prompt),
which is what a speculative draft can learn to guess.

Why left to right: each step needs the next term of the prompt, which an induction
head finds (the term after the one used last). Column arithmetic worked right to left
needs digits counted from the end of an operand, which tiny models learn far slower.

Everything here is pure and deterministic given a seed: ``sample_problems(n, seed)``
returns the same list on every machine.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

STYLES = ("terse", "verbose")
MIN_TERMS, MAX_TERMS = 3, 7  # 7 terms of 2 digits, verbose: 120 tokens with <s>, </s>
TWO_DIGIT_P = 0.25  # share of terms drawn from 10-99 instead of 1-9

# Every character a prompt or a response can contain; the tokenizer is built from it.
ALPHABET = "0123456789+-=#, iso"

_PROMPT_RE = re.compile(r"^\s*(\d+(?:[+-]\d+)+)=\s*$")
_TERM_RE = re.compile(r"([+-]?)(\d+)")
_FINAL_RE = re.compile(r"#(\d+)\s*$")


def _terms(prompt: str) -> list[int]:
    """Signed terms of a prompt such as ``"7+5-3="``: [7, 5, -3]."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(
            f"prompt {prompt!r} is not a toy problem; expected numbers joined by '+'/'-', then '='"
        )
    return [int(n) * (-1 if sign == "-" else 1) for sign, n in _TERM_RE.findall(m.group(1))]


def format_response(terms: list[int], style: str) -> str:
    """The worked answer for a chain of signed ``terms`` in one of ``STYLES``."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; the toy task has {STYLES}")
    total, steps = terms[0], []
    for t in terms[1:]:
        new = total + t
        op = f"{total}{'+' if t >= 0 else '-'}{abs(t)}"
        steps.append(f"{op}={new}" if style == "terse" else f"{op} is {new}")
        total = new
    if style == "terse":
        return " ".join(steps) + f" #{total}"
    return ", ".join(steps) + f", so #{total}"


def make_problem(rng: random.Random, style: str | None = None) -> dict:
    """One problem: ``{"prompt", "answer", "response", "style"}`` drawn from ``rng``.

    ``answer`` is the final result as a decimal string; ``response`` the worked answer
    in ``style`` (drawn at random from ``STYLES`` when None).
    """
    n = rng.randint(MIN_TERMS, MAX_TERMS)

    def term() -> int:
        return rng.randint(10, 99) if rng.random() < TWO_DIGIT_P else rng.randint(1, 9)

    terms = [term()]
    total = terms[0]
    for _ in range(n - 1):
        t = term()
        if t <= total and rng.random() < 0.5:
            t = -t
        terms.append(t)
        total += t
    style = style if style is not None else rng.choice(STYLES)
    prompt = str(terms[0]) + "".join(f"{'+' if t >= 0 else '-'}{abs(t)}" for t in terms[1:]) + "="
    return {
        "prompt": prompt,
        "answer": str(total),
        "response": format_response(terms, style),
        "style": style,
    }


def sample_problems(n: int, seed: int, style: str | None = None) -> list[dict]:
    """``n`` problems from ``random.Random(seed)``: the same list for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng, style) for _ in range(n)]


def answer_for(prompt: str) -> str:
    """The correct final answer for a prompt such as ``"7+5-3="``."""
    return str(sum(_terms(prompt)))


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
    """Which style a completion is written in (``"verbose"`` if its first step says "is")."""
    first = completion.lstrip().split(",", 1)[0]
    return "verbose" if " is " in first else "terse"


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
