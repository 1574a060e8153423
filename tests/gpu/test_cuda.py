"""The adapter's training side on a CUDA GPU (skipped without one; docs/design.md, "On a GPU").

vLLM's CUDA build is not on the GPU machines this project is lent (no package index there, and
its wheel is larger than what a call can carry), so these tests run the parts that need no
engine: the trainer's numerics on CUDA against CPU, bf16 autocast against float32, and a whole
hand-over round (the RL trainer's forward on the GPU, observe, train, validate, publish) whose
buffer stays in host memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .reference import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cuda_fp32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls as on CPU, not TF32
    try:
        yield train("fp32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_trainer_on_cuda_matches_cpu(cuda_fp32, tmp_path):
    """The same head, data and seed on CPU (a process with CUDA hidden) and on CUDA in float32:
    the same losses and simulated acceptance step by step, the same weights after 8 AdamW steps
    (kernel summation order only: 1e-4 relative on the first loss, 1e-3 after)."""
    out = tmp_path / "cpu.pt"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, str(REPO / "tests/gpu/reference.py"), str(out), "fp32"], env=env, check=True)
    cpu = torch.load(out)
    assert cpu["device"] == "cpu" and cuda_fp32["device"].startswith("cuda"), (cpu["device"], cuda_fp32["device"])
    assert cuda_fp32["precision"] == "fp32"
    assert cuda_fp32["losses"][0] == pytest.approx(cpu["losses"][0], rel=1e-4)
    assert cuda_fp32["losses"] == pytest.approx(cpu["losses"], rel=1e-3)
    assert cuda_fp32["accept"] == pytest.approx(cpu["accept"], abs=1e-3)
    for name, w in cpu["weights"].items():
        diff = (cuda_fp32["weights"][name] - w).norm() / w.norm().clamp(min=1e-12)
        assert diff < 1e-3, (name, float(diff))


def test_bf16_autocast_is_the_cuda_default_and_tracks_float32(cuda_fp32):
    """precision=auto on CUDA: bf16 autocast with float32 master weights; its losses stay within
    2% of float32's at every step."""
    bf16 = train("auto")
    assert bf16["precision"] == "bf16" and bf16["weight_dtype"] == "torch.float32"
    assert bf16["losses"] == pytest.approx(cuda_fp32["losses"], rel=2e-2)
    assert all(torch.isfinite(w).all() for w in bf16["weights"].values())


def test_handover_round_on_cuda_keeps_the_buffer_in_host_memory(toy_target, tmp_path):
    """The RL trainer's policy on the GPU hands its states over; the adapter trains its head on
    the GPU, keeps the buffer on the host, publishes a better draft, and never runs its own copy
    of the policy."""
    handover_round(toy_target, tmp_path, "cuda")


def test_hidden_store_round_on_cuda(toy_target, tmp_path):
    """The same round with the compact hand-over (the output head's input, log-probs recomputed
    from the head's rows when a batch is built) from a bf16 policy on the GPU."""
    handover_round(toy_target, tmp_path, "cuda", store="hidden")


def handover_round(toy_target: Path, tmp_path: Path, device: str, store: str = "logp") -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.adapter import AdapterConfig, DraftAdapter, ScheduleConfig
    from draftadapt.data.sequences import Sequence, collate
    from draftadapt.drafts.formats import WEIGHTS_FILE
    from draftadapt.draft_init import init_draft
    from draftadapt.toy.task import sample_problems
    from draftadapt.train.trainer import TrainConfig

    cfg = AdapterConfig(method="eagle3", k=3, handover_store=store,
                        train=TrainConfig(lr=3e-3, warmup_steps=0, schedule="constant", batch_size=16),
                        schedule=ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=20, min_sequences=16))
    adapter = DraftAdapter(toy_target, init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0),
                           tmp_path / "run", cfg)
    assert adapter.trainer.device.type == device
    assert adapter.trainer.precision == ("bf16" if device == "cuda" else "fp32")
    policy = AutoModelForCausalLM.from_pretrained(str(toy_target), dtype=torch.bfloat16).to(device)
    tok = AutoTokenizer.from_pretrained(str(toy_target))
    for step in range(2):
        seqs = [Sequence(tok(p["prompt"]).input_ids,
                         tok(p["response"], add_special_tokens=False).input_ids + [tok.eos_token_id])
                for p in sample_problems(64, seed=step)]
        with adapter.handover(policy) as ho:
            for lo in range(0, len(seqs), 16):
                idx = list(range(lo, lo + 16))
                batch = {k: v.to(device) for k, v in collate([seqs[i] for i in idx], adapter.pad_id).items()}
                logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                ho.add(idx, logits, batch["attention_mask"])
        adapter.observe(seqs, policy_version=0, handover=ho)
        devices = {t.device.type for it in adapter.replay for t in it.tensors.values()}
        assert devices == {"cpu"}, devices
        kept = {name for it in adapter.replay for name in it.tensors}
        assert kept == ({"lm_input", "lse", "aux_hidden"} if store == "hidden" else {"target_logp", "aux_hidden"}), kept
        m = adapter.run_round()
        assert m["adapt/trained"] == 1.0, m
    # the round's candidate beat the untrained head on held-out rollouts and was published
    assert m["adapt/published"] == 1.0 and m["accept/simulated_length"] > m["accept/simulated_live"] + 0.1, m
    assert adapter.capture.forwards == 0
    published = load_file(str(adapter.store.latest().path / WEIGHTS_FILE))
    exported = adapter.trainer.export_draft().state_dict()
    assert published["fc.weight"].dtype == torch.float32
    torch.testing.assert_close(published["fc.weight"], exported["fc.weight"].float(), rtol=0, atol=0)


@pytest.mark.parametrize("store", ["logp", "hidden"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_handover_copies_on_a_side_stream_give_the_cpu_paths_rows(toy_target, store, dtype):
    """add() on CUDA copies into pinned host memory on a side stream and returns; the rows read
    after their copies landed are what the CPU path computes from the same forward's tensors (the
    log-probs to float32 kernel order, 1e-5; the aux states and the head's input bit for bit, the
    aux cast to bf16 as the CPU path casts them), even though the trainer frees its logits right
    after add() and the allocator hands the memory straight to a new tensor. The GB/s of the copies
    is measured by scripts/bench_adapter.py --handover, not here."""
    from transformers import AutoModelForCausalLM

    from draftadapt.capture.hidden import HandOver, restricted_logp
    from draftadapt.data.sequences import Sequence, collate

    policy = AutoModelForCausalLM.from_pretrained(str(toy_target), dtype=dtype).to("cuda").eval()
    seqs = [Sequence([1, 2 + i % 3], [4 + (5 * i + j) % 50 for j in range(20 + 7 * i)]) for i in range(6)]
    keep = torch.tensor([0, 3, 5, 7, 9, 11, 40, 63])
    batch = {k: v.to("cuda") for k, v in collate(seqs, 0).items()}
    with HandOver(policy, [1, 3], keep, temperature=0.7, store=store) as ho, torch.no_grad():
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ref_logits = logits.float().cpu()
        ref_aux = torch.cat([ho._hooks.grabbed[k] for k in (1, 3)], -1).cpu()
        ref_head = ho._head_input.cpu() if store == "hidden" else None
        ho.add(list(range(len(seqs))), logits, batch["attention_mask"])
        shape = logits.shape
        del logits
        scribble = torch.full(shape, 7.0, device="cuda", dtype=dtype)  # reuses the freed logits' memory
    rows = ho.tensors(len(seqs))
    assert ho._copies.pending == 0 and float(scribble[0, 0, 0]) == 7.0
    mask = batch["attention_mask"].cpu()
    for r, row in enumerate(rows):
        n = int(mask[r].sum())
        assert all(t.device.type == "cpu" and t.is_pinned() for t in row.values()), {k: t.device for k, t in row.items()}
        assert row["aux_hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(row["aux_hidden"], ref_aux[r, :n].to(torch.bfloat16), atol=0, rtol=0)
        want = restricted_logp(ref_logits[r, :n], 0.7, keep)
        if store == "logp":
            torch.testing.assert_close(row["target_logp"], want, atol=1e-5, rtol=1e-5)
        else:
            assert row["lm_input"].dtype == dtype
            torch.testing.assert_close(row["lm_input"], ref_head[r, :n], atol=0, rtol=0)
            lse = torch.logsumexp(ref_logits[r, :n] / 0.7, -1, keepdim=True)
            torch.testing.assert_close(row["lse"], lse, atol=1e-5, rtol=1e-5)
