"""Pretraining an Eagle-3 head: speculators' own trainer against ``draftadapt pretrain``, on the same
regenerated data, the same head and the same number of optimizer steps; then acceptance in vLLM.

    .venv/bin/python scripts/bench_vs_speculators.py --toy DIR --out DIR [--steps 288] [--json]

1. ``draftadapt pretrain recipes/pretrain_eagle3_toy.yaml`` as a user runs it (``max_steps=STEPS``,
   one thread), which regenerates the training data: the toy target's own responses, through vLLM.
2. The same sequences, laid out as speculators' data pipeline leaves them (its ``prepare_data``
   columns ``input_ids``/``loss_mask``/``seq_len`` and its ``hidden_states/hs_{i}.safetensors``:
   the aux layers and the last layer of the target, written here with the HF target instead of
   its vLLM hidden-state connector); draftadapt's held-out sequences are its validation split.
3. ``speculators train`` (``speculators.train.cli.main`` on ``TrainConfig.resolve(argv)``, in a
   child process, one thread) on that data for STEPS steps with its own training defaults (Muon +
   AdamW at lr 1e-3, linear schedule, 1% warmup, grad clip 1, KL over 3 TTT steps) and the head
   draftadapt's recipe trains (one llama layer, MLP 256, the target's whole vocabulary, the same
   aux layers; ``--head original``: the original Eagle-3 norms, ``--head speculators``: the three
   norms speculators adds by default, in both trainers). What it takes on CPU: ``CPU_SETTINGS``.
4. Acceptance length of three drafts in vLLM, one engine each, k=3, T=1, on the target's
   held-out prompts: the untrained head (draftadapt's step 0), draftadapt's, speculators' (its
   last checkpoint imported with ``draftadapt draft init --from``).

Prints a table, then with ``--json`` one JSON object as the last line (docs/design.md,
"speculators"). ``--data DIR`` reuses the regenerated data of an earlier run (its
``draftadapt/pretrain/data``); ``--speculators-arg=--lr=3e-3`` and ``--pretrain-arg train.lr=1e-3``
change one side's settings for an ablation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.integration.test_speculators: the target's features as speculators reads them

RECIPE = REPO / "recipes/pretrain_eagle3_toy.yaml"
K, TEMPERATURE = 3, 1.0

# What speculators' trainer needs to run on a CPU-only torch (speculators 0.9.0; docs/design.md,
# "speculators"). Flags go into its argv; the two patches are applied around its main() only.
CPU_SETTINGS = {
    "--draft-attn-impl=eager": "its default flex attention fails uncompiled on CPU (block mask of 128)",
    "--loss-implementation=eager": "its default 'fused' loss is a Triton kernel",
    "--hidden-states-dtype=float32": "its autocast falls back to device 'cuda' without an accelerator "
                                     "(train/trainer.py:228), which torch disables on CPU: bf16 data "
                                     "would meet float32 weights",
    "--num-workers=0": "its default 12 spawned loader workers, on a 2-core machine",
    "patch speculators.train.trainer.get_local_rank -> 'cpu'": "single-process training moves the model "
                                                             "and every batch to device int 0 "
                                                             "(train/trainer.py:348, 533), the accelerator",
    "patch torch.accelerator.synchronize -> no-op": "its step timer synchronizes the accelerator on every "
                                                   "logged step, step 0 always (train/trainer.py:80, 92)",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], log_file: Path, timeout: int = 3600) -> str:
    """``cmd`` as a child process, its output to ``log_file``; -> its stdout."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log_file.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}); its output: {log_file}\n"
                         + proc.stderr[-3000:])
    return proc.stdout


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


# ---------------------------------------------------------------------------------------------- draftadapt

NORMS = ("norm_before_residual", "norm_before_fc", "norm_output")  # speculators' Eagle-3 defaults: all on


def pretrain_overrides(args) -> list[str]:
    norms = [f"draft.{name}={str(args.head == 'speculators').lower()}" for name in NORMS]
    return [f"target={args.toy}", f"max_steps={args.steps}", f"data.num_prompts={args.train_prompts}",
            f"data.heldout_prompts={args.heldout_prompts}", f"train.batch_size={args.batch_size}", "max_minutes=0",
            "threads=1", "checkpoint_every=0", "log=[jsonl]", *norms, *args.pretrain_arg]


def draftadapt_pretrain(args, out: Path) -> dict:
    if args.data is not None and not (out / "pretrain/data/train.jsonl").is_file():
        shutil.copytree(args.data, out / "pretrain/data", dirs_exist_ok=True)
    stdout = run([sys.executable, "-m", "draftadapt.cli", "pretrain", str(RECIPE), f"out={out}",
                  *pretrain_overrides(args)], out.parent / "draftadapt_pretrain.log")
    return last_json(stdout)


def untrained_head(args, out: Path) -> Path:
    """draftadapt's head at step 0: pretrain's own build of it (same recipe, same seed), exported."""
    from transformers import AutoModelForCausalLM

    from draftadapt.config import load_config
    from draftadapt.pretrain import PretrainConfig
    from draftadapt.train.methods import method_for

    cfg = load_config(PretrainConfig, RECIPE, [f"out={out}", *pretrain_overrides(args)])
    target = AutoModelForCausalLM.from_pretrained(str(args.toy), dtype=torch.float32)
    method = method_for(cfg.method)
    head = method.build(Path(args.toy), target, cfg.draft, [])
    return method.export(head, out, args.toy, fmt=cfg.draft.format, num_speculative_tokens=K)


# ---------------------------------------------------------------------------------------------- speculators

def write_speculators_data(toy: Path, data_dir: Path, pretrain_data: Path, aux_ids: list[int]) -> dict:
    """draftadapt's regenerated train + held-out sequences in speculators' offline data layout ->
    {"rows", "train_lengths"}. Rows are train then held-out, so a train ratio just under 1 makes
    the held-out sequences its validation split."""
    import datasets
    from safetensors.torch import save_file

    from draftadapt.data.sequences import load_sequences
    from draftadapt.progress import progress
    from tests.integration.test_speculators import Features

    train = load_sequences(pretrain_data / "train.jsonl")
    held = load_sequences(pretrain_data / "heldout.jsonl")
    features = Features(toy, aux_ids)
    (data_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, seq in enumerate(progress(iterable=train + held, desc="speculators' data", unit="seq")):
        ids = seq.ids
        aux, last = features.forward(ids)  # [1, T, 3H], [1, T, H]
        t, h = len(ids), last.shape[-1]
        # hs_i: [T, aux layers + last, H], as vLLM's hidden-state connector writes it
        hidden = torch.cat([aux[0].view(t, len(aux_ids), h), last[0][:, None]], dim=1).contiguous()
        save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)},
                  str(data_dir / "hidden_states" / f"hs_{i}.safetensors"))
        cols["input_ids"].append(ids)
        cols["loss_mask"].append([0] * len(seq.prompt_ids) + [1] * len(seq.response_ids))
        cols["seq_len"].append(t)
    ds = datasets.Dataset.from_dict(cols)
    ds.set_format(type="torch")  # as its prepare_data leaves it
    ds.save_to_disk(str(data_dir))
    return {"rows": len(cols["seq_len"]), "train_lengths": cols["seq_len"][: len(train)]}


def decoder_config(toy: Path, out: Path, intermediate_size: int) -> Path:
    """speculators' draft decoder for the toy (its create_transformer_layer_config with its
    defaults: llama, one layer, sliding window 2048) at draftadapt's MLP width, for --draft-config."""
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(verifier_name_or_path=str(toy), num_layers=1, draft_arch="llama",
                                            hidden_act=None, sliding_window=2048, full_attention_indices=[])
    if intermediate_size:
        layer.intermediate_size = intermediate_size
    layer.save_pretrained(str(out))
    return out


def epochs_for(lengths: list[int], total_seq_len: int, seed: int, steps: int) -> tuple[int, list[int]]:
    """The epochs speculators' packing sampler needs for ``steps`` batches (its batch count per
    epoch varies with the shuffle): its trainer runs whole epochs and stops at max_steps."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    per_epoch = []
    while sum(per_epoch) < steps:
        sampler.set_epoch(len(per_epoch))
        per_epoch.append(len(sampler))
    return len(per_epoch), per_epoch


class MetricRows(logging.Handler):
    """speculators' per-step metric records (its "speculators.metrics" logger) as JSON lines."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = open(path, "w")

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict) and ("train" in msg or "val" in msg):
            self.file.write(json.dumps(msg, default=float) + "\n")
            self.file.flush()


def speculators_train_cpu(argv: list[str], metrics_file: Path) -> None:
    """``speculators train ARGV`` in this process, on CPU (the patches of CPU_SETTINGS)."""
    from unittest import mock

    import speculators.train.trainer as trainer_module
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    torch.set_num_threads(1)
    cfg = TrainConfig.resolve(argv)
    # On the root logger before its setup: its logging config replaces the handlers of its own
    # loggers, and its console handler (one dict per step) is then not installed.
    logging.getLogger().addHandler(MetricRows(metrics_file))
    with mock.patch.object(trainer_module, "get_local_rank", lambda: "cpu"), \
            mock.patch.object(torch.accelerator, "synchronize", lambda *a, **k: None):
        main(cfg)


def speculators_pretrain(args, out: Path, pretrain_data: Path, aux_ids: list[int], intermediate_size: int) -> dict:
    """speculators' data from draftadapt's sequences, then ``speculators train`` on them -> its numbers."""
    from speculators.train.config import TrainConfig

    t0 = time.perf_counter()
    data = write_speculators_data(Path(args.toy), out / "data", pretrain_data, aux_ids)
    data_seconds = time.perf_counter() - t0
    # tokens per step as draftadapt's (batch_size sequences): one packed row of that many tokens
    lengths = data["train_lengths"]
    total_seq_len = round(args.batch_size * statistics.mean(lengths))
    argv = ["--speculator-type=eagle3", f"--verifier-name-or-path={args.toy}", f"--data-path={out / 'data'}",
            f"--draft-config={decoder_config(Path(args.toy), out / 'decoder', intermediate_size)}",
            "--target-layer-ids", *map(str, aux_ids),
            *([f"--no-{name.replace('_', '-')}" for name in NORMS] if args.head == "original" else []),
            *[flag for flag in CPU_SETTINGS if flag.startswith("--")],
            f"--total-seq-len={total_seq_len}", f"--train-data-ratio={(len(lengths) + 0.5) / data['rows']}",
            f"--max-steps={args.steps}", f"--save-path={out / 'checkpoints'}", f"--log-dir={out / 'logs'}",
            "--no-resume-from-checkpoint", *args.speculators_arg]
    epochs, per_epoch = epochs_for(lengths, total_seq_len, TrainConfig.resolve(argv).seed, args.steps)
    argv.append(f"--epochs={epochs}")
    (out / "argv.json").write_text(json.dumps(argv))
    t0 = time.perf_counter()
    run([sys.executable, str(Path(__file__).resolve()), "--speculators-child", str(out / "argv.json")],
        out / "train.log")
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train" in r]
    if len(train) != args.steps:
        raise SystemExit(f"speculators logged {len(train)} steps, not {args.steps}: {out / 'train.log'}")
    prof = [r["profile"] for r in train[1:]]  # step 0: warm-up
    compute = [(p["step_ms"] - p["fetch_ms"]) / 1e3 for p in prof]
    last = train[-1]["train"]
    ckpt = max((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return {"checkpoint": str(ckpt), "steps": len(train), "epochs": epochs, "batches_per_epoch": per_epoch,
            "tokens_per_step": total_seq_len, "data_seconds": round(data_seconds, 1),
            "seconds_per_step": round(statistics.mean(compute), 4),
            "fetch_seconds_per_step": round(statistics.mean(p["fetch_ms"] for p in prof) / 1e3, 4),
            "train_seconds": round(wall, 1),
            "final_loss": round(last.get("loss", float("nan")), 4),
            "final_acc": [round(last[f"full_acc_{j}"], 4) for j in range(K) if f"full_acc_{j}" in last]}


# ---------------------------------------------------------------------------------------------- vLLM

def acceptance(toy: Path, draft: Path, prompts: list[str], max_tokens: int) -> dict:
    from draftadapt.engine.rollout import RolloutEngine

    engine = RolloutEngine(toy, draft, method="eagle3", num_speculative_tokens=K, max_model_len=256,
                           max_num_seqs=64, kv_cache_gib=1, seed=0)
    try:
        acceptance = engine.generate(prompts, temperature=TEMPERATURE, max_tokens=max_tokens, seed=0).acceptance
    finally:
        engine.close()
    return {"acceptance_length": round(acceptance.length, 4), "per_position": [round(x, 4) for x in acceptance.per_position],
            "drafts": int(acceptance.drafts)}


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", type=Path, help="the toy target (draftadapt toy build --out DIR)")
    ap.add_argument("--out", type=Path, help="working directory (data, drafts, logs)")
    ap.add_argument("--steps", type=int, default=288, help="optimizer steps for each trainer (recipe: 3 x 96)")
    ap.add_argument("--train-prompts", type=int, default=1536, help="prompts the target answers for training")
    ap.add_argument("--heldout-prompts", type=int, default=64, help="held-out sequences (pretrain's score, "
                    "speculators' validation split)")
    ap.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts served in vLLM per draft")
    ap.add_argument("--max-tokens", type=int, default=96, help="response budget when serving")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per draftadapt step; speculators "
                    "packs as many tokens on average into its one row")
    ap.add_argument("--head", choices=["original", "speculators"], default="original",
                    help="the head both train: draftadapt's recipe (the original Eagle-3 norms) or with "
                    "the three norms speculators' trainer adds by default")
    ap.add_argument("--data", type=Path, help="regenerated data of an earlier run (OUT/draftadapt/pretrain/data)")
    ap.add_argument("--pretrain-arg", action="append", default=[], help="extra draftadapt pretrain key=value")
    ap.add_argument("--speculators-arg", action="append", default=[], help="extra speculators train flag")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--speculators-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.speculators_child is not None:
        argv = json.loads(args.speculators_child.read_text())
        speculators_train_cpu(argv, args.speculators_child.parent / "metrics.jsonl")
        return
    if args.toy is None or args.out is None or not (args.toy / "config.json").is_file():
        ap.error("--toy DIR (a built toy target: draftadapt toy build --out DIR) and --out DIR are required")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    from draftadapt.drafts.formats import load_eagle3
    from draftadapt.evaluate import eval_prompts

    log(f"[1/4] draftadapt pretrain, {args.steps} steps ...")
    ours = draftadapt_pretrain(args, args.out / "draftadapt")
    head = load_eagle3(args.out / "draftadapt", args.toy)
    aux_ids, width = list(head.cfg.aux_layer_ids), head.cfg.intermediate_size

    log(f"[2/4] speculators train, {args.steps} steps, on the same sequences ...")
    theirs = speculators_pretrain(args, args.out / "speculators", args.out / "draftadapt/pretrain/data", aux_ids, width)
    imported = args.out / "speculators_draft"
    run([sys.executable, "-m", "draftadapt.cli", "draft", "init", "--target", str(args.toy), "--method", "eagle3",
         "--from", theirs["checkpoint"], "--out", str(imported)], args.out / "import.log")

    log("[3/4] the untrained head ...")
    untrained = untrained_head(args, args.out / "untrained")

    log(f"[4/4] acceptance in vLLM (k={K}, T={TEMPERATURE}, {args.eval_prompts} held-out prompts), three engines ...")
    prompts = eval_prompts(args.toy, args.eval_prompts, seed=0)
    served = {name: acceptance(args.toy, path, prompts, args.max_tokens)
              for name, path in (("untrained", untrained), ("draftadapt", args.out / "draftadapt"),
                                 ("speculators", imported))}

    result = {
        "toy": str(args.toy), "head": args.head, "steps": args.steps, "k": K, "temperature": TEMPERATURE,
        "eval_prompts": len(prompts), "train_sequences": ours["train_sequences"],
        "untrained": served["untrained"],
        "draftadapt": {**served["draftadapt"], "steps": ours["steps"], "seconds_per_step": ours["seconds_per_step"],
                       "capture_seconds": ours["capture_seconds"], "train_seconds": ours["train_seconds"],
                       "acceptance_length_simulated": ours["acceptance_length_simulated"]},
        "speculators": {**served["speculators"], **theirs},
        "speculators_cpu_settings": list(CPU_SETTINGS),
    }
    rows = [("untrained (step 0)", served["untrained"], "-", "-"),
            ("draftadapt pretrain", served["draftadapt"], ours["steps"], f"{ours['seconds_per_step']:.3f}"),
            ("speculators train", served["speculators"], theirs["steps"], f"{theirs['seconds_per_step']:.3f}")]
    print("| draft | optimizer steps | s / step (fwd+bwd+opt) | acceptance length (vLLM) | per position |")
    print("|---|---|---|---|---|")
    for name, acc, steps, sps in rows:
        per = ", ".join(f"{x:.2f}" for x in acc["per_position"])
        print(f"| {name} | {steps} | {sps} | {acc['acceptance_length']:.3f} | {per} |")
    if args.json:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
