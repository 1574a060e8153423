"""Acceptance math: hand-computed cases, perfect and useless drafts, the visited-start walk."""

from __future__ import annotations

import math

import pytest
import torch

from draftadapt.metrics.acceptance import (
    AcceptanceStats,
    expected_acceptance_length,
    greedy_accept_prob,
    joint_accept,
    sampled_accept_prob,
    shift_left,
    simulate_acceptance,
    visited_starts,
)


def test_expected_length_hand_computed():
    # 1 + 0.9 + 0.9*0.8 + 0.9*0.8*0.5 = 2.98
    a = torch.tensor([0.9, 0.8, 0.5])
    assert expected_acceptance_length(a).item() == pytest.approx(2.98)
    assert expected_acceptance_length(torch.ones(3)).item() == pytest.approx(4.0)
    assert expected_acceptance_length(torch.zeros(3)).item() == pytest.approx(1.0)
    # a zero early cuts everything after it
    assert expected_acceptance_length(torch.tensor([0.5, 0.0, 1.0])).item() == pytest.approx(1.5)


def test_greedy_and_sampled_accept_prob():
    p = torch.tensor([0.1, 0.6, 0.3])
    assert greedy_accept_prob(p.log(), torch.tensor(1)).item() == pytest.approx(0.6)
    # sampled draft q: sum min(p, q) = 0.1 + 0.2 + 0.3
    q = torch.tensor([0.5, 0.2, 0.3])
    assert sampled_accept_prob(p, q).item() == pytest.approx(0.6)
    assert sampled_accept_prob(p, p).item() == pytest.approx(1.0)


def test_joint_accept_gates_on_earlier_matches():
    match = torch.tensor([[[True, False, True]]])
    p = torch.tensor([[[0.9, 0.7, 0.4]]])
    valid = torch.ones_like(match)
    # pos 0: p0; pos 1: 1[m0] * p1; pos 2: 1[m0] 1[m1] p2 = 0
    assert joint_accept(match, p, valid)[0, 0].tolist() == pytest.approx([0.9, 0.7, 0.0])
    valid[..., 1] = False  # position past the end of the sequence: never accepted
    assert joint_accept(match, p, valid)[0, 0].tolist() == pytest.approx([0.9, 0.0, 0.0])


def test_visited_starts_walk():
    # start 0 accepts 2 (emits 3 tokens) -> next start 3, which accepts 0 -> start 4 ...
    k = 3
    match = torch.zeros(1, 8, k, dtype=torch.bool)
    match[0, 0] = torch.tensor([True, True, False])
    match[0, 4] = torch.tensor([True, True, True])
    valid = torch.ones_like(match)
    ok = torch.ones(1, 8, dtype=torch.bool)
    v = visited_starts(match, valid, ok)[0]
    assert v.nonzero().flatten().tolist() == [0, 3, 4]  # 4 + 3 + 1 = 8 is past the end


def _toy_case(v: int = 6, t: int = 10, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (2, t), generator=g)
    logits = torch.randn(2, t, v, generator=g) * 3
    target_logp = torch.log_softmax(logits, -1)  # slot u: distribution of token u + 1
    loss_mask = torch.zeros(2, t, dtype=torch.bool)
    loss_mask[:, 2 : t - 1] = True  # prompt of 3 tokens; slots 2..t-2 predict the response
    return ids, target_logp, loss_mask


def test_perfect_draft_reaches_k_plus_one_and_useless_draft_one():
    k = 3
    v, t = 6, 40
    ids, _, loss_mask = _toy_case(v, t, k)
    # A deterministic target (p = 1 on the data's next token) and a draft proposing exactly it.
    onehot = torch.nn.functional.one_hot(shift_left(ids, 1, 0), v).float()  # slot u -> token u + 1
    target_logp = torch.log(onehot.clamp_min(1e-12))
    perfect = [shift_left(onehot, i + 1, 0.0) * 10 for i in range(k)]  # step i at slot t -> token t+i+2
    visited, uniform = simulate_acceptance(perfect, torch.arange(v), target_logp, ids, loss_mask)
    assert visited.length == pytest.approx(k + 1, abs=1e-6)
    assert visited.per_position == pytest.approx([1.0] * k)
    # every start counted: the last few slots cannot draft a full k (sequence end), so < k+1
    assert uniform.length < k + 1
    # useless: always proposes token 0, which the target never emits
    useless = [torch.zeros(2, t, v) for _ in range(k)]
    for lg in useless:
        lg[..., 0] = 10.0
    target_logp = torch.full((2, t, v), math.log(1 / (v - 1)))
    target_logp[..., 0] = -float("inf")
    visited, uniform = simulate_acceptance(useless, torch.arange(v), target_logp, ids.clamp_min(1), loss_mask)
    assert visited.length == pytest.approx(1.0, abs=1e-6)
    assert uniform.length == pytest.approx(1.0, abs=1e-6)


def test_simulation_hand_computed_single_start():
    # One sequence [a, b, c, d, e] with prompt [a, b]: slots 1..3 predict the response c, d, e.
    # Slot t drafts right after token t + 1, so the first drafting start is slot 1 (after c).
    k = 2
    v = 5
    ids = torch.tensor([[0, 1, 2, 3, 4]])
    loss_mask = torch.tensor([[False, True, True, True, False]])
    target_logp = torch.full((1, 5, v), math.log(0.1))
    target_logp[0, 2, 3] = math.log(0.6)  # p(token 3 = d | ..c) = 0.6
    target_logp[0, 3, 4] = math.log(0.6)  # p(token 4 = e | ..d) = 0.6
    # slot 1 (draft after c): proposes d then e: both match the data
    step0 = torch.zeros(1, 5, v)
    step1 = torch.zeros(1, 5, v)
    step0[0, 1, 3] = 5.0
    step1[0, 1, 4] = 5.0
    visited, uniform = simulate_acceptance([step0, step1], torch.arange(v), target_logp, ids, loss_mask)
    # starts: slots 1 and 2 (slot 3 has no token 5); the walk visits slot 1, accepts 2 -> done
    assert visited.drafts == 1
    assert visited.accepted_per_pos == pytest.approx([0.6, 0.6])  # pos 1 gated on the match at pos 0
    assert visited.length == pytest.approx(2.2)
    assert uniform.drafts == 2  # slot 2 proposes token 0 (argmax of zeros): p = 0.1, no match
    assert uniform.accepted_per_pos[0] == pytest.approx(0.6 + 0.1)


def test_stats_add_and_roundtrip():
    a = AcceptanceStats(2, 4.0, [3.0, 2.0])
    b = AcceptanceStats(2, 6.0, [3.0, 1.0])
    c = a + b
    assert c.length == pytest.approx(1 + 9 / 10)
    assert c.per_position == pytest.approx([0.6, 0.3])
    assert AcceptanceStats.from_tensor(c.to_tensor()).accepted_per_pos == pytest.approx(c.accepted_per_pos)
    with pytest.raises(ValueError):
        a + AcceptanceStats(3)


def test_engine_counters_are_the_same_type():
    # an engine's cumulative counters start empty (k unknown) and take k from the first report;
    # a generate call's counts are the difference of two snapshots
    before = AcceptanceStats()
    after = before + AcceptanceStats(3, 10, [8, 5, 2], draft_tokens=30)
    delta = after - before
    assert (delta.k, delta.drafts, delta.draft_tokens, delta.accepted_tokens) == (3, 10, 30, 15)
    assert delta.acceptance_length == delta.length == pytest.approx(2.5)
    assert delta.per_position_rate == delta.per_position == pytest.approx([0.8, 0.5, 0.2])
    assert delta.to_dict()["per_position_acceptance"] == pytest.approx([0.8, 0.5, 0.2])
    plain = AcceptanceStats() - AcceptanceStats()  # an engine without a draft
    assert plain.per_position == [] and math.isnan(plain.length)
