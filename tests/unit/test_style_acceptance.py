"""scripts/style_acceptance.py's pure parts: which replies each style takes, and the sums per group
(the scoring itself is the trainer's score_draft, tested with it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftadapt.metrics.acceptance import AcceptanceStats

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("style_acceptance", REPO / "scripts" / "style_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stats(drafts: int, accepted: list[int]) -> AcceptanceStats:
    return AcceptanceStats(k=3, drafts=drafts, accepted_per_pos=accepted)


def test_styles_and_sums(script):
    scored = [("She has 31.\nAnswer: 31", 10, _stats(4, [2, 1, 0])),
              ("1. add 3\n2. so 7 = 4 + 3", 80, _stats(4, [1, 0, 0])),
              ("**7**\n\nthe end", 70, _stats(2, [2, 2, 2]))]
    g = script.group(scored, 3)
    assert g["all"]["replies"] == 3 and g["all"]["mean_tokens"] == pytest.approx(160 / 3, abs=0.05)
    assert g["all"]["acceptance"] == pytest.approx(1 + (3 + 1 + 6) / 10, abs=1e-3)  # 1 + accepted / drafts
    s = g["styles"]
    assert (s["answer_line"]["share"], s["short"]["share"]) == (pytest.approx(1 / 3, abs=1e-3), pytest.approx(1 / 3, abs=1e-3))
    assert s["answer_line"]["with"]["acceptance"] == pytest.approx(1.75)
    assert s["numbered_steps"]["with"]["replies"] == 1 and s["equation"]["with"]["replies"] == 1
    assert s["markdown_bold"]["with"]["acceptance"] == pytest.approx(4.0) and s["paragraphs"]["with"]["replies"] == 1
    assert s["markdown_bold"]["without"]["acceptance"] == pytest.approx(1.5)
    assert s["french"]["share"] == 0.0 and s["french"]["with"] is None


def test_a_reply_in_french_is_its_own_style(script):
    scored = [("Elle a donc 35 + 28 = 63 autocollants, et chaque ami en a 9.\nAnswer: 63", 30, _stats(4, [1, 0, 0])),
              ("She has 35 + 28 = 63 stickers.\nAnswer: 63", 20, _stats(4, [3, 2, 1]))]
    s = script.group(scored, 3)["styles"]
    assert s["french"]["share"] == 0.5 and s["french"]["with"]["acceptance"] == pytest.approx(1.25)
    assert s["french"]["without"]["acceptance"] == pytest.approx(2.5) and s["answer_line"]["share"] == 1.0


def test_replies_heldout_first_and_a_missing_file_named(script, tmp_path):
    def write(name, n, base):
        (tmp_path / name).write_text("".join(json.dumps({"prompt_ids": [1], "response_ids": [base + i]}) + "\n"
                                             for i in range(n)))
    write("heldout.jsonl", 2, 100)
    write("train.jsonl", 5, 200)
    rows = script.load_replies(tmp_path, 4, seed=0)
    assert [r["response_ids"][0] for r in rows[:2]] == [100, 101] and len(rows) == 4
    assert all(r["response_ids"][0] >= 200 for r in rows[2:])
    with pytest.raises(SystemExit, match="train.jsonl does not exist"):
        script.load_replies(tmp_path / "nowhere", 4, seed=0)


def test_extremes_hardest_and_easiest(script):
    scored = [("b", 5, _stats(4, [1, 0, 0])), ("a", 9, _stats(4, [4, 4, 0])), ("c", 7, _stats(4, [0, 0, 0]))]
    low, high = script.extremes(scored, 1)
    assert low == [(pytest.approx(1.0), 7, "c")] and high == [(pytest.approx(3.0), 9, "a")]
    low, high = script.extremes(scored, 5)  # more than there are: every reply, in order, at both ends
    assert [t for _, _, t in low] == ["c", "b", "a"] == [t for _, _, t in high]
    assert script.extremes(scored, 0) == ([], [])
