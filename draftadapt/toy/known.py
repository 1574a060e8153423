"""A target whose next-token distribution is known exactly: the reference for losslessness checks.

Every decoder layer writes zero into the residual stream (``o_proj`` and ``down_proj`` are
zero), so the final hidden state is the RMS-normalised embedding of the current token. With
one-hot embeddings and ``lm_head[v, t] = L[t, v] / sqrt(H)`` the logits at a position are
exactly ``L[current token]``: the model is a first-order Markov chain with transition matrix
``softmax(L)``. Sampling from it at temperature 1, speculative or not, must reproduce that
matrix; a broken rejection sampler does not.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from draftadapt.toy.tokenizer import EOS_ID, build_tokenizer, vocab

# Next-token offsets and their probabilities (any token t -> t+1, t+2 or t+5 in the real range).
OFFSETS = (1, 2, 5)
PROBS = (0.6, 0.25, 0.15)
FIRST_REAL = 4  # ids below are <pad> <s> </s> <unk>


def transition_matrix(vocab_size: int) -> torch.Tensor:
    """[V, V] row-stochastic; rows of special tokens start the chain at FIRST_REAL."""
    n_real = len(vocab()) - FIRST_REAL
    p = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for t in range(vocab_size):
        base = t - FIRST_REAL if FIRST_REAL <= t < FIRST_REAL + n_real else 0
        for off, prob in zip(OFFSETS, PROBS):
            p[t, FIRST_REAL + (base + off) % n_real] += prob
    return p


def build_known_target(out: str | Path, arch: str = "llama", num_layers: int = 2, mtp: int = 0) -> Path:
    """``mtp`` > 0 (with ``arch="qwen2"``): also that many MTP layers (toy/mtp.py) whose output is
    the normalised one-hot of the token they read, so through the same lm_head they propose from
    the chain's own row: x_{t+2} ~ P[x_{t+1}], the exact conditional (a high-acceptance proposer)."""
    from draftadapt.toy.model import ToyModelConfig, build_model

    vocab_size = 64
    hidden = vocab_size  # one-hot embeddings need hidden >= vocab
    cfg = ToyModelConfig(arch=arch, num_layers=num_layers, hidden_size=hidden, num_heads=2,
                         num_kv_heads=2, intermediate_size=128, vocab_size=vocab_size)
    model = build_model(cfg, seed=0)
    p = transition_matrix(vocab_size)
    logits = torch.where(p > 0, p.clamp_min(1e-30).log(), torch.full_like(p, -40.0))  # [V(cur), V(next)]
    logits[:, EOS_ID] = -40.0  # never stop: every sequence runs to max_tokens
    scale = 4.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        model.get_input_embeddings().weight.copy_(torch.eye(vocab_size) * scale)
        # norm(one_hot * scale) = one_hot * sqrt(H); undo that factor in the head.
        model.lm_head.weight.copy_((logits.T / math.sqrt(hidden)).float())
    out = Path(out)
    model.save_pretrained(str(out))
    build_tokenizer().save_pretrained(str(out))
    if mtp:
        _add_known_mtp(out, model, mtp)
    return out


def _add_known_mtp(out: Path, model, mtp: int) -> None:
    from draftadapt.drafts.mtp import MTP_ARCH, MTPConfig, MTPHead
    from draftadapt.toy.mtp import save_mtp

    hidden = model.config.hidden_size
    head = MTPHead(MTPConfig.from_hf({**model.config.to_dict(), "architectures": [MTP_ARCH],
                                      "num_nextn_predict_layers": mtp}))
    head.init_weights(0)
    with torch.no_grad():
        for layer in head.layers:
            # x = input_proj([norm(h) ; norm(e)]) = norm(e) = sqrt(H) * one_hot(token); the block
            # adds nothing (zero o_proj, down_proj) and final_layernorm keeps it
            layer.input_proj.weight.zero_()
            layer.input_proj.weight[:, hidden:].copy_(torch.eye(hidden))
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    save_mtp(out, head)
