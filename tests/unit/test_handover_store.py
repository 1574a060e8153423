"""The compact hand-over (AdapterConfig.handover_store="hidden") against the default one, through
a whole adapter round on the toy target (no engine: the round trains, scores and publishes)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_cuda import handover_round

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


@pytest.mark.parametrize("store", ["logp", "hidden"])
def test_a_round_from_either_store_publishes_a_better_draft(toy_target, tmp_path, store):
    handover_round(toy_target, tmp_path, "cpu", store=store)


def test_both_stores_give_the_same_training_batch(toy_target, tmp_path):
    """The same rollouts handed over both ways build the same batch (float32 policy: the log-probs
    recomputed from the head equal the logits' to 1e-5). Bytes a token: H x 4 + 4 against Vd x 4
    (the toy's 64-token vocabulary is narrower than its 128 hidden: the store pays from Vd > H + 1,
    at 8B widths 16x less)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.adapter import AdapterConfig, DraftAdapter
    from draftadapt.data.sequences import Sequence, collate
    from draftadapt.draft_init import init_draft
    from draftadapt.toy.task import sample_problems

    draft0 = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    policy = AutoModelForCausalLM.from_pretrained(str(toy_target), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(toy_target))
    seqs = [Sequence(tok(p["prompt"]).input_ids, tok(p["response"], add_special_tokens=False).input_ids)
            for p in sample_problems(8, seed=3)]
    batches, nbytes = {}, {}
    for store in ("logp", "hidden"):
        adapter = DraftAdapter(toy_target, draft0, tmp_path / store, AdapterConfig(method="eagle3", handover_store=store))
        with adapter.handover(policy) as ho, torch.no_grad():
            batch = collate(seqs, adapter.pad_id)
            logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ho.add(list(range(len(seqs))), logits, batch["attention_mask"])
        adapter.observe(seqs, policy_version=0, handover=ho)
        items = list(adapter.replay)
        nbytes[store] = sum(t.numel() * t.element_size() for it in items for n, t in it.tensors.items()
                            if n != "aux_hidden")
        batches[store] = adapter.targets.batch(items)
    a, b = batches["logp"], batches["hidden"]
    torch.testing.assert_close(b.target_logp, a.target_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.aux, a.aux, atol=0, rtol=0)
    tokens = sum(len(q.prompt_ids) + len(q.response_ids) for q in seqs)
    assert nbytes == {"logp": tokens * 64 * 4, "hidden": tokens * (128 * 4 + 4)}, nbytes


def test_observe_takes_only_a_subset_hand_overs_rollouts(toy_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.adapter import AdapterConfig, DraftAdapter
    from draftadapt.data.sequences import Sequence, collate
    from draftadapt.draft_init import init_draft
    from draftadapt.toy.task import sample_problems

    adapter = DraftAdapter(toy_target, init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0), tmp_path / "run",
                           AdapterConfig(method="eagle3"))
    policy = AutoModelForCausalLM.from_pretrained(str(toy_target), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(toy_target))
    seqs = [Sequence(tok(p["prompt"]).input_ids, tok(p["response"], add_special_tokens=False).input_ids)
            for p in sample_problems(8, seed=4)]
    with adapter.handover(policy, subset=[6, 2, 5]) as ho, torch.no_grad():
        batch = collate(seqs, adapter.pad_id)
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ho.add(list(range(8)), logits, batch["attention_mask"])
    assert adapter.observe(seqs, policy_version=0, handover=ho) == 3
    held = sorted(tuple(it.token_ids.tolist()) for it in adapter.replay)
    assert held == sorted(tuple(seqs[i].prompt_ids + seqs[i].response_ids) for i in (2, 5, 6))
