"""The small external draft LM (vLLM ``method="draft_model"``): an HF causal LM sharing the target's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftadapt.drafts.formats import (
    META_FILE,
    WEIGHTS_FILE,
    copy_tokenizer,
    read_hf_config,
    target_fingerprint,
)
from draftadapt.fileio import atomic_write_json, file_sha256, fsync_dir


def build_small_lm(target_dir: str | Path, num_layers: int = 2, hidden_size: int = 128,
                   num_heads: int = 4, seed: int = 0):
    """A Llama draft with the target's vocabulary and positions, ``num_layers`` deep, fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = read_hf_config(target_dir)
    if "text_config" in tc:
        tc = {**tc, **tc["text_config"]}
    cfg = LlamaConfig(
        vocab_size=tc["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2 + hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        # never below the target's: vLLM clamps RoPE and acceptance collapses past it
        max_position_embeddings=tc["max_position_embeddings"],
        rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
        bos_token_id=tc.get("bos_token_id"),
        eos_token_id=tc.get("eos_token_id"),
        pad_token_id=tc.get("pad_token_id"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def export_small_lm(model, out: str | Path, target_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer(target_dir, out)
    info = {
        "method": "draft_model",
        "format": "hf",
        "target": target_fingerprint(target_dir),
        "shared_modules": [],
        "max_position_embeddings": model.config.max_position_embeddings,
        **(meta or {}),
        "sha256": file_sha256(out / WEIGHTS_FILE),
    }
    atomic_write_json(out / META_FILE, info)
    fsync_dir(out)
    return out


def load_small_lm(draft_dir: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(draft_dir), torch_dtype=torch.float32)
