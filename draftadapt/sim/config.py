"""The simulator's recipe schema: one dataclass tree, read by ``draftadapt.config.load_config``.

Each field says what it is and its unit where it is declared. ``validate()`` methods
reject values the model cannot mean (negative times, acceptance above k+1, ...) with a
``ConfigError`` that names the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from draftadapt.config import ConfigError
from draftadapt.sim.hardware import GPUS, MODELS

Mode = Literal["sync", "async"]


def _nonneg(section: str, **values: float | None) -> None:
    for name, value in values.items():
        if value is not None and value < 0:
            raise ConfigError(f"{section}.{name}={value} is negative; times, sizes and rates must be >= 0")


def _fraction(section: str, name: str, value: float, *, zero_ok: bool = False) -> None:
    low_ok = value >= 0 if zero_ok else value > 0
    if not (low_ok and value <= 1):
        interval = "[0, 1]" if zero_ok else "(0, 1]"
        raise ConfigError(f"{section}.{name}={value} must lie in {interval} (it is a fraction)")


@dataclass
class TargetConfig:
    model: str = "qwen3-8b"  # key of draftadapt.sim.hardware.MODELS
    weight_bytes: float = 2.0  # bytes per weight in the rollout engine: 2 = BF16, 1 = FP8
    kv_bytes: float = 2.0  # bytes per KV-cache element

    def validate(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"target.model={self.model!r} is unknown; use one of {sorted(MODELS)}")
        if self.weight_bytes <= 0 or self.kv_bytes <= 0:
            raise ConfigError("target.weight_bytes and target.kv_bytes must be > 0 (2 = BF16, 1 = FP8)")


@dataclass
class SpecConfig:
    method: Literal["eagle3", "draft_model", "ngram"] = "eagle3"  # the drafter priced: an Eagle-3 head, a draft LM (spec.draft_params_b) or n-gram
    k: int = 3  # speculative tokens proposed per step
    # Mean tokens emitted per verify step, bonus token included (vLLM: 1 + accepted / drafts).
    accept_length: float = 1.0
    # Per-position acceptance (vLLM accepted_tokens_per_pos / drafts: P(first i+1 accepted)).
    # When given it wins over accept_length, which must then agree or be left at its default.
    accept_pos: list[float] | None = None
    draft_params_b: float | None = None  # draft weights, billions; None = Eagle-3 head of the target
    draft_vocab: int = 32000  # Eagle-3 reduced vocabulary (published Qwen3/Llama heads)
    # Relative loss of per-token acceptance per RL step for a frozen draft (drift), and the
    # acceptance length a completely stale draft keeps (decay is towards it).
    drift_per_step: float = 0.0  # a frozen draft's relative loss of per-token acceptance per RL step
    accept_floor: float = 1.0  # the acceptance length a completely stale draft keeps

    def validate(self) -> None:
        if self.k < 0:
            raise ConfigError(f"spec.k={self.k} must be >= 0 (0 turns speculation off)")
        if self.accept_pos is not None:
            if len(self.accept_pos) != self.k:
                raise ConfigError(
                    f"spec.accept_pos has {len(self.accept_pos)} entries but spec.k={self.k}; "
                    "give one acceptance rate per speculative position"
                )
            for i, p in enumerate(self.accept_pos):
                if not 0 <= p <= 1:
                    raise ConfigError(f"spec.accept_pos[{i}]={p} must lie in [0, 1]")
                if i and p > self.accept_pos[i - 1] + 1e-9:
                    raise ConfigError(
                        f"spec.accept_pos[{i}]={p} exceeds position {i - 1} ({self.accept_pos[i - 1]}): "
                        "position i is accepted only if all earlier ones are, so rates cannot rise"
                    )
            from_pos = 1.0 + sum(self.accept_pos)
            if self.accept_length != 1.0 and abs(from_pos - self.accept_length) > 1e-3:
                raise ConfigError(
                    f"spec.accept_length={self.accept_length} disagrees with spec.accept_pos "
                    f"(1 + sum = {from_pos:.3f}); set only one of them"
                )
            self.accept_length = from_pos
        if not 1.0 <= self.accept_length <= self.k + 1 + 1e-9:
            raise ConfigError(
                f"spec.accept_length={self.accept_length} must lie in [1, k+1] = [1, {self.k + 1}]: "
                "a verify step emits at most k drafted tokens plus one bonus token; "
                "lower it or raise spec.k"
            )
        if not 1.0 <= self.accept_floor <= self.accept_length + 1e-9:
            raise ConfigError(
                f"spec.accept_floor={self.accept_floor} must lie in [1, spec.accept_length="
                f"{self.accept_length}] (a stale draft does not get better)"
            )
        if not 0 <= self.drift_per_step < 1:
            raise ConfigError(f"spec.drift_per_step={self.drift_per_step} must lie in [0, 1)")
        _nonneg("spec", draft_params_b=self.draft_params_b)
        if self.draft_vocab <= 0:
            raise ConfigError(f"spec.draft_vocab={self.draft_vocab} must be > 0")


@dataclass
class EngineConfig:
    """The rollout engine (vLLM) on one generation replica of ``tp`` GPUs."""

    gpu: str = "GB200"  # key of draftadapt.sim.hardware.GPUS
    tp: int = 1  # GPUs per replica (tensor / expert parallel); replicas = gen GPUs / tp
    bw_eff: float = 0.8  # share of datasheet HBM bandwidth decode reaches
    flops_eff: float = 0.6  # share of dense peak that decode/verify GEMMs reach
    step_overhead_ms: float = 1.0  # per target forward: scheduling, launch, sampling
    draft_overhead_ms: float = 0.3  # per draft forward (Eagle-3 runs k per step); n-gram: per step
    verify_overhead_ms: float = 0.2  # per speculative step: rejection sampling, bookkeeping
    allreduce_us: float = 8.0  # latency of one all-reduce inside a replica (2 per layer if tp > 1)
    # Verify attention (docs/design.md "Simulator: draft length and n-gram"): up to
    # decode_max_q query tokens per sequence (k + 1) run in the decode kernel, priced by the
    # roofline above; more take a kernel whose time follows each sequence's own context,
    # fallback_ns_per_ctx ns per token of the mean sequence's context per query token (0 = off)
    decode_max_q: int = 4  # query tokens per sequence (k + 1) the decode kernel verifies; more take the fallback
    fallback_ns_per_ctx: float = 0.0  # ns per context token per query token past decode_max_q (0 = off)
    # n-gram proposer: host-side matching over every running sequence's whole history each
    # step, ns per context token (vLLM's n-gram proposer runs on the CPU; 0 = free)
    ngram_ns_per_token: float = 0.0
    max_num_seqs: int = 1024  # vLLM max_num_seqs
    mem_util: float = 0.9  # vLLM gpu_memory_utilization: weights + KV cache budget

    def validate(self) -> None:
        if self.gpu not in GPUS:
            raise ConfigError(f"engine.gpu={self.gpu!r} is unknown; use one of {sorted(GPUS)}")
        if self.tp < 1 or self.max_num_seqs < 1:
            raise ConfigError("engine.tp and engine.max_num_seqs must be >= 1")
        _fraction("engine", "bw_eff", self.bw_eff)
        _fraction("engine", "flops_eff", self.flops_eff)
        _fraction("engine", "mem_util", self.mem_util)
        _nonneg("engine", step_overhead_ms=self.step_overhead_ms,
                draft_overhead_ms=self.draft_overhead_ms,
                verify_overhead_ms=self.verify_overhead_ms, allreduce_us=self.allreduce_us,
                fallback_ns_per_ctx=self.fallback_ns_per_ctx, ngram_ns_per_token=self.ngram_ns_per_token)
        if self.decode_max_q < 1:
            raise ConfigError(f"engine.decode_max_q={self.decode_max_q} must be >= 1 (query tokens per sequence)")


@dataclass
class WorkloadConfig:
    """One RL step's rollouts. Response lengths are log-normal, cut at ``max_tokens``
    (the long tail: a truncated response sits at the cap)."""

    rollouts: int = 8192  # sequences per step (prompts x generations per prompt)
    prompt_tokens: int = 256  # mean prompt length
    median_tokens: float = 2000.0  # median response length before the cap
    sigma: float = 1.0  # log-normal shape: larger = longer tail
    max_tokens: int = 16384  # response length cap (max_tokens)

    def validate(self) -> None:
        if self.rollouts < 1 or self.max_tokens < 1:
            raise ConfigError("workload.rollouts and workload.max_tokens must be >= 1")
        _nonneg("workload", prompt_tokens=self.prompt_tokens, sigma=self.sigma)
        if self.median_tokens <= 0:
            raise ConfigError(f"workload.median_tokens={self.median_tokens} must be > 0")


@dataclass
class ClusterConfig:
    gpus: int = 32  # all GPUs of the run
    colocated: bool = True  # generation and training take turns on the same GPUs
    gen_gpus: int | None = None  # not colocated: GPUs that only generate
    train_gpus: int | None = None  # not colocated: GPUs that only train (and compute logprobs)

    def validate(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"cluster.gpus={self.gpus} must be >= 1")
        if self.colocated:
            if self.gen_gpus is not None or self.train_gpus is not None:
                raise ConfigError(
                    "cluster.gen_gpus/train_gpus are for a split cluster; "
                    "set cluster.colocated=false or drop them"
                )
        else:
            if self.gen_gpus is None or self.train_gpus is None:
                raise ConfigError("cluster.colocated=false needs cluster.gen_gpus and cluster.train_gpus")
            if self.gen_gpus < 1 or self.train_gpus < 1 or self.gen_gpus + self.train_gpus != self.gpus:
                raise ConfigError(
                    f"cluster.gen_gpus={self.gen_gpus} + cluster.train_gpus={self.train_gpus} "
                    f"must be positive and add up to cluster.gpus={self.gpus}"
                )


@dataclass
class LearnerConfig:
    """The policy trainer (Megatron in the paper): logprob and train are compute-bound."""

    peak: Literal["bf16", "fp8"] = "bf16"  # which datasheet peak the MFUs refer to
    logprob_mfu: float = 0.3  # model FLOPs utilisation of the logprob forward
    train_mfu: float = 0.4  # of the training forward + backward (3x forward FLOPs)
    logprob_passes: int = 1  # forwards per step (2 with a KL reference model)
    data_s: float = 0.0  # data stage, seconds
    prepare_fixed_s: float = 0.0  # weight sync to the engine: fixed part, seconds
    sync_gbps: float = 100.0  # weight sync rate, GB/s of weights per step (prepare = fixed + bytes / rate)

    def validate(self) -> None:
        _fraction("learner", "logprob_mfu", self.logprob_mfu)
        _fraction("learner", "train_mfu", self.train_mfu)
        if self.logprob_passes < 0:
            raise ConfigError(f"learner.logprob_passes={self.logprob_passes} must be >= 0")
        _nonneg("learner", data_s=self.data_s, prepare_fixed_s=self.prepare_fixed_s)
        if self.sync_gbps <= 0:
            raise ConfigError(f"learner.sync_gbps={self.sync_gbps} must be > 0")


@dataclass
class PipelineConfig:
    modes: list[Mode] = field(default_factory=lambda: ["sync"])  # pipelines to simulate
    max_lag: int = 1  # async: rollouts of step j come from policy version >= j - max_lag
    # async batching: "finished" = a step trains on the next rollouts to finish (the tail of
    # one batch overlaps the next; PipelineRL/AReaL style); "prompts" = a step trains on its
    # own prompts' rollouts, generated up to max_lag versions ahead (one-step-off style)
    async_batching: Literal["finished", "prompts"] = "finished"
    steps: int = 8  # RL steps simulated to reach the steady state (split cluster)
    # async weight sync: true = the trainer broadcasts the new weights (NCCL from the training
    # ranks), so each train step also holds the trainer for the weight sync (learner.prepare_*)
    # and generation pauses meanwhile; false = the engine loads them after the step and only
    # generation pauses (docs/design.md "Simulator: asynchronous steps")
    sync_on_trainer: bool = False

    def validate(self) -> None:
        if not self.modes:
            raise ConfigError("pipeline.modes is empty; use [sync], [async] or [sync, async]")
        if self.max_lag < 1:
            raise ConfigError(f"pipeline.max_lag={self.max_lag} must be >= 1 (0 is the sync pipeline)")
        if self.steps < 3:
            raise ConfigError(f"pipeline.steps={self.steps} must be >= 3 to see a steady state")


@dataclass
class SharedCoresConfig:
    """Asynchronous RL on one machine whose cores generation and training share (the demo:
    ``draftadapt demo async_lag=1`` on 2 CPU cores; docs/design.md "Simulator: asynchronous
    steps", "The demo's step on shared cores"). Each slowdown is a stage's wall time at its share of the cores beside
    the other job over its wall time alone on every core; ``draftadapt.sim.calibrate.
    predict_demo_async`` fits them to a run's telemetry."""

    # the generation, at its share (1 of 2 threads) for its whole run beside the trainer
    gen_slowdown: float = 1.0
    # the trainer (policy update, then the adapter's round) while the generation runs; it takes
    # every core back once the generation is done
    train_slowdown: float = 1.0
    # per step outside the logged stages: launching the next generation, pushing the new policy
    # into the engine's process, seconds
    boundary_s: float = 0.0

    def validate(self) -> None:
        for name in ("gen_slowdown", "train_slowdown"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cores.{name}={getattr(self, name)} must be > 0 (a wall-time ratio)")
        _nonneg("cores", boundary_s=self.boundary_s)


@dataclass
class AdaptConfig:
    """Online draft adaptation: restores acceptance at a price."""

    enabled: bool = False  # also project the adapted configuration (the `adapt` rows)
    every_steps: int = 1  # adapt (and swap) every N RL steps
    train_s: float = 0.0  # side-trainer time per adaptation, seconds
    exposed_frac: float = 0.0  # share of train_s on the step's critical path (0 = fully overlapped)
    swap_ms: float = 21.0  # generation paused per draft swap (21 ms measured in-place on CPU, docs/design.md "In-place swaps")
    accept_length: float | None = None  # acceptance right after adapting; None = spec.accept_length
    horizon_steps: int = 100  # RL steps averaged over

    def validate(self) -> None:
        if self.every_steps < 1 or self.horizon_steps < 1:
            raise ConfigError("adapt.every_steps and adapt.horizon_steps must be >= 1")
        _nonneg("adapt", train_s=self.train_s, swap_ms=self.swap_ms)
        _fraction("adapt", "exposed_frac", self.exposed_frac, zero_ok=True)


@dataclass
class CalibrationConfig:
    """Fit the recipe to a real run before simulating (draftadapt.sim.calibrate)."""

    telemetry: str | None = None  # JSON-lines telemetry of the run (see draftadapt.sim.telemetry)
    free: list[str] | None = None  # dotted fields to fit; None = what the logged stages pin down


# The figures the model computes (model.simulate), named mode.name.config: declared here, where
# a Published figure is checked against them, so the model imports this module and not back.
CONFIGS = ("plain", "spec", "adapt")
STAGES = ("accept_length", "prepare_s", "gen_s", "exposed_gen_s", "logprob_s", "train_s",
          "adapt_s", "data_s", "step_s")
RATIOS = ("gen_share", "gen_speedup", "e2e_speedup", "ceiling")
FIGURES = tuple(
    f"{mode}.{name}.{config}"
    for mode in ("sync", "async") for config in CONFIGS for name in STAGES + RATIOS
    if not (mode == "async" and name == "ceiling")  # the paper's bound is for a sync step
)


@dataclass
class Published:
    """A figure from the paper and the recipe variant that projects it."""

    figure: str  # e.g. sync.gen_speedup.spec; see FIGURES
    value: float
    source: str = ""  # where the paper states it
    overrides: list[str] = field(default_factory=list)  # key=value applied on top of the recipe
    gated: bool = True  # counted in the reproduction bar (within ``tolerance``)
    calibrated: bool = False  # the recipe's free parameters were fitted to this figure
    tolerance: float = 0.10  # allowed relative error
    note: str = ""  # why a figure is not gated, or what it rests on

    def validate(self) -> None:
        if self.value <= 0:
            raise ConfigError(f"published {self.figure}: value {self.value} must be > 0")
        if self.tolerance <= 0:
            raise ConfigError(f"published {self.figure}: tolerance {self.tolerance} must be > 0")


@dataclass
class SimConfig:
    name: str = "simulation"  # the recipe's name, heading its table and plot
    target: TargetConfig = field(default_factory=TargetConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    sweep_points: int = 9  # acceptance lengths in the speedup curve (plot, --json)
    assumptions: list[str] = field(default_factory=list)  # inputs the paper does not give, stated
    published: list[Published] = field(default_factory=list)  # the paper's figures, each beside its projection

    def validate(self) -> None:
        if "async" in self.pipeline.modes and self.cluster.colocated:
            raise ConfigError(
                "pipeline.modes has async but cluster.colocated=true: asynchronous RL overlaps "
                "generation and training, so it needs separate GPUs; set cluster.colocated=false "
                "with cluster.gen_gpus and cluster.train_gpus"
            )
        gen_gpus = self.cluster.gpus if self.cluster.colocated else self.cluster.gen_gpus
        if gen_gpus % self.engine.tp:
            raise ConfigError(
                f"{gen_gpus} generation GPUs do not split into replicas of engine.tp={self.engine.tp}"
            )
        if self.adapt.accept_length is not None and not (
            1.0 <= self.adapt.accept_length <= self.spec.k + 1 + 1e-9
        ):
            raise ConfigError(
                f"adapt.accept_length={self.adapt.accept_length} must lie in [1, k+1] = "
                f"[1, {self.spec.k + 1}]"
            )
        if self.sweep_points < 2:
            raise ConfigError(f"sweep_points={self.sweep_points} must be >= 2")
        for pub in self.published:
            if pub.figure not in FIGURES:
                raise ConfigError(
                    f"published figure {pub.figure!r} is not one the model computes; "
                    "use mode.name.config, e.g. sync.gen_speedup.spec (see draftadapt.sim.config.FIGURES)"
                )
