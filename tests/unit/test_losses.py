"""Losses and the Eagle-3 training-time-test unroll they train through."""

from __future__ import annotations

import pytest
import torch

from draftadapt.drafts.eagle3 import Eagle3Config, Eagle3Head
from draftadapt.train import losses
from draftadapt.train.forward import Eagle3TTT

V, H, T, B = 16, 32, 12, 2

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py



def tiny_head(seed: int = 0, vd: int = V) -> Eagle3Head:
    cfg = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       target_hidden_size=H, target_vocab_size=V, draft_vocab_size=vd, aux_layer_ids=[1, 2, 3],
                       max_position_embeddings=64)
    head = Eagle3Head(cfg)
    head.init_weights(seed, std=0.2)
    return head


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g)
    return ids, aux


def test_forward_kl_zero_when_draft_equals_target_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    target_logp = torch.log_softmax(logits, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    assert losses.forward_kl(logits, target_logp, mask).item() == pytest.approx(0.0, abs=1e-6)
    # a restricted target (mass outside the draft vocab) is renormalised: still 0 at equality
    restricted = target_logp[..., :10]
    assert losses.forward_kl(restricted.clone(), restricted, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert losses.forward_kl(torch.zeros(B, T, V), target_logp, mask).item() > 0.01


def test_masked_mean_ignores_masked_positions_and_empty_mask_is_zero():
    g = torch.Generator().manual_seed(1)
    target_logp = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    draft = torch.randn(B, T, V, generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 3] = True
    full = losses.forward_kl(draft, target_logp, mask)
    draft2 = draft.clone()
    draft2[1] += 100 * torch.randn(T, V)  # change only masked-out rows
    assert losses.forward_kl(draft2, target_logp, mask).item() == pytest.approx(full.item())
    empty = losses.forward_kl(draft.requires_grad_(), target_logp, torch.zeros_like(mask))
    assert empty.item() == 0.0
    empty.backward()
    assert torch.all(draft.grad == 0)


def test_cross_entropy_skips_ids_outside_draft_vocab():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0
    ids = torch.tensor([[2, -1, 1]])
    mask = torch.tensor([[True, True, False]])
    assert losses.cross_entropy(logits, ids, mask).item() == pytest.approx(0.0, abs=1e-3)


def test_ttt_loss_shapes_weights_and_targets():
    head = tiny_head()
    ids, aux = inputs()
    steps = Eagle3TTT(head, 3)(ids, aux)
    assert len(steps) == 3 and all(s.shape == (B, T, V) for s in steps)
    target_logp = torch.log_softmax(torch.randn(B, T, V), -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    w = losses.step_weights(3, 0.8)
    assert w == pytest.approx([1.0, 0.8, 0.64])
    mask[1, 5:] = False  # rows of different lengths: the per-row means weigh each row's own positions
    total, per_step, accs, rows = losses.ttt_loss(steps, target_logp, mask, w)
    assert total.ndim == 0 and len(per_step) == 3 and len(accs) == 3
    assert total.item() == pytest.approx(sum(wi * li.item() for wi, li in zip(w, per_step)), rel=1e-5)
    # the per-sequence loss of step 0 (the replay priorities): each row's own KL mean, and their
    # token-weighted mean is step 0's loss
    assert rows.shape == (B,) and not rows.requires_grad
    tgt0, m0 = losses.ttt_targets(target_logp, mask, 0)
    for b in range(B):
        assert rows[b].item() == pytest.approx(losses.forward_kl(steps[0][b], tgt0[b], m0[b]).item(), rel=1e-5)
    n = m0.sum(-1).float()
    assert ((rows * n).sum() / n.sum()).item() == pytest.approx(per_step[0].item(), rel=1e-5)
    # a sequence with no response position measured has no loss (NaN: the buffer keeps its priority)
    none = mask.clone()
    none[0] = False
    assert losses.ttt_loss(steps, target_logp, none, w)[3][0].isnan()
    total.backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    # step i is compared with the target at slot t + i + 1: a draft equal to that target has KL 0
    exact = [losses.shift_left(target_logp, i + 1, 0.0) for i in range(3)]
    total, per_step, accs, rows = losses.ttt_loss(exact, target_logp, mask, w)
    assert total.item() == pytest.approx(0.0, abs=1e-5) and rows.abs().max().item() < 1e-5
    assert all(a.item() == pytest.approx(1.0) for a in accs)


def test_unroll_step0_is_the_causal_forward():
    head = tiny_head()
    ids, aux = inputs()
    with torch.no_grad():
        x = head(ids, head.combine(aux))
        out = head.unroll(ids, aux, 1)[0]
    torch.testing.assert_close(out, head.logits(x))


def test_ttt_mask_no_future_leak():
    """Step j at slot t may read only slots <= t: perturbing later tokens and aux leaves it unchanged."""
    head = tiny_head()
    ids, aux = inputs()
    t0 = 5
    with torch.no_grad():
        ref = Eagle3TTT(head, 3)(ids, aux)
        ids2, aux2 = ids.clone(), aux.clone()
        # slot t reads token t + 1 (step 0) and is fed tokens t + 2 .. t + j + 1 (steps 1..j) with
        # the data feed: change everything from t0 + 4 on (past any slot <= t0's inputs at depth 3)
        ids2[:, t0 + 4 :] = (ids2[:, t0 + 4 :] + 1) % V
        aux2[:, t0 + 1 :] += 5.0
        out = Eagle3TTT(head, 3)(ids2, aux2)
    for j in range(3):
        torch.testing.assert_close(out[j][:, : t0 + 1], ref[j][:, : t0 + 1])
        assert not torch.allclose(out[j][:, t0 + 1 :], ref[j][:, t0 + 1 :])


def _incremental_reference(head: Eagle3Head, ids: torch.Tensor, aux: torch.Tensor, t: int, steps: int,
                           fed: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's drafting, one query at a time with a KV cache: the step-0 pass writes keys for
    slots 0..t; speculative step j (query at position t + j) appends one key and attends to all."""
    layer = head.layers[0]
    attn = layer.self_attn
    hidden = head.combine(aux[:, : t + 1])
    pos0 = torch.arange(t + 1).expand(ids.shape[0], -1)
    a_in, residual = layer.attn_input(head.embed_tokens(ids[:, : t + 1]), hidden)
    q, k, v = attn.qkv(a_in, pos0)
    mask = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()
    x = layer.finish(attn.attend(q, k, v, mask), residual)
    outs = [head.logits(x[:, t : t + 1])]
    keys, values = [k], [v]
    h = x[:, t : t + 1]
    for j in range(1, steps):
        a_in, residual = layer.attn_input(head.embed_tokens(fed[:, j - 1 : j]), h)
        q, kj, vj = attn.qkv(a_in, torch.full((ids.shape[0], 1), t + j))
        keys.append(kj)
        values.append(vj)
        kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
        x = layer.finish(attn.attend(q, kk, vv, torch.ones(1, kk.shape[2], dtype=torch.bool)), residual)
        outs.append(head.logits(x))
        h = x
    return outs


@pytest.mark.parametrize("t", [0, 4, 9])
def test_ttt_mask_matches_incremental_kv_cache_drafting(t):
    """The parallel TTT unroll equals drafting step by step with a KV cache, as vLLM does."""
    head = tiny_head(seed=3)
    ids, aux = inputs(seed=4)
    steps = 3
    with torch.no_grad():
        par = head.unroll(ids, aux, steps, feed_ids=lambda j, _l: losses.shift_left(ids, j + 1, 0))
        fed = ids[:, t + 1 : t + steps]  # tokens fed at steps 1.. for slot t under that feed
        ref = _incremental_reference(head, ids, aux, t, steps, fed)
    for j in range(steps):
        torch.testing.assert_close(par[j][:, t], ref[j][:, 0], rtol=1e-4, atol=1e-5)


def test_distill_loss_zero_at_target():
    g = torch.Generator().manual_seed(2)
    target_logp = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    loss, acc, rows = losses.distill_loss(target_logp.clone(), target_logp, mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and acc.item() == 1.0
    assert rows.shape == (B,) and rows.abs().max().item() < 1e-6
    other = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    loss, _, rows = losses.distill_loss(other, target_logp, mask, kind="ce", target_ids=target_logp.argmax(-1))
    assert rows.min().item() > 0 and rows.mean().item() == pytest.approx(loss.item(), rel=1e-5)
    with pytest.raises(ValueError):
        losses.distill_loss(target_logp, target_logp, mask, kind="mse")


@pytest.mark.parametrize("feed", ["data", "argmax"])
def test_unroll_at_slots_equals_the_full_unroll_there(feed):
    """TTT steps >= 1 run only at sampled slots (train.ttt_slots): each slot's logits are the
    full unroll's at that position, for the data feed and the head's own argmax."""
    head = tiny_head()
    ids, aux = inputs()
    ttt = Eagle3TTT(head, steps=3, feed=feed)
    full = ttt(ids, aux)
    slots = torch.tensor([[0, 3, 4, 10], [1, 2, 7, 11]])
    part = ttt(ids, aux, slots=slots)
    assert part[0].shape == full[0].shape == (B, T, V)
    for j in (1, 2):
        assert part[j].shape == (B, 4, V)
        want = full[j].gather(1, slots[..., None].expand(-1, -1, V))
        assert torch.allclose(part[j], want, atol=1e-5), (feed, j, (part[j] - want).abs().max())


def test_ttt_loss_at_slots_matches_the_full_loss_on_those_positions():
    """The slotted loss of steps >= 1 is the full loss restricted to the slots (and real ones only)."""
    head = tiny_head()
    ids, aux = inputs()
    ttt = Eagle3TTT(head, steps=3)
    g = torch.Generator().manual_seed(1)
    target_logp = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :3] = False
    slots = torch.tensor([[3, 5, 6, 9], [4, 5, 8, 8]])
    ok = torch.tensor([[True, True, True, True], [True, True, True, False]])
    _, part, _, _ = losses.ttt_loss(ttt(ids, aux, slots=slots), target_logp, mask, [1.0, 0.8, 0.64], slots=slots, slot_ok=ok)
    full = ttt(ids, aux)
    for j in (1, 2):
        tgt, m = losses.ttt_targets(target_logp, mask, j)
        sel = torch.zeros(B, T, dtype=torch.bool)
        sel[0, [3, 5, 6, 9]] = True
        sel[1, [4, 5, 8]] = True
        want = losses.forward_kl(full[j], tgt, m & sel)
        assert part[j].item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    # step 0 is untouched by the slots
    tgt0, m0 = losses.ttt_targets(target_logp, mask, 0)
    assert part[0].item() == pytest.approx(losses.forward_kl(full[0], tgt0, m0).item(), rel=1e-6)
