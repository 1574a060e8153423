"""The chunked draft-vocab loss (``losses.ttt_loss_chunked``, ``train.loss_chunk``) against the
reference (``losses.ttt_loss`` on every step's full logits): the same loss, per-step losses and
agreements, per-sequence losses, proposals and gradients of every parameter, at chunk sizes that
cut rows, steps and sequences at different places, on padded and packed batches, at TTT slots,
for KL and CE, an Eagle-3 head and MTP layers. float32: rtol 1e-5, atol 1e-6."""

from __future__ import annotations

import pytest
import torch

from draftadapt.train import losses
from draftadapt.train.forward import Eagle3TTT

from .test_losses import V, tiny_head as eagle3
from .test_packing import H, mtp, padded_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py

RTOL, ATOL = 1e-5, 1e-6
# 1: every row its own chunk; 7 and 13: boundaries inside steps and sequences; 4096: one chunk
CHUNKS = (1, 7, 13, 4096)


def run(head, batch, steps: int, feed: str, kind: str, chunk: int, slots=None, slot_ok=None) -> dict:
    """One forward and backward of the TTT loss: chunked (``chunk`` > 0) or the reference (0)."""
    head.zero_grad(set_to_none=True)
    ttt = Eagle3TTT(head, steps=steps, feed=feed)
    labels = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1) if kind == "ce" else None
    if labels is not None:
        labels = torch.where(labels < V - 3, labels, -1)  # some sampled tokens outside the draft vocab
    w = losses.step_weights(steps, 0.8)
    args = (batch.target_logp, batch.loss_mask, w, kind, labels, slots, slot_ok, batch.segments, batch.seqs)
    if chunk:
        feats = ttt(batch.input_ids, batch.aux, steps, slots, batch.segments, features=True)
        loss, per_step, accs, rows, ids = losses.ttt_loss_chunked(feats, head.lm_head.weight, *args, chunk=chunk)
    else:
        logits = ttt(batch.input_ids, batch.aux, steps, slots, batch.segments)
        loss, per_step, accs, rows = losses.ttt_loss(logits, *args)
        ids = [lg.argmax(-1) for lg in logits]
    loss.backward()
    masks = [losses.step_mask(batch.loss_mask, i, slots, slot_ok, batch.segments) for i in range(steps)]
    return {"loss": loss.detach(), "per_step": torch.stack(per_step), "accs": torch.stack(accs), "rows": rows,
            "ids": [d[m] for d, m in zip(ids, masks)],
            "grads": {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}}


def assert_same(got: dict, want: dict) -> None:
    for key in ("loss", "per_step", "accs", "rows"):
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{key}: {m}")
    for i, (a, b) in enumerate(zip(got["ids"], want["ids"])):
        assert torch.equal(a, b), f"draft argmax at step {i}"
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        assert g.abs().max() > 0, f"{name}: the reference has no gradient here; the case checks nothing"
        torch.testing.assert_close(got["grads"][name], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_reference_on_padded_and_packed_batches(steps, kind, packed):
    batch = padded_batch(3 * H)
    batch = batch.packed() if packed else batch
    assert (batch.segments is not None) is packed
    want = run(eagle3(), batch, steps, "data", kind, 0)
    for chunk in CHUNKS:
        assert_same(run(eagle3(), batch, steps, "data", kind, chunk), want)


def test_chunked_equals_reference_with_argmax_feed_and_at_slots():
    batch = padded_batch(3 * H)
    b, t = batch.input_ids.shape
    g = torch.Generator().manual_seed(5)
    slots = torch.rand(b, t, generator=g).masked_fill(~batch.loss_mask, -1).topk(4, dim=1).indices.sort(1).values
    slot_ok = batch.loss_mask.gather(1, slots)
    assert not slot_ok.all()  # a short row's filler slots are in the case
    for feed in ("data", "argmax"):
        want = run(eagle3(), batch, 3, feed, "kl", 0, slots, slot_ok)
        for chunk in (3, 4096):
            assert_same(run(eagle3(), batch, 3, feed, "kl", chunk, slots, slot_ok), want)


def test_chunked_equals_reference_for_mtp_layers_and_a_frozen_lm_head():
    """MTP layers (the full vocabulary through the policy's frozen lm_head) and an Eagle-3 head whose
    lm_head is frozen (train.freeze_lm_head): no lm_head gradient, every other one the same."""
    batch = padded_batch(H).packed()
    want = run(mtp(), batch, 3, "data", "kl", 0)
    assert "lm_head.weight" not in want["grads"]
    assert_same(run(mtp(), batch, 3, "data", "kl", 5), want)

    def frozen():
        head = eagle3()
        head.lm_head.weight.requires_grad_(False)
        return head

    batch = padded_batch(3 * H)
    want = run(frozen(), batch, 3, "data", "kl", 0)
    assert "lm_head.weight" not in want["grads"]
    assert_same(run(frozen(), batch, 3, "data", "kl", 6), want)


def test_chunked_loss_scales_its_gradients_by_the_upstream_gradient_and_refuses_a_second_backward():
    batch = padded_batch(3 * H)
    head = eagle3()
    feats = Eagle3TTT(head, steps=2)(batch.input_ids, batch.aux, 2, features=True)
    loss = losses.ttt_loss_chunked(feats, head.lm_head.weight, batch.target_logp, batch.loss_mask, [1.0, 0.8],
                                   chunk=4)[0]
    (2.5 * loss).backward(retain_graph=True)
    scaled = head.lm_head.weight.grad.clone()
    want = run(eagle3(), batch, 2, "data", "kl", 0)["grads"]["lm_head.weight"]
    torch.testing.assert_close(scaled, 2.5 * want, rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_trainer_steps_the_same_with_the_chunked_loss():
    """DraftTrainer: train.loss_chunk=3 and 0 log the same metrics (the simulated acceptance from
    the chunked path's proposals included) and leave the same weights after two steps. In the
    suite's process: the 1.8e-4 it once moved there was a host's bf16 mixed precision in
    accelerate's shared state, now kept out of the draft's training
    (test_host_state.py::test_the_draft_trains_at_its_own_precision_beside_a_bf16_host)."""
    _trainer_steps_the_same()


def _trainer_steps_the_same():
    from draftadapt.train.trainer import DraftTrainer, TrainConfig

    batch = padded_batch(3 * H)
    out = []
    for chunk in (0, 3):
        cfg = TrainConfig(lr=1e-2, warmup_steps=0, schedule="constant", batch_size=6, loss_chunk=chunk)
        trainer = DraftTrainer(eagle3(), "eagle3", cfg)
        metrics = [trainer.train_step(batch) for _ in range(2)]
        out.append((metrics, trainer.draft.state_dict()))
    (m0, sd0), (m1, sd1) = out
    assert "accept/simulated_length" in m0[0]
    for a, b in zip(m0, m1):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    for name, v in sd0.items():
        torch.testing.assert_close(sd1[name], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_chunked_matches_reference_under_bf16_autocast():
    """train.precision=bf16 (the CUDA default) runs lm_head's matmuls in bf16 on both paths: the
    same loss and gradients up to bf16 rounding (here on CPU autocast)."""
    batch = padded_batch(3 * H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run(eagle3(), batch, 3, "data", "kl", 0)
        got = run(eagle3(), batch, 3, "data", "kl", 5)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-3, atol=1e-4)
    for name, g in want["grads"].items():
        err = (got["grads"][name] - g).abs().max() / g.abs().max()
        assert err < 2e-2, (name, float(err))
