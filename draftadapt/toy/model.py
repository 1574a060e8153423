"""The tiny toy target, built from a small dataclass config with a fixed seed.

Llama by default, Qwen3 (same sizes, with q/k norm) as the option. Both are plain HF
``*ForCausalLM`` models, so the saved directory loads in transformers and vLLM alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from draftadapt.toy.tokenizer import BOS_ID, EOS_ID, PAD_ID

ARCHS = ("llama", "qwen3", "qwen2")  # qwen2: the body of the MTP toy (toy/mtp.py)


@dataclass
class ToyModelConfig:
    arch: str = "llama"  # "llama", "qwen3" or "qwen2" (q/k/v bias; the MTP toy's body)
    # Deep and narrow, so that a one-layer Eagle-3 head weighs against the target roughly as it
    # does at real sizes (docs/design.md, "The toy world's proportions"): 16 layers x 128.
    num_layers: int = 16  # Eagle-3 aux layers (2, 8, 13)
    hidden_size: int = 128
    num_heads: int = 2  # head_dim = hidden_size / num_heads = 64
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 64  # 25 real tokens padded up to a multiple of 8
    max_position_embeddings: int = 256  # prompt + response fit in 128; room to spare
    rope_theta: float = 10000.0


def hf_config(cfg: ToyModelConfig) -> LlamaConfig | Qwen3Config | Qwen2Config:
    if cfg.arch not in ARCHS:
        raise ValueError(f"unknown toy arch {cfg.arch!r}; choose one of {ARCHS}")
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-6,
        # Separate lm_head: drafts that share the target's embeddings must not also
        # share (and later overwrite) its output head; docs/design.md, "Failures other systems shipped".
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    if cfg.arch == "llama":
        return LlamaConfig(**common)
    if cfg.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    return Qwen3Config(**common, use_sliding_window=False)


def build_model(cfg: ToyModelConfig, seed: int = 0) -> PreTrainedModel:
    """A freshly initialised model; the same ``seed`` gives the same weights."""
    torch.manual_seed(seed)
    hf = hf_config(cfg)
    model = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM}[cfg.arch](hf)
    return model
