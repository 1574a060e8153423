"""The toy world's pure parts: generator, reward, tokenizer. No model training here."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from transformers import AutoTokenizer

from draftadapt.toy import task
from draftadapt.toy.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, build_tokenizer


def test_generator_is_deterministic_per_seed():
    assert task.sample_problems(50, seed=3) == task.sample_problems(50, seed=3)
    assert task.sample_problems(50, seed=3) != task.sample_problems(50, seed=4)
    rng_a, rng_b = random.Random(7), random.Random(7)
    assert [task.make_problem(rng_a) for _ in range(5)] == [task.make_problem(rng_b) for _ in range(5)]


def test_problems_fit_the_budget_and_mix_styles():
    problems = task.sample_problems(5000, seed=0)
    for p in problems:
        assert set(p["prompt"] + p["response"]) <= set(task.ALPHABET)
        # <s> + prompt + response + </s> within 128 tokens
        assert len(p["prompt"]) + len(p["response"]) + 2 <= 128
        assert p["response"].endswith(f"#{p['answer']}")
        assert task.answer_for(p["prompt"]) == p["answer"]
        assert task.style_of(p["response"]) == p["style"]
    assert {p["style"] for p in problems} == set(task.STYLES)
    assert sum(len(p["response"]) for p in problems) / len(problems) >= 30


@pytest.mark.parametrize("style", task.STYLES)
def test_worked_steps_are_right(style):
    expected = {
        "terse": "3:37+8=45 2:45+8=53 1:53+8=61 #61",
        "verbose": "3: 37+8=45, 2: 45+8=53, 1: 53+8=61, so #61",
    }
    r = task.format_response(37, 8, 3, style)
    assert r == expected[style]
    assert task.style_of(r) == style
    assert task.format_prompt(37, 8, 3) == "37+8 x3="
    assert task.parse_prompt("37+8 x3=") == (37, 8, 3)
    assert task.parse_prompt("62-13 x4=") == (62, -13, 4)
    assert task.answer_for("62-13 x4=") == "10"
    assert task.format_response(62, -13, 2, "terse") == "2:62-13=49 1:49-13=36 #36"


def test_values_stay_in_range():
    for p in task.sample_problems(3000, seed=9):
        values = [int(x) for x in re.findall(r"\d+", p["prompt"] + p["response"])]  # labels too
        assert all(0 <= v <= task.MAX_VALUE for v in values)
        start, step, repeats = task.parse_prompt(p["prompt"])
        assert 2 <= repeats <= task.MAX_REPEATS and 1 <= abs(step) <= task.MAX_STEP
        assert p["response"].count("=") == repeats


def test_reward_accepts_correct_and_rejects_wrong():
    problems = task.sample_problems(300, seed=1)
    for p in problems:
        assert task.reward(p, p["response"]) == 1.0
        assert task.reward(p["prompt"], p["response"]) == 1.0
        wrong = str(int(p["answer"]) + 1)
        assert task.reward(p, p["response"].rsplit("#", 1)[0] + "#" + wrong) == 0.0
    p = {"prompt": "30+6 x2=", "answer": "42"}
    assert task.reward(p, "#42") == 1.0
    assert task.reward(p, "2:30+6=36 1:36+6=42 #42 ") == 1.0  # trailing whitespace is fine
    assert task.reward(p, "2:30+6=36 1:36+6=42 #42 more") == 0.0  # must end with the answer
    assert task.reward(p, "2:30+6=36 1:36+6=42 #420") == 0.0
    assert task.reward(p, "2:30+6=36 1:36+6=42 42") == 0.0  # no final-answer marker
    assert task.reward(p, "2:30+6=36 1:36+6=41 #42") == 1.0  # only the final answer counts
    assert task.reward(p, "") == 0.0
    assert task.reward("9-4 x2=", "#1") == 1.0
    with pytest.raises(ValueError, match="not a toy problem"):
        task.reward("what is 2+2?", "#4")


def test_heldout_round_trip(tmp_path):
    problems = task.sample_problems(10, seed=2)
    task.write_heldout(tmp_path / "heldout.jsonl", problems)
    assert task.load_heldout(tmp_path) == problems
    assert task.load_heldout(tmp_path / "heldout.jsonl") == problems


def test_tokenizer_round_trips_every_symbol():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    assert len(tok) <= 64
    for ch in task.ALPHABET:
        ids = tok(ch, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] not in (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
        assert tok.decode(ids) == ch
    text = task.ALPHABET + task.ALPHABET[::-1]
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_prompt_and_response_ids_concatenate():
    tok = build_tokenizer()
    for p in task.sample_problems(20, seed=5):
        whole = tok(p["prompt"] + p["response"]).input_ids
        parts = tok(p["prompt"]).input_ids + tok(p["response"], add_special_tokens=False).input_ids
        assert whole == parts


def test_saved_tokenizer_reloads_with_autotokenizer(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert again.get_vocab() == tok.get_vocab()
    for p in task.sample_problems(20, seed=6):
        text = p["prompt"] + p["response"]
        assert again(text).input_ids == tok(text).input_ids
        assert again.decode(again(text).input_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("model_type,arch", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                             ("qwen2", "MiMoForCausalLM")])
def test_every_toy_config_loads_the_same_tokenizer(tmp_path, model_type, arch):
    # transformers 5 loads its registered Qwen2Tokenizer (byte-level BPE) for model_type qwen2
    # whatever the directory's tokenizer class says; the MTP toy's config must say qwen2. Every
    # loader has to give this tokenizer's ids and text back, spaces included.
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
    again = AutoTokenizer.from_pretrained(tmp_path)
    for p in task.sample_problems(20, seed=7):
        text = p["prompt"] + p["response"]
        assert " " in text and again(text).input_ids == tok(text).input_ids
        assert again.decode(tok(text).input_ids, skip_special_tokens=True) == text


def test_verbose_probability_reads_the_space_token():
    # the style choice is the token after the first countdown label: a space (verbose) or a
    # digit (terse); the probability must be read at the space's id whatever its vocabulary
    # symbol (a lookup of the string " " found <unk> once the vocabulary wrote it "Ġ")
    import torch

    from draftadapt.toy.build import verbose_probability

    tok = build_tokenizer()
    space = tok(" ", add_special_tokens=False).input_ids[0]
    assert space not in (PAD_ID, BOS_ID, EOS_ID, UNK_ID)

    class Fixed(torch.nn.Module):  # logits that put 0.7 on the space, 0.3 on the digit "1"
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            logits = torch.full((*input_ids.shape, len(tok)), -1e9)
            logits[..., space] = math.log(0.7)
            logits[..., tok("1", add_special_tokens=False).input_ids[0]] = math.log(0.3)
            return type("Out", (), {"logits": logits})()

    assert verbose_probability(Fixed(), tok, task.sample_problems(4, seed=1)) == pytest.approx(0.7, abs=1e-6)
