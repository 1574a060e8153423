"""The weight path at real sizes: policy updates and draft swaps into a running in-process engine.

    .venv/bin/python scripts/bench_scale.py [--sizes 5m,100m,1b] [--dtypes bfloat16,float32]
                                            [--updates 3] [--swaps 12] [--json]

For each size and dtype: a random-weight Llama target (5m: a toy; 100m: GPT-2-small-like widths;
1b: Llama-3.2-1B's shape) and an Eagle-3 head for it (one decoder layer, the target's widths, a
32k draft vocabulary for the 128k-vocabulary target as Llama-3 Eagle-3 heads ship), written to a
scratch directory and served by an in-process RolloutEngine in that dtype. Then:

- policy update: the trainer's state dict (its own tensors, in the model's dtype) into the engine
  with ``update_policy`` (no file), ``--updates`` times; median ms, GB/s of model bytes, and the
  peak RSS the update adds over the model's bytes (VmHWM after /proc/self/clear_refs);
- integrity: the draft-integrity check after an update (``engine.draft_state()``, what
  ``DraftAdapter.check_integrity`` reads), median ms;
- draft swap: ``swap_draft`` of published versions (manifest checks, sha256, load, read-back),
  p50 and p95 over ``--swaps``.

``--json`` prints one object: {"sizes": [{"params", "dtype", "policy_update_ms",
"policy_update_gb_s", "draft_swap_p50_ms", "draft_swap_p95_ms", "update_peak_rss_over_model",
"integrity_ms", ...}]}. Needs about 3x the largest model's bytes in RAM (1b float32: ~15 GiB).
Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

SIZES = {
    # name: Llama widths; draft_vocab None = the target's whole vocabulary
    "5m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=4096, draft_vocab=None),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000, draft_vocab=None),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, draft_vocab=32000),
}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """VmHWM back to the current RSS (Linux: "5" into clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def build_target(root: Path, size: str, dtype: torch.dtype, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Llama model directory with random weights (N(0, 0.02), norms 1) and the toy tokenizer;
    returns it and its state dict (anonymous memory: the trainer's own tensors)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftadapt.toy.tokenizer import build_tokenizer

    spec = {k: v for k, v in SIZES[size].items() if k != "draft_vocab"}
    cfg = LlamaConfig(**spec, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.dtype = str(dtype).removeprefix("torch.")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=dtype)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.copy_(torch.randn(shape, generator=g) * 0.02) if t.numel() < (1 << 26) else _fill_randn(t, g)
        sd[name] = t
    out = root / f"target-{size}-{cfg.dtype}"
    out.mkdir(parents=True)
    cfg.save_pretrained(str(out))
    save_file(sd, str(out / "model.safetensors"))
    build_tokenizer().save_pretrained(str(out))
    return out, sd


def _fill_randn(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """randn into a large tensor a slice at a time (no full-size float32 temporary)."""
    flat = t.view(-1)
    for i in range(0, flat.numel(), 1 << 24):
        n = min(1 << 24, flat.numel() - i)
        flat[i:i + n].copy_(torch.randn(n, generator=g) * 0.02)
    return t


def build_drafts(root: Path, target: Path, sd: dict[str, torch.Tensor], size: str, n: int) -> list[Path]:
    """``n`` published versions of an Eagle-3 head for ``target`` (one DraftStore, so each swap
    passes the same checks a run's swaps do)."""
    from transformers import AutoConfig

    from draftadapt.data.store import DraftStore
    from draftadapt.drafts.eagle3 import init_from_target
    from draftadapt.drafts.formats import export_eagle3

    tc = AutoConfig.from_pretrained(str(target))
    embed = torch.nn.Embedding.from_pretrained(sd["model.embed_tokens.weight"])
    shim = SimpleNamespace(config=tc, get_input_embeddings=lambda: embed)
    head = init_from_target(shim, None, SIZES[size]["draft_vocab"], None, seed=0)
    store = DraftStore(root / f"drafts-{size}-{tc.dtype}")
    dirs = []
    for i in range(n):
        with torch.no_grad():  # each version differs (a swap that changes nothing proves nothing)
            for p in head.parameters():
                if p.requires_grad:
                    p.add_(1e-3)
        version, path = store.publish(lambda tmp, v: export_eagle3(head, tmp, target, meta={"version": v,
                                                                                          "policy_version": 0}),
                                      policy_version=0)
        dirs.append(Path(path))
    return dirs


def measure(size: str, dtype: torch.dtype, updates: int, swaps: int, root: Path) -> dict:
    from draftadapt.engine.rollout import RolloutEngine, percentile

    t0 = time.perf_counter()
    target, sd = build_target(root, size, dtype, seed=0)
    drafts = build_drafts(root, target, sd, size, swaps + 1)
    params = sum(t.numel() for t in sd.values())
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    built_s = time.perf_counter() - t0
    engine = RolloutEngine(target, drafts[0], num_speculative_tokens=3, max_model_len=256, max_num_seqs=8,
                           kv_cache_gib=1, in_process=True, dtype=dtype)
    try:
        engine.generate([[5, 6, 7, 8]] * 2, max_tokens=8, seed=0)  # it serves
        with torch.no_grad():
            for t in sd.values():  # the trainer moved on: the update carries new values
                t.mul_(1.001)
        update_ms, peak = [], []
        for _ in range(updates):
            gc.collect()
            rss0 = _rss_kib("VmRSS")
            _reset_peak_rss()
            t1 = time.perf_counter()
            engine.update_policy(sd)
            update_ms.append((time.perf_counter() - t1) * 1e3)
            peak.append((_rss_kib("VmHWM") - rss0) * 1024)
        integrity_ms = []
        for _ in range(updates):
            t1 = time.perf_counter()
            engine.draft_state()
            integrity_ms.append((time.perf_counter() - t1) * 1e3)
        swap_ms = [engine.swap_draft(d).ms for d in drafts[1:]]
        engine.generate([[5, 6, 7, 8]] * 2, max_tokens=8, seed=0)  # still serves after all that
    finally:
        engine.close()
    upd = statistics.median(update_ms)
    return {
        "size": size, "params": params, "dtype": str(dtype).removeprefix("torch."), "model_bytes": model_bytes,
        "policy_update_ms": upd, "policy_update_gb_s": model_bytes / 1e9 / (upd / 1e3),
        "update_ms_all": update_ms,
        "update_peak_rss_over_model": max(peak) / model_bytes,
        "integrity_ms": statistics.median(integrity_ms),
        "integrity_over_update": statistics.median(integrity_ms) / upd,
        "draft_swap_p50_ms": percentile(swap_ms, 50), "draft_swap_p95_ms": percentile(swap_ms, 95),
        "draft_bytes": (drafts[0] / "model.safetensors").stat().st_size,
        "engine_start_s": engine.startup_s, "build_s": built_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5m,100m,1b")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--swaps", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sizes = a.sizes.split(",")
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        print(f"error: --sizes {bad}: choose from {sorted(SIZES)}", file=sys.stderr)
        return 2
    try:
        dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    except AttributeError as exc:
        print(f"error: --dtypes: {exc}; use bfloat16 and/or float32", file=sys.stderr)
        return 2
    rows = []
    # vLLM logs to stdout: with --json, everything but the one JSON line goes to stderr
    saved = os.dup(1) if a.json else None
    if saved is not None:
        sys.stdout.flush()
        os.dup2(2, 1)
    try:
        rows = run_all(sizes, dtypes, a)
    finally:
        if saved is not None:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    if a.json:
        print(json.dumps({"sizes": rows}))
    return 0


def run_all(sizes: list[str], dtypes: list[torch.dtype], a: argparse.Namespace) -> list[dict]:
    rows = []
    for size in sizes:
        for dtype in dtypes:
            root = Path(tempfile.mkdtemp(prefix=f"bench-scale-{size}-"))
            try:
                row = measure(size, dtype, a.updates, a.swaps, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
                gc.collect()
            rows.append(row)
            if not a.json:
                print(f"{size:>5} {row['dtype']:>8} {row['params'] / 1e6:8.1f}M params | update "
                      f"{row['policy_update_ms']:8.1f} ms {row['policy_update_gb_s']:5.2f} GB/s, peak RSS +"
                      f"{row['update_peak_rss_over_model']:.3f}x model | integrity {row['integrity_ms']:6.1f} ms "
                      f"({row['integrity_over_update']:.1%} of update) | swap p50 {row['draft_swap_p50_ms']:6.1f} "
                      f"p95 {row['draft_swap_p95_ms']:6.1f} ms ({row['draft_bytes'] / 1e6:.0f} MB)", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
