"""The built toy target: the result `draftadapt toy build` reports, and both loaders read it."""

from __future__ import annotations

import json

import pytest

from draftadapt.toy import task

pytestmark = pytest.mark.integration  # builds (or reuses) the toy world


@pytest.fixture(autouse=True)
def threads_put_back():
    """These tests sample on one thread; the suite's thread count is put back after each (a
    count left at 1 was the leak tests/conftest.py named here)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_build_reports_partial_accuracy(toy_target):
    """Issue 2 asks for 20-60% accuracy at temperature 1 so RL has room to improve; the
    default build (300 steps, seed 0) measured 0.36 in 250 s on 2 cores. Tolerance: 0.15-0.70 (256 held-out
    problems, one sample each: the standard error alone is about 0.03)."""
    result_file = toy_target / "build_result.json"
    if not result_file.is_file():  # a toy passed in with DRAFTADAPT_TEST_TOY: its toy.json
        result_file = toy_target / "toy.json"
    result = json.loads(result_file.read_text())
    assert 0.15 <= result["accuracy"] <= 0.70, result
    assert 3_000_000 <= result["params"] <= 4_000_000, result  # 16 layers x 128: 3,428,480
    heldout = task.load_heldout(toy_target)
    assert len(heldout) >= 64
    assert all(task.answer_for(p["prompt"]) == p["answer"] for p in heldout)


def test_transformers_loads_and_solves_greedily(toy_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(toy_target))
    tok = AutoTokenizer.from_pretrained(str(toy_target))
    problems = task.load_heldout(toy_target)[:32]
    from draftadapt.toy.build import sample

    torch.set_num_threads(1)
    completions = sample(model, tok, [p["prompt"] for p in problems], temperature=0.0, max_new_tokens=96)
    solved = sum(task.reward(p, c) for p, c in zip(problems, completions)) / len(problems)
    # Greedy decoding skips the slips the target imitates at T=1: measured 0.77 on 128 problems.
    assert solved >= 0.4, (solved, completions[:3])


def test_sft_stage_makes_verbose_rare_but_still_well_written(toy_target):
    """The build ends with a terse-only SFT stage until the verbose style's probability is at
    most 0.04 (checked every 2 steps, so it can undershoot: 0.024 measured from 0.42). The
    policy must still write verbose answers when put on that path: the demo's RL moves it there.
    Tolerance: probability in [0.003, 0.08]; greedy verbose solving >= 0.4 of 32 problems
    (measured 0.45 at T=1 on 128 after the stage, greedy is higher)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.toy.build import sample, verbose_probability

    model = AutoModelForCausalLM.from_pretrained(str(toy_target))
    tok = AutoTokenizer.from_pretrained(str(toy_target))
    torch.set_num_threads(1)
    heldout = task.load_heldout(toy_target)
    p = verbose_probability(model, tok, heldout[:128])
    assert 0.003 <= p <= 0.08, p
    problems = heldout[:32]
    starts = [f"{task.parse_prompt(q['prompt'])[2]}: " for q in problems]
    completions = sample(model, tok, [q["prompt"] + s for q, s in zip(problems, starts)], temperature=0.0,
                         max_new_tokens=96)
    completions = [s + c for s, c in zip(starts, completions)]
    assert all(task.style_of(c) == "verbose" for c in completions)
    solved = sum(task.reward(q, c) for q, c in zip(problems, completions)) / len(problems)
    assert solved >= 0.4, (solved, completions[:3])


def test_same_seed_builds_the_same_target(tmp_path):
    """A build runs a fixed number of steps (no wall-clock stop by default), so one seed gives one
    target on any machine speed: the demo's world, and its numbers, depend on the seed only.
    Two small builds (3 steps of a 1-layer model) must write byte-identical weights; a third with
    another seed must not."""
    import hashlib

    from draftadapt.toy.build import ToyTrainConfig, build
    from draftadapt.toy.model import ToyModelConfig

    def small(out, seed):
        cfg = ToyTrainConfig(model=ToyModelConfig(num_layers=1, hidden_size=64, intermediate_size=128),
                             steps=3, warmup_steps=1, batch_size=8, heldout=8, max_new_tokens=24,
                             settle_verbose_prob=0.0)
        assert cfg.max_train_seconds == 0.0  # the default: no wall-clock stop
        result = build(str(out), seed=seed, cfg=cfg)
        assert result["steps"] == 3, result
        return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()

    a, b, c = small(tmp_path / "a", 0), small(tmp_path / "b", 0), small(tmp_path / "c", 1)
    assert a == b
    assert a != c
