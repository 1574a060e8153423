"""Packed training batches (CapturedBatch.packed): the same loss, gradients and per-sequence
losses as the padded batch, for an Eagle-3 head and MTP layers, at fewer padded positions."""

from __future__ import annotations

import pytest
import torch

from draftadapt.capture.hidden import CapturedBatch
from draftadapt.data.sequences import Sequence, collate
from draftadapt.drafts.mtp import MTPConfig, MTPHead
from draftadapt.train import losses
from draftadapt.train.forward import Eagle3TTT

from .test_losses import H, V, tiny_head as eagle3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py

# (prompt, response) lengths: one long sequence and short ones that fit beside it, and a
# one-token prompt, whose first response slot is where a row's next sequence would leak in
SHAPES = [(4, 20), (3, 5), (1, 6), (5, 9), (2, 3), (6, 14)]


def mtp(seed: int = 0) -> MTPHead:
    cfg = MTPConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    vocab_size=V, target_num_layers=4, max_position_embeddings=128)
    head = MTPHead(cfg)
    head.init_weights(seed, std=0.2)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        head.embed_tokens.weight.copy_(torch.randn(V, H, generator=g))
        head.lm_head.weight.copy_(torch.randn(V, H, generator=g) * 0.2)
    return head


def padded_batch(aux_width: int, seed: int = 0) -> CapturedBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [Sequence(torch.randint(3, V, (p,), generator=g).tolist(), torch.randint(3, V, (r,), generator=g).tolist())
            for p, r in SHAPES]
    b = collate(seqs, pad_id=0)
    n, t = b["input_ids"].shape
    real = b["attention_mask"].bool()
    logp = torch.log_softmax(torch.randn(n, t, V, generator=g), -1) * real[..., None]
    aux = torch.randn(n, t, aux_width, generator=g) * real[..., None]
    return CapturedBatch(b["input_ids"], b["attention_mask"], b["loss_mask"], logp, aux)


def loss_and_grads(head, batch: CapturedBatch, steps: int, feed: str, kind: str = "kl", slots=None, slot_ok=None):
    head.zero_grad()
    ttt = Eagle3TTT(head, steps=steps, feed=feed)
    out = ttt(batch.input_ids, batch.aux, steps, slots, batch.segments)
    labels = None
    if kind == "ce":
        labels = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1)
    loss, per_step, _, rows = losses.ttt_loss(out, batch.target_logp, batch.loss_mask, [0.8 ** i for i in range(steps)],
                                              kind, labels, slots, slot_ok, batch.segments, batch.seqs)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
    return loss.detach(), torch.stack(per_step), rows, grads


def test_packing_fills_rows_with_every_token_once_and_less_padding():
    batch = padded_batch(3 * H)
    packed = batch.packed()
    assert packed.segments is not None and packed.seqs == len(SHAPES)
    assert packed.input_ids.shape[0] < batch.input_ids.shape[0]
    assert packed.input_ids.numel() < batch.input_ids.numel()
    assert packed.num_tokens == batch.num_tokens
    for i, (p, r) in enumerate(SHAPES):
        where = packed.segments == i
        assert int(where.sum()) == p + r  # each sequence once, whole, in one row
        row = int(where.any(1).nonzero()[0])
        cols = where[row].nonzero().flatten()
        assert cols.tolist() == list(range(int(cols[0]), int(cols[0]) + p + r))  # contiguous
        assert torch.equal(packed.input_ids[row, cols], batch.input_ids[i, : p + r])
        assert torch.equal(packed.loss_mask[row, cols], batch.loss_mask[i, : p + r])
        assert torch.equal(packed.aux[row, cols], batch.aux[i, : p + r])
    assert not packed.attention_mask[packed.segments < 0].any()
    assert packed.packed() is packed


@pytest.mark.parametrize("feed", ["data", "argmax"])
@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_an_eagle3_head_learns_the_same_from_a_packed_batch(feed, kind):
    batch = padded_batch(3 * H)
    head = eagle3()
    want = loss_and_grads(head, batch, 3, feed, kind)
    got = loss_and_grads(head, batch.packed(), 3, feed, kind)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5)
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)  # every TTT step
    assert torch.allclose(got[2], want[2], rtol=1e-5, atol=1e-6)  # per sequence, in the batch's order
    assert torch.allclose(got[3], want[3], rtol=1e-4, atol=1e-6), (got[3] - want[3]).abs().max()


def test_mtp_layers_learn_the_same_from_a_packed_batch():
    """MTP zeroes the embedding at each sequence's position 0, also where a sequence starts
    inside a packed row."""
    batch = padded_batch(H)
    head = mtp()
    want = loss_and_grads(head, batch, 4, "data")
    got = loss_and_grads(head, batch.packed(), 4, "data")
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5)
    assert torch.allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[3], want[3], rtol=1e-4, atol=1e-6), (got[3] - want[3]).abs().max()


def test_ttt_steps_at_slots_learn_the_same_from_a_packed_batch():
    """The same slots, placed where their sequences sit in the packed rows, give the same loss."""
    batch = padded_batch(3 * H)
    packed = batch.packed()
    g = torch.Generator().manual_seed(3)
    slots, ok = [], []
    for i, (p, r) in enumerate(SHAPES):  # two loss positions of each sequence (filler for a short one)
        pos = batch.loss_mask[i].nonzero().flatten()
        pick = pos[torch.randperm(len(pos), generator=g)[:2]].sort().values
        slots.append(torch.cat([pick, pick[-1:].expand(2 - len(pick))]))
        ok.append(torch.arange(2) < len(pick))
    slots, ok = torch.stack(slots), torch.stack(ok)
    head = eagle3()
    want = loss_and_grads(head, batch, 3, "data", slots=slots, slot_ok=ok)
    rows = [[] for _ in range(packed.input_ids.shape[0])]
    for i in range(len(SHAPES)):
        row = int((packed.segments == i).any(1).nonzero()[0])
        start = int((packed.segments[row] == i).nonzero()[0])
        rows[row] += [(start + int(s), bool(o)) for s, o in zip(slots[i], ok[i])]
    m = max(len(r) for r in rows)
    p_slots = torch.tensor([[s for s, _ in r] + [r[-1][0]] * (m - len(r)) for r in rows])
    p_ok = torch.tensor([[o for _, o in r] + [False] * (m - len(r)) for r in rows])
    got = loss_and_grads(head, packed, 3, "data", slots=p_slots, slot_ok=p_ok)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5)
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[3], want[3], rtol=1e-4, atol=1e-6), (got[3] - want[3]).abs().max()


def test_segment_means_are_row_means_per_sequence():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    segments = torch.tensor([[0, 0, 1, 1], [2, 2, 2, -1]])
    got = losses.segment_means(x, mask, segments, 4)
    assert got[:3].tolist() == [1.5, 4.0, 6.0]
    assert torch.isnan(got[3])  # a sequence with no counted position: NaN, as row_means
