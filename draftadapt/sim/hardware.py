"""Datasheet numbers the simulator starts from: GPUs and target architectures.

Everything here is a published spec, not a measurement; how much of it a real engine
reaches is an efficiency in the recipe (``engine.bw_eff``, ``engine.flops_eff``,
``learner.*_mfu``). Per-GPU figures are dense (no 2:4 sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense BF16 tensor-core peak, TFLOP/s
    fp8_tflops: float  # dense FP8 tensor-core peak, TFLOP/s
    hbm_gb: float  # HBM capacity, GB (1e9 bytes)
    hbm_tbps: float  # HBM bandwidth, TB/s
    link_gbps: float  # NVLink bandwidth per GPU, one direction, GB/s
    source: str


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        # GB200 NVL72 datasheet, rack totals / 72 GPUs: FP8 720 PF sparse -> 5 PF dense,
        # BF16 360 PF sparse -> 2.5 PF dense, 13.4 TB HBM3e at 576 TB/s, NVLink 130 TB/s.
        GPU("GB200", 2500.0, 5000.0, 186.0, 8.0, 900.0,
            "NVIDIA GB200 NVL72 datasheet (rack figures / 72)"),
        # HGX B200 datasheet, 8-GPU totals / 8: FP8 72 PF sparse, 1.44 TB HBM3e at 64 TB/s.
        GPU("B200", 2250.0, 4500.0, 180.0, 8.0, 900.0,
            "NVIDIA HGX B200 datasheet (8-GPU figures / 8)"),
        # H100 SXM5 datasheet: BF16 1979 TF sparse, FP8 3958 TF sparse, 80 GB HBM3 at 3.35 TB/s,
        # NVLink 4 900 GB/s bidirectional.
        GPU("H100", 989.0, 1979.0, 80.0, 3.35, 450.0, "NVIDIA H100 SXM5 datasheet"),
        # H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s.
        GPU("H200", 989.0, 1979.0, 141.0, 4.8, 450.0, "NVIDIA H200 SXM datasheet"),
    )
}


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer as the roofline sees it (values from the HF config.json)."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width, or one expert's width for MoE
    vocab: int
    experts: int = 0  # 0 = dense
    experts_per_token: int = 0

    @property
    def attn_params(self) -> float:
        """q, k, v, o projections of one layer."""
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def mlp_params(self) -> float:
        """One layer's MLP if dense, one expert if MoE (gate, up, down)."""
        return 3 * self.hidden * self.intermediate

    @property
    def dense_params(self) -> float:
        """Weights every decode step reads whatever the batch: attention of every layer,
        the dense MLPs, the lm_head (the input embedding is a gather, not a read)."""
        mlp = 0.0 if self.experts else self.layers * self.mlp_params
        return self.layers * self.attn_params + mlp + self.vocab * self.hidden

    @property
    def expert_params(self) -> float:
        return float(self.layers * self.experts * self.mlp_params)

    @property
    def total_params(self) -> float:
        return self.dense_params + self.expert_params + self.vocab * self.hidden

    @property
    def active_params(self) -> float:
        """Matmul weights one token goes through (2 FLOPs each per token)."""
        if not self.experts:
            return self.dense_params
        return self.dense_params + self.layers * self.experts_per_token * self.mlp_params

    @property
    def kv_elems_per_token(self) -> float:
        """K and V elements one token of context holds, all layers."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim

    @property
    def attn_flops_per_ctx(self) -> float:
        """Attention FLOPs per query token per token of context (QK^T and PV), all layers."""
        return 4.0 * self.layers * self.q_heads * self.head_dim


MODELS: dict[str, Arch] = {
    a.name: a
    for a in (
        # Qwen/Qwen3-8B config.json: 8.19B parameters.
        Arch("qwen3-8b", layers=36, hidden=4096, q_heads=32, kv_heads=8, head_dim=128,
             intermediate=12288, vocab=151936),
        # Qwen/Qwen3-32B config.json.
        Arch("qwen3-32b", layers=64, hidden=5120, q_heads=64, kv_heads=8, head_dim=128,
             intermediate=25600, vocab=151936),
        # Qwen/Qwen3-235B-A22B config.json: 128 experts of width 1536, 8 routed per token;
        # 235B total, 22B active.
        Arch("qwen3-235b-a22b", layers=94, hidden=4096, q_heads=64, kv_heads=4, head_dim=128,
             intermediate=1536, vocab=151936, experts=128, experts_per_token=8),
    )
}


def eagle3_head(target: Arch, draft_vocab: int = 32000, intermediate: int | None = None) -> Arch:
    """The Eagle-3 draft head for ``target`` as one extra decoder layer.

    Eagle-3 (Li et al. 2025) fuses three target hidden states (fc: 3h -> h), runs one
    decoder layer whose attention reads [embedding; hidden] (2h inputs) and predicts over
    a reduced draft vocabulary (32k in the published Qwen3/Llama heads). The MLP width
    defaults to the target's dense width, or 8 experts' worth for an MoE target
    (an assumption: published MoE heads differ).
    """
    width = intermediate or (target.intermediate * max(target.experts_per_token, 1))
    return Arch(
        name=f"eagle3({target.name})", layers=1, hidden=target.hidden,
        q_heads=target.q_heads, kv_heads=target.kv_heads, head_dim=target.head_dim,
        intermediate=width, vocab=draft_vocab,
    )


def eagle3_params(target: Arch, draft_vocab: int = 32000, intermediate: int | None = None) -> float:
    head = eagle3_head(target, draft_vocab, intermediate)
    h = target.hidden
    q = head.q_heads * head.head_dim
    kv = head.kv_heads * head.head_dim
    attn = 2 * h * (q + 2 * kv) + q * h  # q, k, v read 2h inputs; o maps back to h
    return 3 * h * h + attn + head.mlp_params + draft_vocab * h


def lookup_gpu(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPUS)}") from None


def lookup_model(name: str) -> Arch:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown target model {name!r}; known: {sorted(MODELS)}") from None
