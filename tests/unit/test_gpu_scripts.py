"""The GPU section's commands on a machine without one: gpu_check.sh says it needs a GPU (exit 2,
nothing half run), and bench_adapter.py runs its toy size on CPU with the same code path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "no CUDA device" in r.stderr and "scripts/test.sh" in r.stderr
    assert not (tmp_path / "gpu_tests.log").exists()


def test_bench_adapter_toy_on_this_machine():
    r = subprocess.run([sys.executable, "scripts/bench_adapter.py", "--sizes", "toy", "--precisions", "fp32,bf16",
                        "--slots", "1.0,0.25", "--seqs", "2", "--seq-len", "32", "--steps", "1", "--handover",
                        "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(row["precision"], row["ttt_slots"]) for row in out["rows"]] == \
        [("fp32", 1.0), ("fp32", 0.25), ("bf16", 1.0), ("bf16", 0.25)]
    for row in out["rows"]:
        assert row["step_ms"] > 0 and row["tokens_per_step"] == 64 and row["loss"] > 0, row
        assert row["round_s"] >= row["publish_ms"] / 1e3, row
    # toy widths, 32 tokens a sequence: 256 draft log-probs float32, or the head's 64-wide bf16 input
    # and a float32 log-normaliser; both with 3 x 64 aux states in bf16
    logp, hidden = out["handover"]
    assert (logp["store"], hidden["store"]) == ("logp", "hidden")
    assert logp["host_mb_per_seq"] == pytest.approx(32 * (256 * 4 + 192 * 2) / 2**20, abs=1e-3)
    assert hidden["host_mb_per_seq"] == pytest.approx(32 * (64 * 2 + 4 + 192 * 2) / 2**20, abs=1e-3)


def test_bench_adapter_smollm2_size_as_the_readme_runs_it():
    """README "Precision": `--sizes smollm2 --precisions fp32,bf16` (shortened): SmolLM2's widths and
    the recipe's 8192-token draft vocabulary, one row per precision."""
    r = subprocess.run([sys.executable, "scripts/bench_adapter.py", "--sizes", "smollm2", "--precisions", "fp32,bf16",
                        "--seqs", "1", "--seq-len", "8", "--steps", "1", "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert [row["precision"] for row in rows] == ["fp32", "bf16"]
    assert all(row["tokens_per_step"] == 8 and row["step_ms"] > 0 and row["loss"] > 0 for row in rows), rows
    # one decoder layer (576 wide, 1536 MLP, 9 x 64 query and 3 x 64 kv heads), the 3 x 576 fc and
    # the 576 x 8192 lm_head trained; the embeddings are the target's (frozen)
    assert rows[0]["trainable_params"] > 576 * 8192 + 3 * 576 * 576


def test_bench_adapter_times_the_policy_update_at_each_precision():
    """`--policy` (docs/results.md, "bf16 on an EPYC without AMX"), toy widths: one row per
    precision, float32's KL to itself 0 and bf16's small but not 0 (the forward really ran in bf16)."""
    r = subprocess.run([sys.executable, "scripts/bench_adapter.py", "--policy", "--sizes", "toy", "--precisions",
                        "fp32,bf16", "--seqs", "2", "--seq-len", "16", "--steps", "1", "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fp32, bf16 = json.loads(r.stdout.strip().splitlines()[-1])["policy"]
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16") and fp32["layers"] == 4
    assert fp32["policy_ms"] > 0 and bf16["policy_ms"] > 0
    assert fp32["kl"] == 0.0 and 0.0 < bf16["kl"] < 0.05, (fp32, bf16)


def test_bench_adapter_names_a_bad_size():
    r = subprocess.run([sys.executable, "scripts/bench_adapter.py", "--sizes", "70b"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "70b" in r.stderr and "known sizes" in r.stderr


def test_bench_adapter_handover_alone():
    """The README's hand-over command (`--handover --no-train`), toy widths."""
    r = subprocess.run([sys.executable, "scripts/bench_adapter.py", "--sizes", "toy", "--seqs", "2", "--seq-len", "32",
                        "--handover", "--no-train", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rows"] == [] and [h["store"] for h in out["handover"]] == ["logp", "hidden"]
    assert all(h["handover_ms_per_seq"] >= 0 and h["seq_len"] == 32 for h in out["handover"])


def test_bench_step_vs_speculators_toy_on_this_machine():
    """issue 48's side-by-side step, toy widths, as README "Precision" runs it (each side at its own
    defaults): every row runs, both ratios are reported, speculators' row at its trainer's defaults
    (bf16 autocast, Muon + AdamW), draftadapt's at train.precision=auto (the toy's 128: float32)."""
    pytest.importorskip("speculators", reason="installed by scripts/setup.sh (pip install --no-deps speculators==0.9.0)")
    r = subprocess.run([sys.executable, "scripts/bench_step_vs_speculators.py", "--size", "toy", "--seq-len", "16",
                        "--steps", "1", "--threads", "1", "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens_per_step"] == 32
    names = ["draftadapt lm_head trained", "draftadapt lm_head frozen", "speculators"]
    assert [row["row"] for row in out["rows"]] == names
    for row in out["rows"]:
        assert "error" not in row and row["step_ms"] > 0 and row["peak_gib"] > 0 and row["step_gib"] >= 0, row
    assert out["precision"] == "defaults"
    assert [(row["precision"], row["optimizer"]) for row in out["rows"]] == \
        [("fp32", "AdamW"), ("fp32", "AdamW"), ("bf16", "Muon+AdamW")]
    assert sorted(out["ratio_vs_speculators"]) == sorted(names[:2])
    assert all(q["step"] > 0 and q["peak"] > 0 for q in out["ratio_vs_speculators"].values())
