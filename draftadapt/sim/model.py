"""The RL step model: what one step costs with and without speculation, sync and async.

Units: seconds, bytes, FLOPs, tokens, unless a name says otherwise (``_ms``, ``_gb``).

The pieces, bottom up:

* acceptance: per-position acceptance -> expected tokens per verify step (``tau``), and the
  decay of a frozen draft's acceptance as the policy drifts;
* decode roofline: one engine step on a replica of ``tp`` GPUs reads the weights (for MoE
  only the experts the batch routes to) and the KV cache of every running sequence, and
  does 2 FLOPs per weight per token plus attention; it takes the slower of the two, plus
  all-reduces and a fixed per-forward overhead. A speculative step verifies k+1 tokens per
  sequence in one target forward and runs k draft forwards before it (an n-gram proposal
  instead: host-side matching over every sequence's history); a verify wider than the decode
  attention kernel takes (k+1 > decode_max_q) pays per token of the mean sequence's context;
* rollout generation: a fluid, event-driven simulation of one replica. Every running
  sequence advances ``tau`` tokens per step; a sequence leaves when its response is done
  (log-normal lengths, cut at max_tokens), so the batch shrinks and the late steps are
  small and memory-bound (the long tail); free slots take the next eligible sequence;
* the pipeline: colocated sync (prepare, gen, logprob, train one after another on all GPUs),
  split sync (generation GPUs wait for the new policy) and async with bounded staleness,
  where generation overlaps training and either a step trains on the next rollouts to
  finish, at most (max_lag + 1) batches in flight, so the next batch fills the slots the
  tail leaves free ("finished"), or on its own prompts' rollouts, generated up to max_lag
  policy versions ahead ("prompts");
* the run: acceptance drifts down for a frozen draft; adapting restores it at the
  side-trainer's exposed time and a swap pause.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Callable

import numpy as np

from draftadapt.config import ConfigError
from draftadapt.sim.config import CONFIGS, FIGURES, STAGES, SimConfig
from draftadapt.sim.hardware import Arch, eagle3_head, eagle3_params, lookup_gpu, lookup_model

# ---------------------------------------------------------------------------------------------
# acceptance


def rel_err(predicted: float, measured: float) -> float:
    """Relative error of a projection against what was measured or published (+0.1 = 10% high)."""
    return predicted / measured - 1.0


def accept_length(pos_rates: list[float] | np.ndarray) -> float:
    """Expected tokens per verify step. pos_rates[i] = P(draft tokens 0..i all accepted),
    the per-position rate vLLM reports (accepted_tokens_per_pos / drafts)."""
    return 1.0 + float(np.sum(pos_rates))


def geometric_pos(beta: float, k: int) -> np.ndarray:
    """Per-position rates [k] when each token is accepted with probability beta given the
    ones before it were."""
    return beta ** np.arange(1, k + 1)


def beta_for_length(alpha: float, k: int) -> float:
    """The per-token acceptance beta whose geometric profile gives acceptance length alpha
    (1 + beta + ... + beta^k = alpha)."""
    if k == 0 or alpha <= 1.0:
        return 0.0
    if alpha >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if accept_length(geometric_pos(mid, k)) < alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def decayed_length(alpha0: float, k: int, drift: float, steps: float, floor: float = 1.0) -> float:
    """Acceptance length of a draft ``steps`` RL steps after it matched the policy.

    The per-token acceptance beta loses ``drift`` of its distance to the floor's beta per step
    (beta_t = beta_f + (beta_0 - beta_f) (1 - drift)^t): a stale draft keeps the tokens any
    policy agrees on and loses the rest.
    """
    if drift == 0.0 or steps <= 0:
        return alpha0
    b0, bf = beta_for_length(alpha0, k), beta_for_length(floor, k)
    beta = bf + (b0 - bf) * (1.0 - drift) ** steps
    return accept_length(geometric_pos(beta, k))


# ---------------------------------------------------------------------------------------------
# decode roofline


@dataclass(frozen=True)
class EngineModel:
    """Per-GPU constants of one generation replica (tp GPUs), derived from a recipe."""

    tp: int
    dense_bytes: float  # weights every step reads, per GPU
    expert_bytes: float  # all routed-expert weights, per GPU (0 for dense models)
    top_frac: float  # experts_per_token / experts: share of experts one token touches
    kv_bytes_per_token: float  # KV cache bytes per context token, per GPU
    flops_per_token: float  # 2 x active matmul weights, per GPU
    attn_flops_per_ctx: float  # attention FLOPs per query token per context token, per GPU
    allreduce_s: float  # latency of the all-reduces of one forward
    allreduce_bytes_per_token: float  # all-reduce traffic per token of one forward, per GPU
    bw: float  # reachable HBM bandwidth, bytes/s
    flops: float  # reachable dense FLOP/s
    link: float  # NVLink bytes/s, one direction
    overhead_s: float  # fixed cost of one target forward
    decode_max_q: int  # most query tokens per sequence the decode attention kernel takes
    fallback_s_per_ctx: float  # beyond it: seconds per mean-sequence context token per query token
    ngram_s_per_ctx: float  # n-gram proposer: host-side seconds per context token per step
    # draft: one forward, same form (Eagle-3 head or small LM; zeros for n-gram)
    draft_bytes: float
    draft_kv_bytes_per_token: float
    draft_flops_per_token: float
    draft_attn_flops_per_ctx: float
    draft_allreduce_s: float
    draft_overhead_s: float
    draft_forwards_per_step: bool  # True: k draft forwards per step; False: one CPU proposal
    verify_overhead_s: float
    kv_capacity_tokens: float  # KV cache room of the replica, tokens
    weight_bytes_total: float  # target weights in the engine's dtype, whole model


def engine_model(cfg: SimConfig) -> EngineModel:
    arch = lookup_model(cfg.target.model)
    gpu = lookup_gpu(cfg.engine.gpu)
    e, t = cfg.engine, cfg.target
    tp = e.tp
    peak = (gpu.fp8_tflops if t.weight_bytes <= 1.0 else gpu.bf16_tflops) * 1e12
    kv_shards = min(tp, arch.kv_heads)  # beyond kv_heads, TP replicates KV heads
    allreduces = 2 * arch.layers if tp > 1 else 0  # after attention and after the MLP
    ring = 2.0 * (tp - 1) / tp if tp > 1 else 0.0  # ring all-reduce traffic factor

    if cfg.spec.method == "ngram":
        d_bytes = d_kv = d_flops = d_attn = d_ar = 0.0
        d_params = 0.0
    else:
        if cfg.spec.draft_params_b is not None:
            d_params = cfg.spec.draft_params_b * 1e9
        elif cfg.spec.method == "eagle3":
            d_params = eagle3_params(arch, cfg.spec.draft_vocab)
        else:
            raise ConfigError("spec.method=draft_model needs spec.draft_params_b (the draft LM's size)")
        if cfg.spec.method == "eagle3":
            head: Arch = eagle3_head(arch, cfg.spec.draft_vocab)
            d_kv = head.kv_elems_per_token * t.kv_bytes / kv_shards
            d_attn = head.attn_flops_per_ctx / tp
            d_ar = 2 * e.allreduce_us * 1e-6 if tp > 1 else 0.0
        else:  # small draft LM: KV and attention scaled from the target by size (assumption)
            scale = d_params / arch.total_params
            d_kv = scale * arch.kv_elems_per_token * t.kv_bytes / kv_shards
            d_attn = scale * arch.attn_flops_per_ctx / tp
            d_ar = scale * allreduces * e.allreduce_us * 1e-6
        d_bytes = d_params * t.weight_bytes / tp
        d_flops = 2.0 * d_params / tp

    budget = gpu.hbm_gb * 1e9 * tp * e.mem_util
    weights = arch.total_params * t.weight_bytes + d_params * t.weight_bytes
    kv_per_token = arch.kv_elems_per_token * t.kv_bytes * tp / kv_shards  # whole replica
    if weights >= budget:
        raise ConfigError(
            f"{arch.name} weights ({weights / 1e9:.0f} GB) do not fit in engine.tp={tp} x "
            f"{gpu.hbm_gb:.0f} GB x mem_util {e.mem_util}; raise engine.tp or lower target.weight_bytes"
        )
    return EngineModel(
        tp=tp,
        dense_bytes=arch.dense_params * t.weight_bytes / tp,
        expert_bytes=arch.expert_params * t.weight_bytes / tp,
        top_frac=(arch.experts_per_token / arch.experts) if arch.experts else 0.0,
        kv_bytes_per_token=arch.kv_elems_per_token * t.kv_bytes / kv_shards,
        flops_per_token=2.0 * arch.active_params / tp,
        attn_flops_per_ctx=arch.attn_flops_per_ctx / tp,
        allreduce_s=allreduces * e.allreduce_us * 1e-6,
        allreduce_bytes_per_token=allreduces * arch.hidden * 2.0 * ring,
        bw=gpu.hbm_tbps * 1e12 * e.bw_eff,
        flops=peak * e.flops_eff,
        link=gpu.link_gbps * 1e9,
        overhead_s=e.step_overhead_ms * 1e-3,
        decode_max_q=e.decode_max_q,
        fallback_s_per_ctx=e.fallback_ns_per_ctx * 1e-9,
        ngram_s_per_ctx=e.ngram_ns_per_token * 1e-9 if cfg.spec.method == "ngram" else 0.0,
        draft_bytes=d_bytes,
        draft_kv_bytes_per_token=d_kv,
        draft_flops_per_token=d_flops,
        draft_attn_flops_per_ctx=d_attn,
        draft_allreduce_s=d_ar,
        draft_overhead_s=e.draft_overhead_ms * 1e-3,
        draft_forwards_per_step=cfg.spec.method != "ngram",
        verify_overhead_s=e.verify_overhead_ms * 1e-3,
        kv_capacity_tokens=(budget - weights) / kv_per_token,
        weight_bytes_total=arch.total_params * t.weight_bytes,
    )


def target_step_s(m: EngineModel, b: float, ctx: float, q: int = 1) -> float:
    """One target forward over b sequences with ``ctx`` context tokens in total (summed over
    the sequences), q new tokens each (q = 1 decode, q = k+1 verify)."""
    tokens = b * q
    experts = m.expert_bytes * (1.0 - (1.0 - m.top_frac) ** tokens) if m.expert_bytes else 0.0
    mem = (m.dense_bytes + experts + m.kv_bytes_per_token * ctx) / m.bw
    compute = (m.flops_per_token * tokens + m.attn_flops_per_ctx * ctx * q) / m.flops
    comm = m.allreduce_s + m.allreduce_bytes_per_token * tokens / m.link if m.allreduce_s else 0.0
    # a wide verify leaves the decode kernel: its attention time follows the mean sequence's
    # context per query token, not the batch's KV bytes (docs/design.md "Simulator: draft
    # length and n-gram")
    fallback = m.fallback_s_per_ctx * (ctx / b) * q if q > m.decode_max_q and b > 0 else 0.0
    return max(mem, compute) + comm + m.overhead_s + fallback


def draft_step_s(m: EngineModel, b: float, ctx: float) -> float:
    """One draft forward (one new token for each of b sequences)."""
    mem = (m.draft_bytes + m.draft_kv_bytes_per_token * ctx) / m.bw
    compute = (m.draft_flops_per_token * b + m.draft_attn_flops_per_ctx * ctx) / m.flops
    return max(mem, compute) + m.draft_allreduce_s + m.draft_overhead_s


def spec_step_s(m: EngineModel, b: float, ctx: float, k: int) -> float:
    """One speculative step: k draft forwards (or one n-gram proposal: a fixed cost plus
    host-side matching over all ctx context tokens), then one target forward verifying k+1
    tokens per sequence."""
    if k == 0:
        return target_step_s(m, b, ctx, 1)
    if m.draft_forwards_per_step:
        draft = k * draft_step_s(m, b, ctx)
    else:
        draft = m.draft_overhead_s + m.ngram_s_per_ctx * ctx
    return draft + target_step_s(m, b, ctx, k + 1) + m.verify_overhead_s


def prefill_s(m: EngineModel, prompt: float) -> float:
    """Prefill of one prompt (compute-bound), target and draft."""
    flops = (m.flops_per_token + m.draft_flops_per_token) * prompt
    flops += (m.attn_flops_per_ctx + m.draft_attn_flops_per_ctx) * prompt * prompt / 2.0
    return flops / m.flops


# ---------------------------------------------------------------------------------------------
# workload


@functools.lru_cache(maxsize=64)
def _normal_quantiles(n: int) -> np.ndarray:
    return np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])


def response_lengths(cfg: SimConfig, n: int) -> np.ndarray:
    """n response lengths [n] in tokens: evenly spaced quantiles of the capped log-normal,
    so a run is deterministic and the tail is always represented."""
    w = cfg.workload
    lengths = w.median_tokens * np.exp(w.sigma * _normal_quantiles(n))
    return np.clip(lengths, 1.0, w.max_tokens)  # not rounded: keeps fits smooth


def capped_lognormal_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X log-normal with this median and shape, in tokens."""
    if sigma == 0:
        return min(median, cap)
    mu, s = math.log(median), sigma
    phi = NormalDist().cdf
    below = math.exp(mu + s * s / 2) * phi((math.log(cap) - mu - s * s) / s)
    return below + cap * (1.0 - phi((math.log(cap) - mu) / s))


def mean_response(cfg: SimConfig) -> float:
    """Mean response length the learner trains on, tokens."""
    w = cfg.workload
    return capped_lognormal_mean(w.median_tokens, w.sigma, w.max_tokens)


def median_for_mean(cfg: SimConfig, mean: float) -> float:
    """The log-normal median whose capped mean is ``mean`` tokens, at the recipe's sigma and
    cap (telemetry reports mean lengths; the model is parametrised by the median)."""
    w = cfg.workload
    if not 0 < mean < w.max_tokens:
        raise ConfigError(f"mean response length {mean:.0f} must lie in (0, workload.max_tokens={w.max_tokens})")
    lo, hi = math.log(1e-3), math.log(float(w.max_tokens))
    while capped_lognormal_mean(math.exp(hi), w.sigma, w.max_tokens) < mean:
        hi += 1.0
    for _ in range(60):  # the capped mean rises with the median
        mid = 0.5 * (lo + hi)
        if capped_lognormal_mean(math.exp(mid), w.sigma, w.max_tokens) < mean:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


# ---------------------------------------------------------------------------------------------
# the step


@dataclass
class StepTimes:
    """Stage times of one RL step, seconds. gen_s is the generation pool's busy time per step
    (rollout throughput); exposed_gen_s is how long training waits for it."""

    accept_length: float
    prepare_s: float
    gen_s: float
    exposed_gen_s: float
    logprob_s: float
    train_s: float
    adapt_s: float
    data_s: float
    step_s: float

    @property
    def gen_share(self) -> float:
        return self.exposed_gen_s / self.step_s


@dataclass(frozen=True)
class LearnerTimes:
    data_s: float
    prepare_s: float
    logprob_s: float
    train_s: float


def learner_times(cfg: SimConfig) -> LearnerTimes:
    """Compute-bound learner stages for one step's tokens on the training GPUs."""
    arch = lookup_model(cfg.target.model)
    gpu = lookup_gpu(cfg.engine.gpu)
    lc, w = cfg.learner, cfg.workload
    gpus = cfg.cluster.gpus if cfg.cluster.colocated else cfg.cluster.train_gpus
    peak = (gpu.fp8_tflops if lc.peak == "fp8" else gpu.bf16_tflops) * 1e12 * gpus
    seq = w.prompt_tokens + response_lengths(cfg, 512)  # [512] sequence lengths, tokens
    tokens = w.rollouts * (w.prompt_tokens + mean_response(cfg))
    attn = arch.attn_flops_per_ctx * w.rollouts * float(np.mean(seq**2)) / 2.0  # causal
    forward = 2.0 * arch.active_params * tokens + attn
    prepare = lc.prepare_fixed_s + arch.total_params * cfg.target.weight_bytes / (lc.sync_gbps * 1e9)
    return LearnerTimes(
        data_s=lc.data_s,
        prepare_s=prepare,
        logprob_s=lc.logprob_passes * forward / (peak * lc.logprob_mfu),
        train_s=3.0 * forward / (peak * lc.train_mfu),
    )


@dataclass(frozen=True)
class PipelineTimes:
    step_s: float  # steady-state time between policy versions
    exposed_gen_s: float  # training waits this long for rollouts per step
    gen_busy_s: float  # generation replica busy per step (decode + prefill)


def _replica_batch(cfg: SimConfig) -> int:
    gen_gpus = cfg.cluster.gpus if cfg.cluster.colocated else cfg.cluster.gen_gpus
    replicas = gen_gpus // cfg.engine.tp
    return max(1, round(cfg.workload.rollouts / replicas))


def _concurrency(cfg: SimConfig, m: EngineModel) -> int:
    """Sequences a replica runs at once: max_num_seqs, or fewer if the KV cache cannot hold
    that many sequences of mean length (vLLM admits on free KV blocks)."""
    per_seq = cfg.workload.prompt_tokens + mean_response(cfg)
    fit = int(m.kv_capacity_tokens // per_seq)
    if fit < 1:
        raise ConfigError(
            f"the KV cache ({m.kv_capacity_tokens:.0f} tokens per replica) cannot hold one sequence "
            f"of {per_seq:.0f} tokens; raise engine.tp or engine.mem_util"
        )
    return min(cfg.engine.max_num_seqs, fit)


def simulate_generation(
    step_fn: Callable[[float, float], float],
    tau: float,
    batches: list[np.ndarray],
    prompt: float,
    cap: int,
    prefill_per_seq_s: float,
    train_side_s: float,
    prepare_s: float,
    lag: int,
    stream: bool = False,
    trainer_sends: bool = False,
) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Event-driven rollout generation on one replica, coupled to the trainer.

    batches[j]: response lengths [n] of step j, in admission order. step_fn(b, ctx) is the
    seconds of one engine step for b running sequences holding ctx context tokens in total;
    each step advances every running sequence by tau tokens. A new policy version lands
    when a train step ends and pauses generation for prepare_s (the weight load).

    stream=False (sync): step j trains on the sequences of batches[j] (its prompts) and
    batch j may start once policy version max(0, j - lag) has landed; lag = 0 is the
    synchronous pipeline on split GPUs.
    stream=True (async): the replica generates the sequences in order and step j trains on
    the j-th n sequences to *finish*, so a long response never holds back a batch; at most
    (lag + 1) batches of sequences are started and not yet trained on (bounded staleness).
    trainer_sends: the trainer broadcasts the new weights itself (split async: NCCL from the
    training ranks), so a train step holds the trainer for train_side_s + prepare_s and the
    generation pause is the broadcast's last prepare_s seconds; the version is usable when the
    step ends. Otherwise the engine loads the weights after the step, off the trainer.

    Returns (train_start [steps], train_end [steps], done [steps]), done[j] being the
    replica's (busy seconds, tokens generated) when the sequences of step j were complete.
    """
    sim = _Rollout(step_fn, tau, batches, prompt, cap, prefill_per_seq_s, train_side_s, prepare_s, lag,
                   stream, trainer_sends)
    while True:
        sim.land_versions()
        sim.admit()
        wake = sim.wake()
        if not sim.heap:
            if sim.nxt >= len(sim.order):
                break
            if math.isinf(wake):  # cannot happen: an idle replica has finished every batch
                raise RuntimeError("rollout simulation stalled")
            sim.t = max(sim.t, wake)
            continue
        if not sim.advance(wake):
            continue
        sim.retire()
        sim.start_train_steps()
    return sim.train_start, sim.train_end, sim.done


class _Rollout:
    """simulate_generation's state, one method per step of its event loop: a version lands,
    sequences are admitted, the running batch advances, finished sequences retire, the train
    steps whose batches are complete start."""

    def __init__(self, step_fn: Callable[[float, float], float], tau: float, batches: list[np.ndarray],
                 prompt: float, cap: int, prefill_per_seq_s: float, train_side_s: float, prepare_s: float,
                 lag: int, stream: bool, trainer_sends: bool):
        self.step_fn, self.tau, self.prompt, self.cap, self.lag, self.stream = step_fn, tau, prompt, cap, lag, stream
        self.prefill_per_seq_s, self.train_side_s, self.prepare_s = prefill_per_seq_s, train_side_s, prepare_s
        self.steps = len(batches)
        self.n = len(batches[0])
        self.order = [(j, float(length)) for j, batch in enumerate(batches) for length in batch]
        self.remaining = [len(batch) for batch in batches]
        self.done_at: list[float | None] = [None] * self.steps
        self.done: list[tuple[float, float]] = [(0.0, 0.0)] * self.steps
        self.train_start: list[float] = []
        self.train_end: list[float] = []
        self.pauses: list[float] = []  # times at which a new policy version lands (generation pauses)
        self.finished = 0
        self.held_s = prepare_s if trainer_sends else 0.0  # broadcast time on the trainer's side
        self.landing_s = prepare_s - self.held_s  # after a train step ends, until its version is usable
        self.heap: list[tuple[float, float, int]] = []  # (finish progress, start progress, batch)
        # progress: steps taken by every running sequence so far
        self.t = self.progress = self.busy = self.tokens = 0.0
        self.ctx_offset = 0.0  # sum over running sequences of (prompt - tau * start progress)
        self.nxt = 0  # the next sequence of ``order`` to start

    def eligible_at(self, i: int) -> float:
        """When sequence i of ``order`` may start."""
        if self.stream:
            c = (i - (self.lag + 1) * self.n) // self.n  # the train step that must have taken its batch
            if c < 0:
                return 0.0
            return self.train_start[c] if len(self.train_start) > c else math.inf
        v = self.order[i][0] - self.lag  # the policy version batch j must be sampled from
        if v <= 0:
            return 0.0
        return self.train_end[v - 1] + self.landing_s if len(self.train_end) >= v else math.inf

    def land_versions(self) -> None:
        """Each policy version that has landed by now pauses generation for its load."""
        while self.pauses and self.pauses[0] <= self.t:
            self.pauses.pop(0)
            self.t += self.prepare_s

    def admit(self) -> None:
        """Start the next sequences while a slot is free and they may start (prefill each)."""
        while len(self.heap) < self.cap and self.nxt < len(self.order) and self.eligible_at(self.nxt) <= self.t:
            j, length = self.order[self.nxt]
            heapq.heappush(self.heap, (self.progress + length / self.tau, self.progress, j))
            self.ctx_offset += self.prompt - self.tau * self.progress
            self.t += self.prefill_per_seq_s
            self.busy += self.prefill_per_seq_s
            self.nxt += 1

    def wake(self) -> float:
        """The next time the loop must look again: a version lands or a waiting sequence may start."""
        wake = self.pauses[0] if self.pauses else math.inf
        if len(self.heap) < self.cap and self.nxt < len(self.order):
            wake = min(wake, self.eligible_at(self.nxt))
        return wake

    def advance(self, wake: float) -> bool:
        """Run the batch to its next finishing sequence (True), or stop early at ``wake`` (False)."""
        b = len(self.heap)
        nxt_progress = self.heap[0][0]
        ctx_mid = self.ctx_offset + b * self.tau * (self.progress + nxt_progress) / 2.0
        dt = (nxt_progress - self.progress) * self.step_fn(b, ctx_mid)
        if self.t < wake < self.t + dt:
            partial = (nxt_progress - self.progress) * (wake - self.t) / dt
            self.progress += partial
            self.tokens += b * self.tau * partial
            self.busy += wake - self.t
            self.t = wake
            return False
        self.t += dt
        self.busy += dt
        self.tokens += b * self.tau * (nxt_progress - self.progress)
        self.progress = nxt_progress
        return True

    def retire(self) -> None:
        """Take the finished sequences out; a batch complete records (busy, tokens) at its time."""
        while self.heap and self.heap[0][0] <= self.progress + 1e-9:
            _, start, j = heapq.heappop(self.heap)
            self.ctx_offset -= self.prompt - self.tau * start
            self.finished += 1
            if self.stream:
                j, complete = self.finished // self.n - 1, self.finished % self.n == 0
            else:
                self.remaining[j] -= 1
                complete = self.remaining[j] == 0
            if complete:
                self.done_at[j] = self.t
                self.done[j] = (self.busy, self.tokens)

    def start_train_steps(self) -> None:
        """Each train step starts when its batch is complete and the step before it has ended."""
        while len(self.train_end) < self.steps and self.done_at[len(self.train_end)] is not None:
            j = len(self.train_end)
            start = max(self.done_at[j], self.train_end[-1] if self.train_end else 0.0)
            self.train_start.append(start)
            self.train_end.append(start + self.train_side_s + self.held_s)
            if j + 1 < self.steps:
                self.pauses.append(self.train_end[-1] - self.held_s)


def _pipeline(cfg: SimConfig, mode: str, tau: float, spec: bool, train_side_s: float,
              prepare_s: float) -> PipelineTimes:
    m = engine_model(cfg)
    k = cfg.spec.k if spec else 0

    def step_fn(b: float, ctx: float) -> float:
        return spec_step_s(m, b, ctx, k)

    n = _replica_batch(cfg)
    cap = _concurrency(cfg, m)
    lengths = response_lengths(cfg, n)
    rng = np.random.default_rng(0)
    prompt = cfg.workload.prompt_tokens
    pre = prefill_s(m, prompt)
    if cfg.cluster.colocated:
        _, _, done = simulate_generation(step_fn, tau, [rng.permutation(lengths)], prompt, cap,
                                         pre, 0.0, 0.0, lag=1)
        busy = done[0][0]
        return PipelineTimes(step_s=math.nan, exposed_gen_s=busy, gen_busy_s=busy)
    lag = 0 if mode == "sync" else cfg.pipeline.max_lag
    stream = lag > 0 and cfg.pipeline.async_batching == "finished"
    # Batches run in groups of lag + 1 (each group waits for the same policy version), so
    # the steady state is measured over whole groups, after one group of warm-up and before
    # one group of wind-down (the last batches have no successors to fill their tail).
    group = lag + 1
    window = group * max(2, math.ceil(cfg.pipeline.steps / group))
    steps = window + 2 * group
    batches = [rng.permutation(lengths) for _ in range(steps)]
    # split sync has the weight sync on the critical path either way
    start, end, done = simulate_generation(step_fn, tau, batches, prompt, cap, pre,
                                           train_side_s, prepare_s, lag, stream=stream,
                                           trainer_sends=lag > 0 and cfg.pipeline.sync_on_trainer)
    first, last = group - 1, group - 1 + window
    step = (end[last] - end[first]) / window
    # how long training waits for rollouts; in sync the wait also holds the weight load
    # (reported as prepare_s), in async that load pauses generation off the critical path
    wait = float(np.mean([start[j] - end[j - 1] for j in range(first + 1, last + 1)]))
    exposed = max(0.0, wait - prepare_s) if lag == 0 else wait
    if lag > 0:
        # Rollout throughput is what the generation pool delivers flat out (bounded in-flight
        # sequences, never waiting for the trainer); waiting shows in exposed_gen_s and step_s.
        _, _, done = simulate_generation(step_fn, tau, batches, prompt, cap, pre, 0.0, 0.0,
                                         lag, stream=stream)
    # seconds per batch at the steady state's throughput: busy seconds per token generated
    # between two batch completions, times one batch's tokens
    busy = done[last][0] - done[first][0]
    tokens = done[last][1] - done[first][1]
    return PipelineTimes(step_s=step, exposed_gen_s=exposed,
                         gen_busy_s=busy / tokens * float(np.sum(lengths)))


def simulate_step(cfg: SimConfig, mode: str, alpha: float | None, adapt_s: float = 0.0) -> StepTimes:
    """One steady-state RL step. alpha None = no speculation; else the acceptance length
    (1 <= alpha <= k+1) of the draft in use. adapt_s: adaptation time on the critical path."""
    lt = learner_times(cfg)
    spec = alpha is not None and cfg.spec.k > 0
    tau = alpha if spec else 1.0
    train_side = lt.data_s + lt.logprob_s + lt.train_s + adapt_s
    p = _pipeline(cfg, mode, tau, spec, train_side, lt.prepare_s)
    if cfg.cluster.colocated:
        if mode != "sync":
            raise ConfigError("a colocated cluster runs the sync pipeline only")
        step = lt.prepare_s + p.gen_busy_s + train_side
    else:
        step = p.step_s
    return StepTimes(
        accept_length=tau, prepare_s=lt.prepare_s, gen_s=p.gen_busy_s,
        exposed_gen_s=p.exposed_gen_s, logprob_s=lt.logprob_s, train_s=lt.train_s,
        adapt_s=adapt_s, data_s=lt.data_s, step_s=step,
    )


def step_ceiling(gen_share: float, alpha: float) -> float:
    """The paper's bound on the end-to-end speedup of a sync step whose generation share is
    gen_share when generation gets at most alpha times faster:
    S_step <= 1 / (R_gen / alpha + (1 - R_gen))."""
    return 1.0 / (gen_share / alpha + (1.0 - gen_share))


# ---------------------------------------------------------------------------------------------
# asynchronous steps on shared cores (the demo; docs/design.md "Simulator: asynchronous
# steps", "The demo's step on shared cores")


@dataclass(frozen=True)
class StageCosts:
    """One RL step's stages, each alone on every core, seconds."""

    gen_s: float  # the generation that runs beside this step (the next step's rollouts; 0 = none)
    train_s: float  # the policy update
    adapt_s: float  # the adapter's round (and the swap)


@dataclass(frozen=True)
class SharedStepTimes:
    """An asynchronous step on shared cores, in the demo's telemetry stages (stage/*), seconds."""

    gen_s: float  # wall of the generation beside the trainer
    train_s: float  # wall of the policy update
    adapt_s: float  # wall of the adapter's round
    exposed_gen_s: float  # the trainer's wait for the generation at the step's end
    step_s: float  # the whole step: stage/rl_step_s


def shared_wall(work_s: float, beside_s: float, slowdown: float) -> float:
    """Wall time of ``work_s`` seconds of all-core work that starts beside a job running for
    ``beside_s`` seconds: it runs ``slowdown`` times slower until that job ends, then on every
    core (the demo's trainer takes the generation's thread back between micro-batches)."""
    if work_s * slowdown <= beside_s:
        return work_s * slowdown
    return beside_s + work_s - beside_s / slowdown


def shared_async_step(c: StageCosts, cores, fill_s: float = 0.0) -> SharedStepTimes:
    """One step of the demo's asynchronous loop (async_lag=1) from its all-core stage costs.

    The generation of the next step's rollouts runs for its whole length at its share of the
    cores (cores.gen_slowdown); beside it the trainer does the policy update, then the adapter's
    round, at cores.train_slowdown until the generation is done and on every core after; the
    step ends when both are done, plus cores.boundary_s (the policy push and the launch).
    ``fill_s``: the pipeline fill the first step waits for (its own rollouts, generated on
    every core before the loop starts). ``cores``: a config.SharedCoresConfig.
    """
    gen = c.gen_s * cores.gen_slowdown
    train = shared_wall(c.train_s, gen, cores.train_slowdown)
    trainer = shared_wall(c.train_s + c.adapt_s, gen, cores.train_slowdown)
    exposed = max(0.0, gen - trainer)
    return SharedStepTimes(gen_s=gen, train_s=train, adapt_s=trainer - train, exposed_gen_s=exposed + fill_s,
                           step_s=fill_s + trainer + exposed + cores.boundary_s)


# ---------------------------------------------------------------------------------------------
# a run: drift, adaptation, the configurations compared


@dataclass
class SimResult:
    name: str
    rows: dict[str, dict[str, StepTimes]]  # mode -> config -> averaged stage times
    figures: dict[str, float]  # FIGURES names -> value
    sweep: dict[str, list[dict[str, float]]]  # mode -> [{accept_length, gen_speedup, e2e_speedup, ceiling}]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "rows": {mode: {c: asdict(s) for c, s in rows.items()} for mode, rows in self.rows.items()},
            "figures": self.figures,
            "sweep": self.sweep,
        }


def _average(times: list[StepTimes]) -> StepTimes:
    return StepTimes(**{f: float(np.mean([getattr(s, f) for s in times])) for f in STAGES})


def _trajectory(cfg: SimConfig, mode: str, alphas: list[float], adapt_s: float) -> StepTimes:
    """Mean stage times over a run whose acceptance follows ``alphas`` (one per step).
    Steps with the same acceptance are simulated once; a drifting run is interpolated
    between at most 8 simulated acceptance levels."""
    levels = sorted(set(round(a, 6) for a in alphas))
    if len(levels) > 8:
        levels = list(np.linspace(levels[0], levels[-1], 8))
    sims = [simulate_step(cfg, mode, a, adapt_s) for a in levels]
    if len(sims) == 1:
        return sims[0]
    xs = np.array(levels)
    per_step = []
    for a in alphas:
        values = {f: float(np.interp(a, xs, [getattr(s, f) for s in sims])) for f in STAGES}
        values["accept_length"] = a
        per_step.append(StepTimes(**values))
    return _average(per_step)


def frozen_alphas(cfg: SimConfig) -> list[float]:
    s = cfg.spec
    return [decayed_length(s.accept_length, s.k, s.drift_per_step, t, s.accept_floor)
            for t in range(cfg.adapt.horizon_steps)]


def adapted_alphas(cfg: SimConfig) -> list[float]:
    s, a = cfg.spec, cfg.adapt
    fresh = a.accept_length if a.accept_length is not None else s.accept_length
    return [decayed_length(fresh, s.k, s.drift_per_step, t % a.every_steps, min(s.accept_floor, fresh))
            for t in range(a.horizon_steps)]


def adapt_overhead_s(cfg: SimConfig) -> float:
    """Adaptation time on the critical path per RL step: the exposed share of the side
    trainer plus the swap pause, spread over adapt.every_steps."""
    a = cfg.adapt
    return (a.train_s * a.exposed_frac + a.swap_ms * 1e-3) / a.every_steps


def simulate(cfg: SimConfig, sweep: bool = True) -> SimResult:
    rows: dict[str, dict[str, StepTimes]] = {}
    figures: dict[str, float] = {}
    curves: dict[str, list[dict[str, float]]] = {}
    for mode in cfg.pipeline.modes:
        plain = simulate_step(cfg, mode, None)
        row = {"plain": plain, "spec": _trajectory(cfg, mode, frozen_alphas(cfg), 0.0)}
        if cfg.adapt.enabled:
            row["adapt"] = _trajectory(cfg, mode, adapted_alphas(cfg), adapt_overhead_s(cfg))
        rows[mode] = row
        for config, st in row.items():
            for f in STAGES:
                figures[f"{mode}.{f}.{config}"] = getattr(st, f)
            figures[f"{mode}.gen_share.{config}"] = st.gen_share
            figures[f"{mode}.gen_speedup.{config}"] = plain.gen_s / st.gen_s
            figures[f"{mode}.e2e_speedup.{config}"] = plain.step_s / st.step_s
            if mode == "sync":
                figures[f"{mode}.ceiling.{config}"] = step_ceiling(plain.gen_share, st.accept_length)
        if sweep and cfg.spec.k > 0:
            curves[mode] = []
            for alpha in np.linspace(1.0, cfg.spec.k + 1.0, cfg.sweep_points):
                st = simulate_step(cfg, mode, float(alpha))
                point = {"accept_length": float(alpha), "gen_speedup": plain.gen_s / st.gen_s,
                         "e2e_speedup": plain.step_s / st.step_s}
                if mode == "sync":
                    point["ceiling"] = step_ceiling(plain.gen_share, float(alpha))
                curves[mode].append(point)
    return SimResult(name=cfg.name, rows=rows, figures=figures, sweep=curves)
