"""Capture: aux layer indexing (vLLM's = HF hidden_states[k]), restricted log-probs, bounded batches."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftadapt.capture.hidden import HandOver, TargetCapture, iter_captured
from draftadapt.data.sequences import Sequence, collate, iter_batches

L = 4

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py



def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def test_aux_ids_match_hf_hidden_states():
    model = tiny_target()
    ids = torch.randint(0, 24, (2, 9))
    mask = torch.ones_like(ids)
    ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states  # L + 1
    ids_all = list(range(L))  # 0 = embeddings .. L-1
    logp, aux = TargetCapture(model, ids_all)(ids, mask)
    assert aux.shape == (2, 9, len(ids_all) * 32)
    for n, k in enumerate(ids_all):
        torch.testing.assert_close(aux[..., n * 32 : (n + 1) * 32], ref[k])
    # id L is the residual stream after the last layer *before* the final norm (vLLM's), which
    # HF's hidden_states[L] is not (it is after model.norm)
    _, last = TargetCapture(model, [L])(ids, mask)
    torch.testing.assert_close(model.model.norm(last), ref[L])
    assert not torch.allclose(last, ref[L])


def test_target_logp_restricted_and_tempered():
    model = tiny_target()
    ids = torch.randint(0, 24, (1, 7))
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids).logits
    keep = torch.tensor([0, 3, 5, 20])
    logp, aux = TargetCapture(model, None, keep, temperature=0.5)(ids, mask)
    assert aux is None and logp.shape == (1, 7, 4)
    torch.testing.assert_close(logp, torch.log_softmax(logits / 0.5, -1)[..., keep])
    with pytest.raises(ValueError):
        TargetCapture(model, [L + 1])
    with pytest.raises(ValueError):
        TargetCapture(model, None, temperature=0.0)


def test_right_padding_does_not_change_real_positions():
    model = tiny_target()
    a = Sequence([1, 5, 6], [7, 8, 9, 2])
    b = Sequence([1, 4], [3, 2])
    alone = TargetCapture(model, [1, 2]).capture(collate([a], 0))
    both = TargetCapture(model, [1, 2]).capture(collate([a, b], 0))
    torch.testing.assert_close(both.aux[0], alone.aux[0])
    torch.testing.assert_close(both.target_logp[0], alone.target_logp[0])
    assert both.loss_mask[1].tolist() == [False, True, True, False, False, False, False]


def test_capture_streams_one_batch_at_a_time():
    """Bounded memory: the capture is lazy; batch n is computed only after batch n-1 was taken."""
    model = tiny_target()
    seqs = [Sequence([1, 2, 3], [4, 5, 6, 7 + i % 5]) for i in range(40)]
    calls = []
    cap = TargetCapture(model, [1])
    orig = cap.__call__

    class Spy(TargetCapture):
        def __call__(self, input_ids, attention_mask):
            calls.append(input_ids.shape[0])
            return orig(input_ids, attention_mask)

    spy = Spy(model, [1])
    stream = iter_captured(spy, iter_batches(seqs, 8, 0, seed=0, epoch=0))
    first = next(stream)
    assert calls == [8] and first.input_ids.shape[0] == 8
    rest = list(stream)
    assert len(rest) == 4 and all(c <= 8 for c in calls)


def test_batch_order_is_deterministic_and_sharded():
    seqs = [Sequence([1], [2] * (i % 7 + 1)) for i in range(50)]
    a = [b["input_ids"].tolist() for b in iter_batches(seqs, 4, 0, seed=1, epoch=2)]
    b = [b["input_ids"].tolist() for b in iter_batches(seqs, 4, 0, seed=1, epoch=2)]
    assert a == b
    r0 = list(iter_batches(seqs, 4, 0, seed=1, epoch=2, rank=0, world=2))
    r1 = list(iter_batches(seqs, 4, 0, seed=1, epoch=2, rank=1, world=2))
    assert len(r0) == len(r1) == len(a) // 2
    skipped = [b["input_ids"].tolist() for b in iter_batches(seqs, 4, 0, seed=1, epoch=2, skip=3)]
    assert skipped == a[3:]


def test_handover_from_the_trainers_own_forward_equals_a_capture_of_each_rollout():
    """The RL trainer's forward (with grad, micro-batches in any order, right padded) hands over
    exactly what a separate no-grad capture of each rollout computes, and its graph still works."""
    model = tiny_target()
    seqs = [Sequence([1, 2 + i % 3], [4 + j % 9 for j in range(3 + 2 * i)]) for i in range(7)]
    keep = torch.tensor([0, 3, 5, 7, 9, 11])  # a draft vocabulary smaller than the target's
    ho = HandOver(model, [1, 3], keep, temperature=0.7, aux_dtype=torch.float32)
    order = [[6, 1, 3], [0, 5], [2, 4]]
    with ho:
        for idx in order:
            batch = collate([seqs[i] for i in idx], 0)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ho.add(idx, logits, batch["attention_mask"])
            logits.sum().backward()  # the trainer's graph is untouched by the hand-over
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not any(m._forward_hooks for m in model.modules())  # hooks gone after the block
    rows = ho.tensors(len(seqs))
    cap = TargetCapture(model, [1, 3], keep, temperature=0.7)
    for s, row in zip(seqs, rows):
        alone = cap.capture(collate([s], 0))
        assert row["target_logp"].shape == (len(s), 6) and row["aux_hidden"].shape == (len(s), 64)
        torch.testing.assert_close(row["target_logp"], alone.target_logp[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(row["aux_hidden"], alone.aux[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"rollouts \[7\]"):
        ho.tensors(8)


def test_handover_refuses_rows_without_a_forward_and_mismatched_indices():
    model = tiny_target()
    batch = collate([Sequence([1], [2, 3])], 0)
    with HandOver(model, [1], None, temperature=1.0) as ho:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with pytest.raises(ValueError, match="one index per row"):
            ho.add([0, 1], logits, batch["attention_mask"])
        ho.add([0], logits, batch["attention_mask"])
        with pytest.raises(RuntimeError, match="no forward of the policy ran"):
            ho.add([1], logits, batch["attention_mask"])  # the same logits again: no new forward


def test_hidden_store_recomputes_the_same_log_probs_from_the_output_head():
    """store="hidden" keeps the output head's input (H values a token) and the log-normaliser
    instead of Vd log-probs; recomputed from the forward's head rows they equal the "logp" store's
    (float32 model: 1e-5), and a forward whose logits are not the head's output is refused."""
    from draftadapt.capture.hidden import handed_logp

    model = tiny_target()
    with torch.no_grad():
        model.lm_head.bias = torch.nn.Parameter(torch.randn(24))  # a head with a bias, as some models have
    seqs = [Sequence([1, 2 + i % 3], [4 + j % 9 for j in range(3 + 2 * i)]) for i in range(5)]
    keep = torch.tensor([0, 3, 5, 7, 9, 11])
    stores = {}
    for store in ("logp", "hidden"):
        ho = HandOver(model, [1, 3], keep, temperature=0.7, aux_dtype=torch.float32, store=store)
        with ho, torch.no_grad():
            for idx in ([3, 0], [1, 2, 4]):
                batch = collate([seqs[i] for i in idx], 0)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                ho.add(idx, logits, batch["attention_mask"])
        stores[store] = ho
    assert not any(m._forward_pre_hooks for m in model.modules())  # the head's hook is gone after the block
    head = stores["hidden"].lm_head
    assert head[0].shape == (6, 32) and head[1].shape == (6,)
    for s, a, b in zip(seqs, stores["logp"].tensors(5), stores["hidden"].tensors(5)):
        assert set(b) == {"lm_input", "lse", "aux_hidden"} and b["lm_input"].shape == (len(s), 32)
        assert b["lse"].shape == (len(s), 1)
        torch.testing.assert_close(handed_logp(b["lm_input"], b["lse"], head, 0.7), a["target_logp"],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b["aux_hidden"], a["aux_hidden"], atol=0, rtol=0)
    batch = collate(seqs[:2], 0)
    with HandOver(model, [1], keep, temperature=1.0, store="hidden") as ho, torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with pytest.raises(ValueError, match="not the output head applied to its input"):
            ho.add([0, 1], 30 * torch.tanh(logits / 30), batch["attention_mask"])  # a soft-capped output
    with pytest.raises(ValueError, match="'logp'.*'hidden'"):
        HandOver(model, [1], keep, temperature=1.0, store="logits")


def test_a_subset_hand_over_copies_and_gives_only_its_rollouts():
    model = tiny_target()
    seqs = [Sequence([1, 2], [4 + j for j in range(2 + i)]) for i in range(6)]
    with HandOver(model, [1], None, temperature=1.0, subset=[4, 1]) as ho, torch.no_grad():
        for idx in ([0, 1, 2], [3, 4, 5]):
            batch = collate([seqs[i] for i in idx], 0)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ho.add(idx, logits, batch["attention_mask"])
    assert sorted(ho.rows) == [1, 4] and ho.chosen(6) == [1, 4]
    rows = ho.tensors(6)
    assert [r["target_logp"].shape[0] for r in rows] == [len(seqs[1]), len(seqs[4])]
    with pytest.raises(ValueError, match=r"subset names rollouts \[4\] of a step of 3"):
        ho.tensors(3)


def test_logits_of_some_rows_of_the_forward_hand_over_what_the_whole_forward_does():
    """A subset hand-over runs the output head on the kept rows only (TRL's hook): with
    ``forward_rows`` naming the forward's rows, each rollout keeps the same log-probs and the aux
    states of its own row, exactly as when the logits of every row are passed."""
    model = tiny_target()
    seqs = [Sequence([1, 2], [4 + j for j in range(2 + i)]) for i in range(4)]
    batch = collate(seqs, 0)
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    with HandOver(model, [1], None, temperature=1.0) as whole, torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        whole.add(range(4), model.lm_head(hidden), batch["attention_mask"])
    with HandOver(model, [1], None, temperature=1.0, subset=[3, 1]) as part, torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        kept = [1, 3]
        part.add([3, 1], model.lm_head(hidden[kept]), batch["attention_mask"][kept], rows=[1, 0], forward_rows=kept)
    assert sorted(part.rows) == [1, 3]
    for i in (1, 3):
        torch.testing.assert_close(part.rows[i]["target_logp"], whole.rows[i]["target_logp"], atol=1e-6, rtol=0)
        torch.testing.assert_close(part.rows[i]["aux_hidden"], whole.rows[i]["aux_hidden"], atol=0, rtol=0)
    with pytest.raises(ValueError, match="one forward row per row of logits"):
        part.add([3], model.lm_head(hidden[[3]]), batch["attention_mask"][[3]], forward_rows=[3, 1])


def test_host_copies_on_the_cpu_are_plain_copies_and_nothing_waits():
    """Off a GPU, HostCopies is what the hand-over always did: a copy in host memory (never the
    caller's storage, which the trainer may change next), cast to the asked dtype, done at once."""
    from draftadapt.capture.hidden import HostCopies

    copies = HostCopies()
    src = torch.randn(5, 8)
    same, narrow = copies.copy(src[1:4]), copies.copy(src, torch.bfloat16)
    copies.mark()
    assert copies.pending == 0
    src.add_(1.0)  # the trainer's next in-place step
    torch.testing.assert_close(same, src[1:4] - 1.0, atol=1e-6, rtol=0)
    assert narrow.dtype == torch.bfloat16 and same.data_ptr() != src[1:4].data_ptr()
    torch.testing.assert_close(narrow, (src - 1.0).to(torch.bfloat16), atol=0, rtol=0)


class Landing:
    """Stands in for a CUDA event in the logic below: says when it was waited on."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(self.name)


def test_the_rows_are_read_only_after_their_copies_land():
    """On a GPU add() returns before its copies land (one event per add); tensors() and detach()
    (what observe and a Ray adapter read) wait for every one first, in order, and once."""
    model = tiny_target()
    seqs = [Sequence([1, 2], [4 + j for j in range(2 + i)]) for i in range(4)]
    log: list[str] = []
    with HandOver(model, [1], None, temperature=1.0) as ho, torch.no_grad():
        for n, idx in enumerate(([0, 1], [2, 3])):
            batch = collate([seqs[i] for i in idx], 0)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ho.add(idx, logits, batch["attention_mask"])
            ho._copies._events.append(Landing(log, f"add {n}"))
    assert ho._copies.pending == 2 and log == []
    rows = ho.tensors(4)
    assert log == ["add 0", "add 1"] and ho._copies.pending == 0 and len(rows) == 4
    ho._copies._events.append(Landing(log, "again"))
    sent = ho.detach()
    assert log[-1] == "again" and ho._copies.pending == 0 and sorted(sent.rows) == [0, 1, 2, 3]
