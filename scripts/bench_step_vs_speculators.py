"""One optimizer step of an Eagle-3 head: draftadapt's ``DraftTrainer.train_step`` against speculators
0.9.0's ``Eagle3DraftModel`` forward + backward + clip + optimizer, same tokens, same head widths, one run.

    python scripts/bench_step_vs_speculators.py [--size 1b] [--seqs 2] [--seq-len 512] [--steps 3] [--json]

Rows, each in its own child process (so each peak is its own): draftadapt with its lm_head trained,
draftadapt with it frozen (``train.freeze_lm_head``: speculators' trainer keeps its lm_head frozen at
the target's rows, so this is the equal-work row), ``--reference`` adds both with
``train.loss_chunk=0`` (every step's logits at once), and speculators. Then the ratios
draftadapt / speculators of step time and peak memory (issue 48's bar: <= 1.0 for the frozen row at
equal work; issue 54's: <= 1.0 for the trained row, draftadapt's default, at ``--precision defaults``).

Same work on both sides: ``--seqs`` random sequences of ``--seq-len`` tokens (every token a loss
token but each sequence's last), three TTT steps (weights 0.8^i), random weights at the size's
widths (``bench_adapter.SIZES``: a 128256-token target vocabulary, a 32000-token draft vocabulary),
float32 master weights, global grad-norm clip 1.0. ``--precision defaults`` (the default): each
side at its own defaults, draftadapt at ``train.precision=auto`` with AdamW (betas 0.9 / 0.95),
speculators as its trainer runs unless told otherwise, bf16 autocast on any device and Muon + AdamW
(issue 54's bar); ``auto`` / ``bf16`` / ``fp32``: that precision on both sides and AdamW on both
(equal work). draftadapt reads the sequences as rows of a batch with the target's draft-vocab
log-probs (what its capture hands over); speculators packs them into one row with document ids and
computes the targets itself from the target's last hidden state through its frozen verifier lm_head
(its KL loss in eager form, ``resolve_loss_config("kl_div", "eager")``). Attention: draftadapt's
SDPA with a block-diagonal causal mask, uncompiled; speculators' ``eager`` on CPU, its default flex
attention (and its ``torch.compile`` of forward) on CUDA (``--speculators-attn``). On CUDA both run
under bf16 autocast.

Per row: step_ms (median wall time of ``--steps`` steps after one warm-up), cpu_ms (the same steps'
CPU time over all threads: on a shared machine the work done, where wall time also counts the
waits for a core), tokens_s, and peak memory:
on CUDA ``torch.cuda.max_memory_allocated`` over the steps; on CPU the child's resident set: its
high-water mark (VmHWM, reset through /proc/self/clear_refs just before the warm-up step) as
``peak_gib``, and that minus the resident set before the step (weights and batch already built)
as ``step_gib``, what gradients, optimizer state, activations and transients add. torch's CPU
allocator returns large blocks to the OS on free, so the resident set follows live tensors.

A GPU machine without a package index (issue 48): unpack the wheels of speculators 0.9.0, pydantic,
pydantic-core, loguru, annotated-types and typing-inspection into a folder and pass it as
``--wheels DIR``; ``speculators.train.data`` (openai, datasets) is stubbed when it cannot import,
the model needs only its ``BatchType``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from bench_adapter import SIZES, _sync, build_head, random_batch

TTT_STEPS, DECAY, LR, CLIP = 3, 0.8, 3e-4, 1.0


# ---------------------------------------------------------------------------------------------- memory

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak memory of the block: CUDA's allocator peak, or on CPU the resident set's high-water mark."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.before = _status_kib("VmRSS") * 1024
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = _status_kib("VmHWM") * 1024


# ---------------------------------------------------------------------------------------------- the two sides

def draftadapt_step(size: str, batch, precision: str, freeze_lm_head: bool, loss_chunk: int | None):
    from draftadapt.train.trainer import DraftTrainer, TrainConfig

    chunk = {} if loss_chunk is None else {"loss_chunk": loss_chunk}
    cfg = TrainConfig(lr=LR, beta1=0.9, beta2=0.95, grad_clip=CLIP, warmup_steps=0, schedule="constant",
                      batch_size=batch.input_ids.shape[0], ttt_steps=TTT_STEPS, step_decay=DECAY,
                      precision=precision, freeze_lm_head=freeze_lm_head, **chunk)
    trainer = DraftTrainer(build_head(size), "eagle3", cfg)
    batch = batch.to(trainer.device)
    return lambda: trainer.train_step(batch)["train/loss"], {"loss_chunk": trainer.cfg.loss_chunk,
                                                             "precision": trainer.precision, "optimizer": "AdamW"}


def import_speculators(wheels: str | None):
    """speculators' Eagle-3 model and loss config (with the GPU machine's setup: module docstring)."""
    if wheels:
        sys.path.append(wheels)
    try:
        import speculators.train.data  # noqa: F401
    except ImportError:  # openai, datasets or hs_connectors missing: the model needs only BatchType
        sys.modules.setdefault("speculators.train", types.ModuleType("speculators.train"))
        data = types.ModuleType("speculators.train.data")
        data.BatchType = dict
        sys.modules["speculators.train.data"] = data
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel, resolve_loss_config("kl_div", "eager")


def speculators_model(size: str, attn: str, wheels: str | None):
    """An ``Eagle3DraftModel`` at the size's widths, built in code as on the H200 (issue 48): its
    config, its vocabulary maps (the first 32000 target ids), the NaN-initialised embed_tokens,
    lm_head and verifier weights filled with random ones (lm_head = verifier_lm_head: frozen at
    the target's rows, as its trainer keeps it)."""
    from transformers import LlamaConfig

    Eagle3DraftModel, loss_config = import_speculators(wheels)
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from draftadapt.drafts.eagle3 import default_aux_layers

    s = SIZES[size]
    layer = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv"], head_dim=s["head_dim"], vocab_size=s["vocab"],
                        num_hidden_layers=1, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=10000.0)
    layer._attn_implementation = attn
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=s["draft_vocab"],
        eagle_aux_hidden_state_layer_ids=default_aux_layers(s["layers"]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_config(layer, name_or_path=None)))
    with torch.device("cpu"):
        model = Eagle3DraftModel(cfg)
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[: s["draft_vocab"]] = True
    model.load_vocab_mappings(t2d, torch.zeros(s["draft_vocab"], dtype=torch.long))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=g) * 0.02)
        model.verifier_lm_head.weight.copy_(torch.randn(model.verifier_lm_head.weight.shape, generator=g) * 0.02)
        model.lm_head.weight.copy_(model.verifier_lm_head.weight)
        model.verifier_norm.weight.fill_(1.0)
    return model.train(), loss_config


# speculators 0.9.0's trainer at its defaults (speculators/train/config/schema.py): forward under
# autocast at hidden_states_dtype, "bfloat16", on any device (train/trainer.py); optimizer "muon"
# (torch's Muon on the 2-D matrices, AdamW on the rest, OptimizerArgs' defaults; train/optimizers.py).
SPECULATORS_DEFAULT_PRECISION = "bf16"


def speculators_optimizers(model, params, defaults: bool) -> list:
    """AdamW over the trained parameters (the equal-work comparison), or with ``defaults``
    speculators' own ``build_optimizers`` at its default ``OptimizerArgs`` (speculators is
    importable by now: ``speculators_model`` put any ``--wheels`` on the path)."""
    if not defaults:
        return [torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)]
    from speculators.train.config.schema import OptimizerArgs
    from speculators.train.optimizers import build_optimizers

    args = OptimizerArgs()
    if args.muon_lr is None:  # what speculators' TrainConfig resolves an unset muon_lr to
        args.muon_lr = args.lr
    return build_optimizers(model, args)


def speculators_step(size: str, batch, precision: str, attn: str, wheels: str | None):
    model, loss_config = speculators_model(size, attn, wheels)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    defaults = precision == "defaults"
    if defaults:
        precision = SPECULATORS_DEFAULT_PRECISION
    seqs, seq_len = batch.input_ids.shape
    s = SIZES[size]
    g = torch.Generator().manual_seed(1)
    inputs = {  # the same sequences, packed as speculators' data pipeline leaves them (shift_batch)
        "hidden_states": batch.aux.reshape(1, seqs * seq_len, -1),
        "input_ids": torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1).reshape(1, -1),
        "document_ids": torch.arange(seqs).repeat_interleave(seq_len)[None],
        "loss_mask": batch.loss_mask.reshape(1, -1),
        "position_ids": torch.arange(seq_len).repeat(seqs)[None],
        "verifier_last_hidden_states": torch.randn(1, seqs * seq_len, s["hidden"], generator=g),
    }
    inputs = {k: v.to(device) for k, v in inputs.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opts = speculators_optimizers(model, params, defaults)
    bf16 = precision == "bf16" or (precision == "auto" and device == "cuda")
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16)

    def step() -> float:
        with autocast:
            _, loss, _ = model(**inputs, ttt_steps=TTT_STEPS, ttt_step_loss_decay=DECAY, loss_config=loss_config)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, {"precision": "bf16" if bf16 else "fp32", "optimizer": "+".join(type(o).__name__ for o in opts)}


def child(spec: dict) -> dict:
    """One row: build its side, then a warm-up and ``steps`` timed steps under PeakMemory."""
    torch.set_num_threads(spec["threads"])
    cuda = torch.cuda.is_available()
    batch = random_batch(spec["size"], spec["seqs"], spec["seq_len"], 0, "cuda" if cuda else "cpu")
    row = {"row": spec["row"]}
    if spec["row"] == "speculators":
        step, info = speculators_step(spec["size"], batch, spec["precision"], spec["attn"], spec["wheels"])
        row.update(info, attention=spec["attn"])
        del batch  # speculators reads its packed copy; the draft-vocab log-probs are draftadapt's input
    else:
        # "defaults": draftadapt's own default (train.precision=auto) against speculators' defaults
        precision = "auto" if spec["precision"] == "defaults" else spec["precision"]
        step, info = draftadapt_step(spec["size"], batch, precision, spec["freeze"], spec["loss_chunk"])
        row.update(info, attention="sdpa")
    times, cpu = [], []
    with PeakMemory(cuda) as mem:
        for i in range(spec["steps"] + 1):  # the first is a warm-up
            _sync()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step()
            _sync()
            if i:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    if loss != loss:
        raise RuntimeError(f"{spec['row']}: the loss is NaN")
    step_s = statistics.median(times)
    tokens = spec["seqs"] * spec["seq_len"]
    return {**row, "step_ms": round(step_s * 1e3, 1), "cpu_ms": round(statistics.median(cpu) * 1e3, 1),
            "tokens_s": round(tokens / step_s),
            "peak_gib": round(mem.peak / 2**30, 3),
            "step_gib": None if cuda else round((mem.peak - mem.before) / 2**30, 3),
            "loss": round(loss, 4)}


# ---------------------------------------------------------------------------------------------- main

def run_child(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"row": spec["row"], "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratios(rows: list[dict]) -> dict:
    """draftadapt / speculators, per draftadapt row: step time and peak memory (< 1: draftadapt's less)."""
    ref = next((r for r in rows if r["row"] == "speculators" and "error" not in r), None)
    out = {}
    for r in rows:
        if ref is None or r["row"] == "speculators" or "error" in r:
            continue
        out[r["row"]] = {"step": round(r["step_ms"] / ref["step_ms"], 3), "cpu": round(r["cpu_ms"] / ref["cpu_ms"], 3),
                         "peak": round(r["peak_gib"] / ref["peak_gib"], 3)}
        if r.get("step_gib") is not None:
            out[r["row"]]["step_mem"] = round(r["step_gib"] / ref["step_gib"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", choices=sorted(SIZES), help="the head's widths (bench_adapter.SIZES)")
    ap.add_argument("--seqs", type=int, default=2, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads in each child")
    ap.add_argument("--precision", default="defaults", choices=["defaults", "auto", "bf16", "fp32"],
                    help="defaults: each side at its own defaults (draftadapt train.precision=auto; speculators' "
                         "trainer: bf16 autocast and Muon + AdamW); auto / bf16 / fp32: the same on both sides, "
                         "AdamW on both (auto: bf16 autocast on CUDA, float32 on CPU)")
    ap.add_argument("--speculators-attn", default=None,
                    help="speculators' attention: eager on CPU, simple_flex_attention on CUDA by default")
    ap.add_argument("--reference", action="store_true", help="also draftadapt with train.loss_chunk=0")
    ap.add_argument("--wheels", default=os.environ.get("SPECULATORS_WHEELS"),
                    help="a folder of unpacked wheels for speculators (a GPU machine without an index)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.seqs < 1 or args.seq_len < 2 or args.steps < 1 or args.threads < 1:
        ap.error("--seqs, --steps and --threads must be >= 1 and --seq-len >= 2")
    cuda = torch.cuda.is_available()
    attn = args.speculators_attn or ("simple_flex_attention" if cuda else "eager")
    base = {"size": args.size, "seqs": args.seqs, "seq_len": args.seq_len, "steps": args.steps,
            "threads": args.threads, "precision": args.precision, "attn": attn, "wheels": args.wheels}
    specs = [{**base, "row": "draftadapt lm_head trained", "freeze": False, "loss_chunk": None},
             {**base, "row": "draftadapt lm_head frozen", "freeze": True, "loss_chunk": None}]
    if args.reference:
        specs += [{**s, "row": s["row"] + ", loss_chunk=0", "loss_chunk": 0} for s in specs]
    specs.append({**base, "row": "speculators"})
    rows = []
    for spec in specs:
        rows.append(run_child(spec))
        print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if cuda else f"cpu, {args.threads} threads"
    result = {"device": device, "precision": args.precision, "size": args.size, "tokens_per_step": args.seqs * args.seq_len,
              "seqs": args.seqs, "seq_len": args.seq_len, "ttt_steps": TTT_STEPS, "rows": rows,
              "ratio_vs_speculators": ratios(rows)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"device: {device}; {args.size} widths; {args.seqs} x {args.seq_len} tokens, {TTT_STEPS} TTT steps")
    cols = ["row", "step_ms", "cpu_ms", "tokens_s", "peak_gib", "step_gib", "precision", "optimizer", "attention"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, r.get("error") if c == "step_ms" else "-")) for c in cols))
    for name, q in result["ratio_vs_speculators"].items():
        print(f"{name} / speculators: step {q['step']}x (CPU time {q['cpu']}x), peak {q['peak']}x"
              + (f", step memory {q['step_mem']}x" if "step_mem" in q else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
