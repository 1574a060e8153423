"""Prompt datasets (toy generator, local jsonl / parquet) and the sequence files and batches."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftadapt.capture.hidden import CapturedBatch
from draftadapt.capture.store import CaptureStore
from draftadapt.config import ConfigError
from draftadapt.data.prompts import token_counts
from draftadapt.data.sequences import (Sequence, as_sequences, batch_order, collate, epoch_plan, load_sequences,
                                       save_sequences)
from draftadapt.pretrain import heldout_prompts, load_prompts
from draftadapt.toy.world import TOY


def test_toy_prompts_are_a_dataset_and_deterministic():
    a = load_prompts("toy", 20, seed=3, toy=TOY)
    b = load_prompts("toy", 20, seed=3, toy=TOY)
    assert a.column_names == ["prompt"] and len(a) == 20
    assert a["prompt"] == b["prompt"]
    assert all(p.endswith("=") for p in a["prompt"])
    # the toy world is handed in from above (nothing outside toy/ imports it): without it, the fix
    with pytest.raises(ConfigError, match="data.source=toy needs the toy world"):
        load_prompts("toy", 20, seed=3)


def test_file_prompts_jsonl_and_parquet(tmp_path):
    rows = [{"question": f"q{i}", "other": i} for i in range(10)]
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_prompts(str(jl), 4, seed=0, field="question")
    assert ds.column_names == ["prompt"] and len(ds) == 4
    assert set(ds["prompt"]) <= {r["question"] for r in rows}
    import datasets

    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": f"x{i}"} for i in range(5)]).to_parquet(str(pq))
    assert sorted(load_prompts(str(pq))["prompt"]) == [f"x{i}" for i in range(5)]
    with pytest.raises(ValueError, match="no 'prompt' column"):
        load_prompts(str(jl))
    with pytest.raises(FileNotFoundError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_heldout_prefers_target_file(tmp_path):
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    assert heldout_prompts(tmp_path, "toy", 5, 0) == ["1+2="]
    other = heldout_prompts(tmp_path / "nothing", "toy", 5, 0, toy=TOY)
    assert len(other) == 5 and not set(other) & set(load_prompts("toy", 5, 0, toy=TOY)["prompt"])


def test_every_form_of_a_rollout_becomes_the_same_sequence():
    """as_sequences is the one Rollout -> Sequence: the engine's Rollout, a Sequence or spool
    record, a dict and a pair give the same (prompt ids, response ids), in order."""
    engine = SimpleNamespace(prompt_token_ids=(1, 5), token_ids=(7, 2), text="x", logprobs=None, finish_reason="stop")
    forms = [engine, Sequence([1, 5], [7, 2]), {"prompt_ids": [1, 5], "response_ids": [7, 2]}, ([1, 5], (7, 2))]
    assert as_sequences(forms) == [Sequence([1, 5], [7, 2])] * 4
    with pytest.raises(ValueError, match="no prompt tokens"):
        as_sequences([([], [7, 2])])


def test_sequences_roundtrip_and_collate(tmp_path):
    seqs = [Sequence([1, 5, 6], [7, 2]), Sequence([1, 4], [8, 9, 10, 2])]
    save_sequences(tmp_path / "s.jsonl", seqs)
    assert load_sequences(tmp_path / "s.jsonl") == seqs
    b = collate(seqs, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 2, 0], [1, 4, 8, 9, 10, 2]]
    # slot u marks token u + 1 as a response token
    assert b["loss_mask"].tolist() == [[False, False, True, True, False, False],
                                       [False, True, True, True, True, False]]
    assert b["attention_mask"].sum(1).tolist() == [5, 6]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_sequences(tmp_path / "bad.jsonl")


def test_epoch_plan_covers_every_batch_and_resumes():
    order = batch_order([i % 9 for i in range(100)], 8, seed=0)
    assert sorted(i for b in order for i in b) == list(range(100))
    for epoch in (0, 1, 2):
        plan = epoch_plan(len(order), 0, epoch)
        assert sorted(plan) == list(range(len(order)))
        assert epoch_plan(len(order), 0, epoch, skip=5) == plan[5:]
    assert epoch_plan(len(order), 0, 1) != epoch_plan(len(order), 0, 2)


def test_token_counts():
    counts = token_counts([Sequence([1], [3, 3, 4]), Sequence([1], [])], 6)
    assert counts.tolist() == [0, 0, 0, 2, 1, 0]


def test_capture_store_roundtrip(tmp_path):
    store = CaptureStore(tmp_path)
    batch = CapturedBatch(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long),
                          torch.tensor([[True, True, False]]), torch.log_softmax(torch.randn(1, 3, 5), -1),
                          torch.randn(1, 3, 8))
    calls = []
    got = store.get("b0", lambda: calls.append(1) or batch)
    again = store.get("b0", lambda: calls.append(1) or batch)
    assert calls == [1]
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.loss_mask, batch.loss_mask)
    torch.testing.assert_close(again.aux, batch.aux, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(again.target_logp, batch.target_logp, rtol=1e-3, atol=1e-2)
    assert got is batch and not list(tmp_path.glob(".*tmp"))
