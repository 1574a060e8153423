"""Engines for the integration tests: real vLLM on CPU, started once and shared."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from draftadapt.adapter import AdapterConfig, ScheduleConfig
from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.engine.rollout import RolloutEngine
from draftadapt.fileio import file_sha256
from draftadapt.spool import SpoolWriter
from draftadapt.toy.model import ToyModelConfig, build_model
from draftadapt.toy.tokenizer import build_tokenizer
from draftadapt.train.trainer import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def run_eval(target: Path, draft: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``draftadapt eval --target TARGET --draft DRAFT ARGS`` in a child process, as a user runs it."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "draftadapt.cli", "eval", "--target", str(target), "--draft", str(draft), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object on the last non-empty line of a command's stdout."""
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])


def start_engine(target: Path, draft: Path | None = None, method: str = "eagle3", k: int = 3, **kw) -> RolloutEngine:
    return RolloutEngine(target, draft, method=method, num_speculative_tokens=k, max_model_len=256,
                         max_num_seqs=64, kv_cache_gib=1, seed=0, **kw)


def stop_engine(engine: RolloutEngine) -> None:
    engine.close()
    gc.collect()


@pytest.fixture(scope="session")
def plain_engine(toy_target):
    """The toy target served without speculation: the reference for greedy equality and speed."""
    engine = start_engine(toy_target)
    yield engine
    stop_engine(engine)


def toy_prompts(target: Path, n: int) -> list[str]:
    from draftadapt.toy.task import load_heldout

    return [p["prompt"] for p in load_heldout(target / "heldout.jsonl")[:n]]


def pretrain_toy_head(toy_target: Path, out: Path, steps: int) -> Path:
    """An Eagle-3 head pretrained ``steps`` steps in-process on the toy task's own sequences (no
    engine needed); returns its directory."""
    from transformers import AutoTokenizer

    from draftadapt.config import load_config
    from draftadapt.data.sequences import Sequence, save_sequences
    from draftadapt.pretrain import PretrainConfig, pretrain
    from draftadapt.toy.task import sample_problems

    tok = AutoTokenizer.from_pretrained(str(toy_target))

    def seqs(n, seed):
        return [Sequence(tok(p["prompt"]).input_ids, tok(p["response"], add_special_tokens=False).input_ids
                         + [tok.eos_token_id]) for p in sample_problems(n, seed)]

    save_sequences(out / "pretrain/data/heldout.jsonl", seqs(16, 1))
    save_sequences(out / "pretrain/data/train.jsonl", seqs(128, 0))
    cfg = load_config(PretrainConfig, REPO / "recipes/pretrain_eagle3_toy.yaml",
                      [f"target={toy_target}", f"out={out}", f"max_steps={steps}", "train.batch_size=16",
                       "train.warmup_steps=2", "log=[jsonl]", "threads=1", "checkpoint_every=0"])
    pretrain(cfg)
    return out


@pytest.fixture(scope="session")
def trained_head(toy_target, tmp_path_factory) -> Path:
    """An Eagle-3 head trained 30 steps: its acceptance is well above an untrained head's, so a
    damaged swap shows (12 steps gave 1.25 on the 16 x 128 target, 30 steps of its head cost
    about what 12 did on the earlier 6 x 256 one)."""
    return pretrain_toy_head(toy_target, tmp_path_factory.mktemp("trained_head") / "eagle3", 30)


TINY = ToyModelConfig(num_layers=4, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)


def tiny_target(path: Path) -> Path:
    """An untrained 4-layer llama with the toy tokenizer: enough for the sidecar's control flow."""
    model = build_model(TINY, seed=0)
    model.save_pretrained(str(path))
    build_tokenizer().save_pretrained(str(path))
    return path


def small_cfg(k: int = 3) -> AdapterConfig:
    """An adapter that trains a few steps per round on small batches, every round."""
    tc = TrainConfig(lr=3e-3, warmup_steps=0, schedule="constant", threads=1, batch_size=8)
    return AdapterConfig(method="eagle3", k=k, train=tc,
                         schedule=ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=3, min_sequences=8))


def write_shard(writer: SpoolWriter, step: int, rng: random.Random, n: int = 12) -> Path:
    prompts = [[1] + [rng.randrange(4, 28) for _ in range(5)] for _ in range(n)]
    responses = [[rng.randrange(4, 28) for _ in range(rng.randrange(8, 20))] for _ in range(n)]
    return writer.write_rollouts(step=step, policy_version=step, prompt_ids=prompts, response_ids=responses)


def start_sidecar(spool, out, target, draft, log, *overrides: str) -> subprocess.Popen:
    """`draftadapt sidecar` as a real process with small rounds (its output goes to ``log``)."""
    cmd = [sys.executable, "-m", "draftadapt.cli", "sidecar", "--spool", str(spool), "--out", str(out),
           "--target", str(target), "--draft", str(draft), "poll_s=0.2", "log=[jsonl]",
           "adapter.schedule.train_steps=2", "adapter.train.batch_size=8", "adapter.schedule.min_sequences=8",
           "adapter.train.threads=1", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def edit_manifest(draft: Path, **changes) -> None:
    """Change the manifest and make its sha256 match the weights again (an attacker can do both)."""
    meta = json.loads((draft / META_FILE).read_text())
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not None}
    if "sha256" in meta:
        meta["sha256"] = file_sha256(draft / WEIGHTS_FILE)
    (draft / META_FILE).write_text(json.dumps(meta))


def flipped_copy(draft: Path, dst: Path) -> Path:
    """A copy of ``draft`` whose last 64 weight bytes are flipped (length and header intact)."""
    import shutil

    shutil.copytree(draft, dst)
    data = bytearray((dst / WEIGHTS_FILE).read_bytes())
    for i in range(len(data) - 64, len(data)):
        data[i] ^= 0xFF
    (dst / WEIGHTS_FILE).write_bytes(bytes(data))
    return dst
