"""The adapter's training side at real sizes: one Eagle-3 head's optimizer step, held-out score
and publish, on whatever device the trainer picks (a CUDA GPU when there is one).

    python scripts/bench_adapter.py [--sizes 1b,8b] [--precisions auto] [--seqs 8] [--seq-len 4096]
                                    [--slots 1.0,0.25] [--steps 5] [--json]

For each size (Llama-3 widths: 1b = Llama-3.2-1B, 8b = Llama-3.1-8B; a 128k target vocabulary,
a 32k draft vocabulary as Llama-3 Eagle-3 heads ship; ``smollm2`` for the real-model world's head,
``toy`` for a CPU smoke run) the head is built with random weights and trained by draftadapt's own
DraftTrainer on random captured batches of ``--seqs`` x ``--seq-len`` tokens (every token a
response token: what a long RL rollout gives), the default three-step training-time test at each ``--slots`` share. Per row:

- step_ms: median wall time of an optimizer step after one warm-up (device synchronised);
- tokens_s and tflops: tokens per second, and the matmul FLOPs of the head's trainable
  parameters (6 per parameter per token per TTT position; attention's T^2 term left out) per second;
- peak_gib: peak device memory of the step (CUDA only);
- score_ms: the simulated acceptance of one held-out batch (what the gate runs each round);
- publish_ms: what a publish costs the round (Publisher.publish): the trained head and the
  optimizer state copied to host memory, and a copy on the device (the live draft the gate scores);
- write_ms: what the publisher's writer thread does beside the next round: the head written as
  bf16 safetensors, sha256 of the file, the trainer state saved.

``--handover`` also times ``HandOver.add`` for both stores (AdapterConfig.handover_store), one
micro-batch of ``--seqs`` rollouts: ``handover_ms_per_seq`` is what the RL trainer's step waits for
(add() returned and its own kernels on the trainer's stream done), ``copied_ms_per_seq`` the time
until the rows have landed in host memory (on a GPU the copies run on a side stream), each with its
GB/s per rollout, and ``cold_ms_per_seq`` the first add's (pinned buffers allocated). ``--no-train``
skips the training rows.

``--policy`` times the policy's own update at each precision instead (what `grpo.precision` sets
in the demo): one micro-batch of ``--seqs`` x ``--seq-len`` through a Llama of the size's widths and
full depth (random weights), the GRPO forward (draftadapt/rl/grpo.py::token_logprobs) and its
backward, float32 or under bf16 autocast; ``policy_ms`` the median, ``kl`` the bf16 log-probs'
mean KL to float32's per token (nats).

round_s is the adapter's round at its defaults (ScheduleConfig.train_steps optimizer steps, two
held-out batches, one publish's copies). ``--json`` prints {"device": ..., "rows": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    # Eagle-3 head widths for the target: hidden, MLP, heads, kv heads, head dim, target layers
    "toy": dict(hidden=64, inter=128, heads=4, kv=2, head_dim=16, layers=4, vocab=512, draft_vocab=256),
    # SmolLM2-135M-Instruct (the real-model world), its recipe's 8192-token draft vocabulary
    "smollm2": dict(hidden=576, inter=1536, heads=9, kv=3, head_dim=64, layers=30, vocab=49152, draft_vocab=8192),
    "1b": dict(hidden=2048, inter=8192, heads=32, kv=8, head_dim=64, layers=16, vocab=128256, draft_vocab=32000),
    "8b": dict(hidden=4096, inter=14336, heads=32, kv=8, head_dim=128, layers=32, vocab=128256, draft_vocab=32000),
}


def build_head(size: str):
    from draftadapt.drafts.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers

    s = SIZES[size]
    cfg = Eagle3Config(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv"], head_dim=s["head_dim"], target_hidden_size=s["hidden"],
                       target_vocab_size=s["vocab"], draft_vocab_size=s["draft_vocab"],
                       aux_layer_ids=default_aux_layers(s["layers"]), max_position_embeddings=131072,
                       target_num_layers=s["layers"])
    with torch.device("cpu"):
        head = Eagle3Head(cfg)
    head.init_weights(seed=0)
    head.embed_tokens.weight.requires_grad_(False)  # the target's own embeddings (shared)
    return head


def random_batch(size: str, seqs: int, seq_len: int, seed: int, device: str):
    """Random captured batch, drawn on ``device`` (an 8b batch is ~6 GB of float32)."""
    from draftadapt.capture.hidden import CapturedBatch

    s = SIZES[size]
    g = torch.Generator(device).manual_seed(seed)
    ids = torch.randint(0, s["vocab"], (seqs, seq_len), generator=g, device=device)
    loss_mask = torch.ones(seqs, seq_len, dtype=torch.bool, device=device)
    loss_mask[:, -1] = False
    # log-probs over the draft vocabulary, normalised over the whole target vocabulary (most
    # mass inside the draft's 32k, as on real text); float32 as the adapter hands them over
    logp = torch.log_softmax(torch.randn(seqs, seq_len, s["draft_vocab"], generator=g, device=device), -1) - 0.05
    aux = torch.randn(seqs, seq_len, 3 * s["hidden"], generator=g, device=device)
    return CapturedBatch(ids, torch.ones(seqs, seq_len, dtype=torch.long, device=device), loss_mask, logp, aux)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_stream() -> None:
    """The current stream's work done (the RL trainer's), not a side stream's."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def trainable_params(head) -> int:
    return sum(p.numel() for p in head.parameters() if p.requires_grad)


def bench_one(size: str, precision: str, slots: float, batch, steps: int) -> dict:
    from safetensors.torch import save_file

    from draftadapt.drafts.formats import eagle3_state_dict
    from draftadapt.fileio import file_sha256
    from draftadapt.publish import host_copy
    from draftadapt.train.trainer import DraftTrainer, TrainConfig

    head = build_head(size)
    n_params = trainable_params(head)
    seqs, seq_len = batch.input_ids.shape
    cfg = TrainConfig(lr=3e-4, warmup_steps=0, schedule="constant", batch_size=seqs, precision=precision,
                      ttt_slots=slots)
    trainer = DraftTrainer(head, "eagle3", cfg)
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):  # the first is a warm-up
        _sync()
        t0 = time.perf_counter()
        m = trainer.train_step(batch)
        _sync()
        if i:
            times.append(time.perf_counter() - t0)
    if not all(map(lambda v: v == v, m.values())):
        raise RuntimeError(f"{size} {precision}: non-finite training metrics {m}")
    step_s = statistics.median(times)
    tokens = seqs * seq_len
    positions = 1 + (cfg.ttt_steps - 1) * slots  # TTT positions per token
    tflops = 6 * n_params * tokens * positions / step_s / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    _sync()
    t0 = time.perf_counter()
    trainer.score([batch], k=3)
    _sync()
    score_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        _sync()
        t0 = time.perf_counter()
        draft = trainer.export_draft()
        trainer.live_copy()  # the publisher's live draft, copied on the device
        state = host_copy(trainer.resume_state())
        _sync()
        publish_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # the writer thread's part (Publisher._write)
        path = Path(d) / "model.safetensors"
        save_file(eagle3_state_dict(draft, "speculators", "bfloat16"), str(path))
        file_sha256(path)
        torch.save({**state, "weights": draft.state_dict()}, Path(d) / "resume.pt")
        write_s = time.perf_counter() - t0
    from draftadapt.adapter import ScheduleConfig

    round_s = ScheduleConfig().train_steps * step_s + 2 * score_s + publish_s
    row = {"size": size, "precision": trainer.precision, "ttt_slots": slots, "device": str(trainer.device),
           "trainable_params": n_params, "tokens_per_step": tokens, "step_ms": round(step_s * 1e3, 1),
           "tokens_s": round(tokens / step_s), "tflops": round(tflops, 1),
           "peak_gib": None if peak is None else round(peak, 1), "score_ms": round(score_s * 1e3, 1),
           "publish_ms": round(publish_s * 1e3, 1), "write_ms": round(write_s * 1e3, 1), "round_s": round(round_s, 2), "loss": round(m["train/loss"], 3)}
    del trainer, head
    if cuda:
        torch.cuda.empty_cache()
    return row


def bench_handover(size: str, seqs: int, seq_len: int, device: str, store: str = "logp") -> dict:
    """``HandOver.add`` on one micro-batch of the RL trainer's forward: the per-row log-softmax
    over the target vocabulary, restricted to the draft's, and both tensors to host memory
    (``store="hidden"``: the output head's input and the log-normaliser instead of the log-probs).
    The policy is the size's widths with 3 decoder layers (the hooks read layers 1-3), bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftadapt.capture.hidden import HandOver

    s = SIZES[size]
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=3,
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"],
                      vocab_size=s["vocab"], max_position_embeddings=max(seq_len, 2048))
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, s["vocab"], (seqs, seq_len), generator=g, device=device)
    mask = torch.ones_like(ids)
    added, copied = [], []  # seconds until add() returned (its kernels done), until the rows landed
    with HandOver(model, [1, 2, 3], torch.arange(s["draft_vocab"]), 1.0, store=store) as ho, torch.no_grad():
        for i in range(4):  # the first allocates the pinned buffers (cold); later ones reuse them
            logits = model(input_ids=ids, attention_mask=mask).logits
            _sync()
            t0 = time.perf_counter()
            ho.add(list(range(seqs)), logits, mask)
            _sync_stream()
            added.append(time.perf_counter() - t0)
            ho.wait_copies()
            copied.append(time.perf_counter() - t0)
            del logits
    row = ho.rows[0]
    host_mb = sum(t.numel() * t.element_size() for t in row.values()) / 2**20
    add_s, copied_s = statistics.median(added[1:]), statistics.median(copied[1:])
    del model, ho
    if device == "cuda":
        torch.cuda.empty_cache()
    per_seq = lambda sec: round(sec / seqs * 1e3, 1)  # noqa: E731
    gb_s = lambda sec: round(host_mb / 1024 / (sec / seqs), 2)  # noqa: E731 - per rollout
    return {"size": size, "store": store, "seq_len": seq_len, "handover_ms_per_seq": per_seq(add_s),
            "copied_ms_per_seq": per_seq(copied_s), "cold_ms_per_seq": per_seq(copied[0]),
            "host_mb_per_seq": round(host_mb, 3), "host_gb_s": gb_s(add_s), "copied_gb_s": gb_s(copied_s)}


def bench_policy(size: str, seqs: int, seq_len: int, precisions: list[str], steps: int, device: str) -> list[dict]:
    """The policy's micro-batch forward (token log-probs, as the demo's GRPO update takes them) and
    backward at each precision, on one random model and batch; rows with the median ms and each
    precision's mean KL to float32's log-probs (the first step's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftadapt.rl.grpo import token_logprobs
    from draftadapt.train.trainer import auto_precision

    s = SIZES[size]
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"],
                      vocab_size=s["vocab"], max_position_embeddings=max(seq_len, 2048), tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).train()
    g = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, s["vocab"], (seqs, seq_len), generator=g, device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    rows, ref = [], None
    for precision in precisions:
        bf16 = precision == "bf16" or precision == "auto" and auto_precision(torch.device(device), model) == "bf16"
        times = []
        for i in range(steps + 1):  # the first is a warm-up
            model.zero_grad(set_to_none=True)
            _sync()
            t0 = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                lp = token_logprobs(model, batch)
            (-lp.mean()).backward()
            _sync()
            if i:
                times.append(time.perf_counter() - t0)
            else:
                first = lp.detach().float()
        if ref is None and not bf16:
            ref = first
        # the k3 estimate of KL(bf16 || fp32) on the sampled tokens' log-probs, per token
        kl = None if ref is None else float(f"{float((torch.exp(ref - first) - (ref - first) - 1).mean()):.3g}")
        rows.append({"size": size, "precision": "bf16" if bf16 else "fp32", "seqs": seqs, "seq_len": seq_len,
                     "layers": s["layers"], "policy_ms": round(statistics.median(times) * 1e3, 1), "kl": kl})
        print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b,8b", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--precisions", default="auto",
                    help="comma-separated train.precision values: auto (bf16 on CUDA, fp32 on CPU), bf16, fp32")
    ap.add_argument("--slots", default="1.0", help="comma-separated train.ttt_slots shares, each in (0, 1]")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps per row (after one warm-up)")
    ap.add_argument("--handover", action="store_true",
                    help="also time HandOver.add on one micro-batch of --seqs x --seq-len (a 3-layer policy of each size)")
    ap.add_argument("--policy", action="store_true",
                    help="time the policy's GRPO micro-batch forward + backward at each --precisions (full depth) instead")
    ap.add_argument("--no-train", action="store_true", help="skip the training rows (with --handover: the hand-over alone)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes {unknown}: known sizes are {sorted(SIZES)}")
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in precisions if p not in ("auto", "bf16", "fp32")]
    if bad:
        ap.error(f"--precisions {bad}: use auto, bf16 or fp32")
    slots = [float(x) for x in args.slots.split(",") if x]
    if not all(0 < x <= 1 for x in slots):
        ap.error(f"--slots {slots}: each share must be in (0, 1]")
    if args.seqs < 1 or args.seq_len < 2 or args.steps < 1:
        ap.error("--seqs and --steps must be >= 1 and --seq-len >= 2")

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.policy:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        rows = [r for size in sizes for r in bench_policy(size, args.seqs, args.seq_len, precisions, args.steps, dev)]
        if args.json:
            print(json.dumps({"device": device, "policy": rows}))
        else:
            for r in rows:
                print(f"policy {r['size']} ({r['layers']} layers) {r['precision']}: {r['seqs']} x {r['seq_len']} tokens, "
                      f"forward + backward {r['policy_ms']} ms, KL to float32 {r['kl']} nats a token")
        return 0
    rows = []
    for size in [] if args.no_train else sizes:
        batch = random_batch(size, args.seqs, args.seq_len, 0, "cuda" if torch.cuda.is_available() else "cpu")
        for precision in precisions:
            for share in slots:
                try:
                    rows.append(bench_one(size, precision, share, batch, args.steps))
                except torch.cuda.OutOfMemoryError as e:  # one row too big: say so, go on with the rest
                    rows.append({"size": size, "precision": precision, "ttt_slots": share,
                                 "error": f"out of memory: {str(e).splitlines()[0]}"})
                    torch.cuda.empty_cache()
                print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        del batch
    handover = []
    if args.handover:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for size in sizes:
            for store in ("logp", "hidden"):
                handover.append(bench_handover(size, args.seqs, args.seq_len, dev, store))
                print(f"  {json.dumps(handover[-1])}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"device": device, "rows": rows, "handover": handover}))
        return 0
    print(f"device: {device}; {args.seqs} x {args.seq_len} tokens per step")
    cols = ["size", "precision", "ttt_slots", "trainable_params", "step_ms", "tokens_s", "tflops", "peak_gib",
            "score_ms", "publish_ms", "write_ms", "round_s"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, r.get("error") if c == "step_ms" else "-")) for c in cols))
    for h in handover:
        print(f"hand-over {h['size']} store={h['store']}: {h['host_mb_per_seq']} MB to host memory per "
              f"{h['seq_len']}-token sequence; the step waits {h['handover_ms_per_seq']} ms ({h['host_gb_s']} GB/s), "
              f"landed after {h['copied_ms_per_seq']} ms ({h['copied_gb_s']} GB/s); first add "
              f"{h['cold_ms_per_seq']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
