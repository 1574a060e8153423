"""Replay buffer: bounds, eviction order, recency weighting (statistical), held-out split, state."""

import random

import numpy as np
import pytest
import torch

from draftadapt.data.replay import ReplayBuffer
from draftadapt.spool import SpoolReader, SpoolWriter


def fill(buf, versions, length=4):
    """One sequence per version in ``versions``, each with a prompt of its own."""
    return [buf.add([100 + i] + list(range(1, length - 1)), [0], v, source=f"{v}:{i}") for i, v in enumerate(versions)]


def test_add_counts_tokens_bytes_and_keeps_prompt_response_split():
    buf = ReplayBuffer(max_tokens=100)
    item = buf.add([1, 2, 3], [4, 5], 0, tensors={"aux_hidden": torch.zeros(5, 8)})
    assert (len(buf), buf.num_tokens, buf.nbytes) == (1, 5, 5 * 4 + 5 * 8 * 4)
    assert item.sequence().prompt_ids == [1, 2, 3] and item.sequence().response_ids == [4, 5]
    assert buf.newest_version == 0 and buf.version_counts() == {0: 1}


def test_views_are_copied_so_the_byte_bound_is_real():
    big = torch.zeros(1000, 16)
    buf = ReplayBuffer(max_tokens=100)
    item = buf.add([1, 2], [3], 0, tensors={"h": big[10:13]})
    assert item.tensors["h"].untyped_storage().nbytes() == 3 * 16 * 4


def test_token_bound_evicts_oldest_version_first_then_oldest_added():
    buf = ReplayBuffer(max_tokens=20)  # 5 sequences of 4 tokens
    fill(buf, [1, 1, 0, 2, 0])  # async RL: version 0 arrives after version 1
    assert buf.num_tokens == 20 and len(buf) == 5
    fill(buf, [2])
    assert buf.version_counts() == {0: 1, 1: 2, 2: 2}  # the first version-0 sequence went
    assert [it.source for it in buf] == ["0:4", "1:0", "1:1", "2:3", "2:0"]
    fill(buf, [3, 3])
    assert buf.version_counts() == {1: 1, 2: 2, 3: 2}
    assert buf.num_tokens <= 20 and buf.evicted_seqs == 3 and buf.evicted_tokens == 12


def test_byte_bound_evicts_too():
    buf = ReplayBuffer(max_tokens=10_000, max_bytes=3 * (4 * 4 + 4 * 8 * 4))
    for v in range(5):
        buf.add([1, 2], [3, 4], v, tensors={"aux_hidden": torch.zeros(4, 8)})
    assert len(buf) == 3 and buf.nbytes <= buf.max_bytes and min(buf.version_counts()) == 2


def test_adding_an_older_version_to_a_full_buffer_returns_none():
    buf = ReplayBuffer(max_tokens=8)
    fill(buf, [5, 5])
    assert buf.add([1, 2, 3], [0], 1) is None and buf.version_counts() == {5: 2}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[], response_ids=[]), "empty sequence"),
        (dict(policy_version=-1), "policy_version"),
        (dict(prompt_ids=list(range(50))), "exceeds the buffer's max_tokens"),
        (dict(tensors={"h": torch.zeros(3, 3)}), "one row per token"),
    ],
)
def test_add_rejects_bad_input(kwargs, match):
    args = dict(prompt_ids=[1], response_ids=[2], policy_version=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ReplayBuffer(max_tokens=10).add(**args)


def test_constructor_checks():
    for kw in (dict(max_tokens=0), dict(max_tokens=5, recency_decay=1.5), dict(max_tokens=5, holdout_fraction=1.0)):
        with pytest.raises(ValueError):
            ReplayBuffer(**kw)


def test_recency_weighting_matches_decay_statistically():
    """First draws are exactly proportional to count_v * decay^(newest - v).

    10,000 single draws; each version's frequency must be within 4 binomial standard deviations of
    its expected probability (a false failure has probability < 1e-4 per version).
    """
    decay = 0.5
    counts = {0: 40, 1: 30, 2: 20, 3: 10}
    buf = ReplayBuffer(max_tokens=10_000, recency_decay=decay)
    for v, c in counts.items():
        fill(buf, [v] * c)
    w = {v: c * decay ** (3 - v) for v, c in counts.items()}
    z = sum(w.values())
    rng = np.random.default_rng(0)
    trials = 10_000
    hits = dict.fromkeys(counts, 0)
    for _ in range(trials):
        (item,) = buf.sample(n_seqs=1, rng=rng)
        hits[item.policy_version] += 1
    for v in counts:
        p = w[v] / z
        sd = (trials * p * (1 - p)) ** 0.5
        assert abs(hits[v] - trials * p) < 4 * sd, (v, hits[v], trials * p)
    assert buf.weight(3) == 1.0 and buf.weight(0) == decay**3


def test_priority_weighs_draws_by_loss_and_unseen_sequences_as_the_hardest():
    """With ``priority`` a, first draws are proportional to decay^age * loss^a; a sequence never
    trained on counts as the highest loss seen. 20,000 single draws, each class within 4 binomial
    standard deviations of its expected probability."""
    buf = ReplayBuffer(max_tokens=10_000, recency_decay=0.5)
    old = fill(buf, [0] * 10)  # one version back: weight 0.5
    new = fill(buf, [1] * 30)
    buf.prioritize(old, [2.0] * 10)
    buf.prioritize(new[:10], [1.0] * 10)
    buf.prioritize(new[10:20], [4.0] * 10)  # new[20:] not trained on yet: as 4.0
    buf.prioritize(new[20:], [float("nan")] * 10)  # a non-finite loss changes nothing
    assert all(it.priority is None for it in new[20:])
    cls = {it.uid: c for c, its in (("old", old), ("easy", new[:10]), ("hard", new[10:20]), ("unseen", new[20:]))
           for it in its}
    for a, w in ((1.0, {"old": 10 * 0.5 * 2.0, "easy": 10 * 1.0, "hard": 10 * 4.0, "unseen": 10 * 4.0}),
                 (2.0, {"old": 10 * 0.5 * 4.0, "easy": 10 * 1.0, "hard": 10 * 16.0, "unseen": 10 * 16.0})):
        z = sum(w.values())
        rng = np.random.default_rng(1)
        trials = 20_000
        hits = dict.fromkeys(w, 0)
        for _ in range(trials):
            (item,) = buf.sample(n_seqs=1, rng=rng, priority=a)
            hits[cls[item.uid]] += 1
        for c in w:
            p = w[c] / z
            sd = (trials * p * (1 - p)) ** 0.5
            assert abs(hits[c] - trials * p) < 4 * sd, (a, c, hits[c], trials * p)
    # priority 0 ignores the losses; a learned sequence (loss 0) stays drawable
    assert {cls[it.uid] for it in buf.sample(n_seqs=40, rng=0)} == set(w)
    buf.prioritize(new[:10], [0.0] * 10)
    assert {cls[it.uid] for it in buf.sample(n_seqs=40, rng=0, priority=1.0)} == set(w)
    with pytest.raises(ValueError, match="3 losses for 2 items"):
        buf.prioritize(new[:2], [1.0, 2.0, 3.0])
    for bad in (-1.0, float("nan"), 100.0):
        with pytest.raises(ValueError, match="priority is an exponent"):
            buf.sample(n_seqs=1, rng=0, priority=bad)


def test_sample_is_without_replacement_and_respects_n_tokens_and_rng():
    buf = ReplayBuffer(max_tokens=10_000, recency_decay=0.5)
    fill(buf, [0] * 10 + [1] * 10)
    batch = buf.sample(n_seqs=15, rng=1)
    assert len(batch) == 15 and len({it.uid for it in batch}) == 15
    assert len(buf.sample(n_seqs=100, rng=1)) == 20
    by_tokens = buf.sample(n_tokens=10, rng=random.Random(0))
    assert sum(it.num_tokens for it in by_tokens) >= 10 and len(by_tokens) == 3  # 4 tokens each
    assert [it.uid for it in buf.sample(n_seqs=5, rng=7)] == [it.uid for it in buf.sample(n_seqs=5, rng=7)]
    with pytest.raises(ValueError, match="exactly one"):
        buf.sample(rng=0)
    assert ReplayBuffer(10).sample(n_seqs=3) == []


def test_decay_zero_samples_only_the_newest_version():
    buf = ReplayBuffer(max_tokens=10_000, recency_decay=0.0)
    fill(buf, [0] * 10 + [1] * 3)
    assert {it.policy_version for it in buf.sample(n_seqs=13, rng=0)} == {1}


def test_heldout_is_deterministic_never_sampled_and_moves_on_with_the_newest_version():
    buf = ReplayBuffer(max_tokens=10_000, holdout_fraction=0.25, max_heldout=3)
    fill(buf, [0] * 8)
    held0 = buf.heldout()
    assert [it.source for it in held0] == ["0:0", "0:4"]  # positions 0, 4: a quarter, at least one
    held, train = buf.split_recent()
    assert held == held0 and len(train) == 6
    uids = {it.uid for it in held}
    for seed in range(20):
        assert not uids & {it.uid for it in buf.sample(n_seqs=8, rng=seed)}
    fill(buf, [1] * 20)
    assert [it.policy_version for it in buf.heldout()] == [1, 1, 1]  # capped by max_heldout
    assert uids <= {it.uid for it in buf.sample(n_seqs=100, rng=0)}  # old held-out: training data now
    assert len(buf.sample(n_seqs=100, rng=0)) == 28 - 3


def test_grpo_groups_hold_out_whole_prompts_and_train_on_the_rest_of_the_newest_version():
    # 16 prompts x 4 samples, the samples of a prompt added one after another (a GRPO step)
    buf = ReplayBuffer(max_tokens=10_000, holdout_fraction=0.25, max_heldout=64)
    for p in range(16):
        for g in range(4):
            buf.add([200 + p, 1], [g + 1], 0, source=f"p{p}g{g}")
    held, train = buf.split_recent()
    held_prompts = {it.source.split("g")[0] for it in held}
    assert held_prompts == {"p0", "p4", "p8", "p12"}  # a quarter of the prompts, every sample of each
    assert len(held) == 16 and len(train) == 48
    assert not held_prompts & {it.source.split("g")[0] for it in train}
    # the same prompt in the next version is a new draw: held out by its own position there
    buf.add([201, 1], [9], 1, source="v1")
    assert [it.source for it in buf.heldout()] == ["v1"]


def test_a_step_whose_held_out_rollouts_alone_are_added_holds_out_what_adding_all_would():
    """A paused adapter hands over only the rollouts validation scores: chosen by holdout_plan
    before they exist, their prompts numbered by register_prompts, the held-out share is the
    same as a buffer given the whole step (GRPO groups, an older version before, one prompt
    twice in the step)."""
    step = [([300 + (p if p != 5 else 2), 1], [g + 1]) for p in range(9) for g in range(3)]
    full = ReplayBuffer(max_tokens=10_000, holdout_fraction=0.25, max_heldout=64)
    part = ReplayBuffer(max_tokens=10_000, holdout_fraction=0.25, max_heldout=64)
    for buf in (full, part):
        buf.add([400, 1], [1], 6)
        buf.add([300, 1], [1], 7)  # a prompt of the step, already in its version
    plan = part.holdout_plan(7, [p for p, _ in step])
    assert part.holdout_plan(7, [p for p, _ in step]) == plan  # nothing changed
    for p, r in step:
        full.add(p, r, 7)
    part.register_prompts(7, [p for p, _ in step])
    for i in [i for i, held in enumerate(plan) if held]:
        assert part.add(*step[i], 7).holdout
    assert [it.token_ids.tolist() for it in part.heldout()] == [it.token_ids.tolist() for it in full.heldout()]
    # the version's prompts in order: 300 (0th, held), 301, 302, 303, 304 (4th, held), 306, 307,
    # 308; the step's held-out rollouts are the groups of 300 and 304, after the earlier one of 300
    assert sum(plan) == 2 * 3 and len(part.heldout()) == 1 + 6
    # a prompt seen after registration keeps the numbering going, as in the full buffer
    assert part.add([999, 1], [1], 7).holdout == full.add([999, 1], [1], 7).holdout


def test_state_dict_round_trip_through_torch_save(tmp_path):
    buf = ReplayBuffer(max_tokens=50, holdout_fraction=0.5)
    for v in range(4):
        for i in range(2):
            buf.add([1, 2, i], [4], v, tensors={"aux_hidden": torch.randn(4, 2)}, source=f"s{v}.{i}")
    buf.prioritize(list(buf)[:3], [0.5, 1.5, 2.5])
    torch.save(buf.state_dict(), tmp_path / "replay.pt")
    other = ReplayBuffer(max_tokens=50, holdout_fraction=0.5)
    other.load_state_dict(torch.load(tmp_path / "replay.pt", weights_only=True))
    assert [(it.uid, it.source, it.holdout, it.priority) for it in other] == [
        (it.uid, it.source, it.holdout, it.priority) for it in buf]
    assert [it.priority for it in other][:4] == [0.5, 1.5, 2.5, None]
    assert (other.num_tokens, other.nbytes) == (buf.num_tokens, buf.nbytes)
    assert all(torch.equal(a.tensors["aux_hidden"], b.tensors["aux_hidden"]) for a, b in zip(other, buf))
    assert other.add([1], [2], 4).uid == buf.add([1], [2], 4).uid
    # the holdout positions carry over: a known prompt keeps its split, the next new one goes on
    assert other.add([1, 2, 0], [5], 3).holdout == buf.add([1, 2, 0], [5], 3).holdout
    assert other.add([7], [5], 3).holdout == buf.add([7], [5], 3).holdout
    small = ReplayBuffer(max_tokens=8)
    small.load_state_dict(buf.state_dict())
    assert small.num_tokens <= 8


def test_rebuild_from_the_spool(tmp_path):
    w = SpoolWriter(tmp_path)
    for step in range(3):
        w.write_rollouts(step, step, [[1, 2], [3]], [[4], [5, 6]], aux_hidden=torch.randn(6, 4))
    buf = ReplayBuffer(max_tokens=1000)
    for shard in SpoolReader(tmp_path).poll():
        buf.add_shard(shard)
    assert len(buf) == 6 and buf.newest_version == 2 and buf.num_tokens == 18
    first = next(iter(buf))
    assert first.sequence().prompt_ids == [1, 2] and first.tensors["aux_hidden"].shape == (3, 4)
    assert first.source.endswith("#0")


def test_group_by_length_keeps_the_draws_and_cuts_padding():
    from draftadapt.adapter import group_by_length
    from draftadapt.data.replay import ReplayItem

    rng = random.Random(0)
    items = [ReplayItem(uid=i, policy_version=0, token_ids=torch.zeros(rng.randint(5, 90), dtype=torch.int32),
                        prompt_len=3) for i in range(256)]
    # eight draws of 32 (the demo's round) and a short one repeating items: repeats are kept
    draws = [items[i: i + 32] for i in range(0, 256, 32)] + [items[:16]]
    grouped = group_by_length(draws, random.Random(1))
    assert sorted(len(b) for b in grouped) == sorted(len(b) for b in draws)
    assert sorted(it.uid for b in grouped for it in b) == sorted(it.uid for b in draws for it in b)

    def padded(batches):  # tokens a padded batch computes on
        return sum(len(b) * max(it.num_tokens for it in b) for b in batches)

    # measured 0.60 for these lengths (random draws pad nearly every sequence to ~90 tokens)
    assert padded(grouped) < 0.7 * padded(draws)
    assert group_by_length(draws, random.Random(1)) == grouped  # deterministic for the rng
