"""The rollout engine: a running vLLM with a draft, whose draft and policy weights change in place.

The only place (with ``worker_ext.py`` and ``cpu_fix.py``) that imports vllm. Training code hands
it published files; it returns what actually serves (version + checksum read back from the
worker) and the speculative-decoding counters of each ``generate`` call as deltas.

Start it inside ``if __name__ == "__main__":`` (vLLM spawns workers) and share one per process:
start-up costs 20-30 s on CPU even for a tiny model.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from draftadapt.drafts.formats import (
    META_FILE,
    WEIGHTS_FILE,
    check_draft_for_target,
    check_identity,
    dtype_name,
    model_dtype,
    target_fingerprint,
)
from draftadapt.drafts.mtp import PREFIX as MTP_PREFIX
from draftadapt.drafts.serving import check_serves, serving_for
from draftadapt.engine import k_table
from draftadapt.engine.cpu_fix import guard_llvmlite_lib
from draftadapt.engine.worker_ext import WorkerCall
from draftadapt.metrics.acceptance import AcceptanceStats

WORKER_EXT = "draftadapt.engine.worker_ext.DraftAdaptWorkerExtension"


# vLLM's drafters that need no draft model, and the settings draftadapt serves them with:
# n-gram prompt lookup (matches of 2 to 4 tokens in the prompt and output so far) and suffix
# decoding (suffix trees over this request's and earlier responses; needs the arctic-inference
# package, docs/design.md "Model-free baselines")
MODEL_FREE_METHODS: dict[str, dict[str, Any]] = {
    "ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {},
}


class DraftSwapError(RuntimeError):
    """A draft that could not be swapped in; the engine still serves the previous one."""


@dataclass
class Rollout:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float] | None  # log p_policy(token) per generated token, when asked for
    finish_reason: str | None


@dataclass(frozen=True)
class EngineStep:
    """One engine step of a generation: timed by the stat logger on draftadapt's own engine's
    frontend (``RolloutEngine``), or by the engine core's step clock where the frontend is not
    draftadapt's (verl's servers, ``engine/step_clock.py``)."""

    batch: int  # sequences decoded in the step (those verifying a draft, where any did)
    drafted: int  # draft tokens verified per sequence (0: no draft token in the step)
    prefill: bool  # prompt tokens were computed in it (a prefill, or a decode beside one)
    seconds: float  # wall time from the end of the step before (the call's start, for its first)


@dataclass
class GenerateResult:
    rollouts: list[Rollout]
    acceptance: AcceptanceStats  # the speculative-decoding counters of this call
    seconds: float
    # the call's engine steps, in order (empty where the engine reports none: a Ray fleet)
    steps: list[EngineStep] = field(default_factory=list)

    def decode_step_seconds(self, batch: int, drafted: int) -> list[float]:
        """Wall seconds of each step that decoded ``batch`` sequences at ``drafted`` draft tokens
        a sequence, no prompt beside them: the step's own cost, with the call, the prefill and the
        steps where sequences had finished left out."""
        return [s.seconds for s in self.steps if not s.prefill and s.batch == batch and s.drafted == drafted]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rollouts)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class SwapResult:
    version: int | None  # the draft version now live, read back from the worker
    checksum: str  # fingerprint of the live draft weights, read back from the worker
    ms: float  # wall time of the swap round trip


class _AcceptanceCounter:
    """A vLLM stat logger of this engine's own: sums the scheduler's speculative-decoding stats.

    vLLM's Prometheus metrics live in one process-wide registry that every new ``LLM`` clears
    (``unregister_vllm_metrics``), so with two engines in one process (a plain and a speculative
    arm) ``llm.get_metrics()`` stops seeing the first one's counters. This logger is attached to
    one engine's ``logger_manager`` and counts what that engine's scheduler reports; during a
    ``generate`` call it also times each engine step (``EngineStep``).
    """

    def __init__(self):
        self.totals = AcceptanceStats()
        # the engine steps of the generate call under way (begin/end), each timed from the end of
        # the one before: vLLM's LLMEngine.step records stats once a step, after its outputs are
        # processed, so the interval is the whole step as a generation pays it
        self.steps: list[EngineStep] | None = None
        self._last = 0.0

    def begin(self) -> None:
        self.steps, self._last = [], time.perf_counter()

    def end(self) -> list[EngineStep]:
        steps, self.steps = self.steps or [], None
        return steps

    def record(self, scheduler_stats, iteration_stats=None, mm_cache_stats=None, engine_idx=0):
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if self.steps is not None:
            now = time.perf_counter()
            drafts = int(stats.num_drafts) if stats is not None else 0
            tokens = iteration_stats.num_generation_tokens if iteration_stats is not None else 0
            prompt = iteration_stats.num_prompt_tokens if iteration_stats is not None else 0
            self.steps.append(EngineStep(drafts or tokens, round(stats.num_draft_tokens / drafts) if drafts else 0,
                                         prompt > 0, now - self._last))
            self._last = now
        if stats is None:
            return
        per = [int(v) for v in stats.num_accepted_tokens_per_pos]
        drafted = [int(v) for v in getattr(stats, "num_draft_tokens_per_pos", [])]
        self.totals += AcceptanceStats(len(per), int(stats.num_drafts), per, int(stats.num_draft_tokens), drafted)

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, *args, **kwargs):
        pass

    def snapshot(self) -> AcceptanceStats:
        return self.totals + AcceptanceStats()  # a copy: the totals keep growing


def _attach_acceptance_counter(llm) -> _AcceptanceCounter:
    manager = getattr(llm.llm_engine, "logger_manager", None)
    if manager is None:
        raise RuntimeError("this vLLM engine has no stat logger manager; start it with disable_log_stats=False")
    counter = _AcceptanceCounter()
    manager.stat_loggers.append(counter)
    return counter


def _weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k.replace("midlayer.", "layers.0.", 1): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:
        raise DraftSwapError(f"{path} is not a readable safetensors file ({exc}); not swapped") from None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _process_group_size() -> int:
    """The world of the torch.distributed group this process is in (1: none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# What a launcher (torchrun, `accelerate launch`) sets for its ranks: hidden from a multiprocess
# engine's children while it starts, which are a world of their own (put back after start-up)
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _choose_in_process(in_process: bool | None) -> bool:
    """None: in this process on CPU, unless this process is a rank of a process group. vLLM's
    ``init_distributed_environment`` (0.32) adopts an initialized torch.distributed group instead
    of making its own, and then creates its groups collectively over that world: the other ranks,
    not being in vLLM, never join, and the engine's start-up waits forever (`accelerate launch
    --num_processes 2 -m draftadapt.cli pretrain` hung there)."""
    world = _process_group_size()
    if in_process and world > 1:
        raise ValueError(f"an in-process engine cannot start in a rank of a {world}-process torch.distributed "
                         "group (vLLM would take the group for its own and wait for the other ranks): pass "
                         "in_process=False (its engine runs in child processes of its own)")
    if in_process is None:
        return _on_cpu() and world == 1
    return in_process


def _startup_env(in_process: bool, kv_cache_gib: int, threads: int | None) -> dict[str, str]:
    """What vLLM reads while an engine starts. Set only then (its processes and the in-process
    worker read them at start-up), and put back: the host process's environment is not ours
    (docs/design.md, "TRL integration")."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    # The CPU backend reserves ~92% of RAM for the first engine unless told (docs/design.md,
    # "Starting engines"); a value the caller set wins.
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))  # GiB
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _host_rng_state() -> tuple:
    """The global python, numpy and torch RNG states (:func:`_restore_host_rng` puts them back)."""
    import random

    import numpy as np

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _restore_host_rng(state: tuple) -> None:
    import random

    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


class RolloutEngine:
    """A vLLM ``LLM`` serving ``target`` with an optional draft, plus in-place weight updates."""

    def __init__(
        self,
        target: str | Path,
        draft: str | Path | None = None,
        method: str | None = "eagle3",
        num_speculative_tokens: int = 3,
        max_model_len: int = 256,
        max_num_seqs: int = 64,
        kv_cache_gib: int = 1,
        seed: int = 0,
        threads: int | None = None,
        enforce_eager: bool = True,
        in_process: bool | None = None,
        block_size: int | None = None,
        dtype: str | torch.dtype | None = None,
        logprobs_mode: str = "raw_logprobs",
        k_schedule: Sequence[tuple[int, int, int]] | None = None,
    ):
        """``in_process`` runs vLLM's engine core and worker in this process (uni executor)
        instead of two child processes; None = on CPU, unless this process is one rank of a
        multi-process torch.distributed group (:func:`_choose_in_process`). ``block_size``: KV cache block in
        tokens (None: vLLM's, 128 on CPU; a multiple of 32 there). ``dtype``: the weights' dtype
        in the engine; None follows the target's config (``dtype``/``torch_dtype``, float32 when
        it names none), where vLLM's own "auto" would serve a float32 model in bf16.
        ``logprobs_mode``: vLLM's; "raw_logprobs" are the model's (before temperature and top-p),
        "processed_logprobs" those of the distribution actually sampled from (what an RL
        trainer's importance ratio needs at a temperature other than 1). Measured on a 2-core CPU
        (scripts/bench_engine.py, 32 and 64 prompts): 1.1-1.6x the tokens/s of the multiprocess
        engine without speculation and ~1.5x with it, because the engine core otherwise spins on one core
        waiting for the worker, which then gets the other core alone. ``threads`` is then this
        process's torch thread count while the engine runs (None: vLLM's choice).
        ``k_schedule``: vLLM's per-batch-size draft length, inclusive (batch_from, batch_to, k)
        ranges from 1, each k at most ``num_speculative_tokens`` (0 = no draft at that batch
        size); an engine started with one can change it between generations
        (:meth:`set_k_schedule`, docs/design.md "Online k"). None: k at every batch size."""
        # vLLM's import and start-up seed and draw from the global python, numpy and torch RNGs:
        # the host's streams continue as if no engine had started (requests use their own seeds).
        rng_before = _host_rng_state()
        self.target = Path(target)
        serving, speculate, speculative_config = self._plan_speculation(draft, method, num_speculative_tokens,
                                                                         max_model_len, k_schedule)
        meta = self._check_target_and_draft(draft, serving, speculate, dtype)
        self._start(speculative_config, in_process, kv_cache_gib, threads, max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs, seed=seed, logprobs_mode=logprobs_mode,
                    # every waiting prompt prefilled whole: vLLM 0.32 rewinds a seeded request's
                    # generator when its prefill is split over two steps, and a CPU generator has
                    # no offset ("RuntimeError: CPU Generator does not use offset": 64 chat prompts
                    # of ~70 tokens passed the default 4096-token step)
                    max_num_batched_tokens=max(4096, max_num_seqs * max_model_len),
                    enforce_eager=enforce_eager, **({} if block_size is None else {"block_size": block_size}))
        self.max_num_seqs = max_num_seqs
        self._record_what_serves(meta, speculate)
        if self._k_schedule is not None and (self.in_process or k_table.needed()):
            self.set_k_schedule(self._k_schedule)  # a table of zeros starts with the drafter idle
        if speculate and serving.in_target and draft is not None:
            # vLLM started the drafter with the target's own MTP layers: the draft dir's go in now
            self.swap_draft(draft)
        _restore_host_rng(rng_before)

    def _plan_speculation(self, draft, method, k, max_model_len, k_schedule):
        """What drafts: sets ``method``, ``k`` and the k schedule; returns the method's serving
        facts (None: no draft model), whether a draft model speculates, and vLLM's
        ``speculative_config`` (None: plain decoding)."""
        # A method whose draft is part of the target (MTP) speculates without a draft directory,
        # and so do the model-free drafters (the proposer reads the prompt and output so far);
        # method=None serves plainly whatever the target carries.
        if method is None and draft is not None:
            raise ValueError(f"a draft ({draft}) needs a method; pass method='eagle3', 'draft_model' or 'mtp'")
        model_free = draft is None and method in MODEL_FREE_METHODS
        serving = None if method is None or model_free else serving_for(method)
        speculate = draft is not None or (serving is not None and serving.in_target)
        self.method = method if speculate or model_free else None
        self.k = k if speculate or model_free else 0
        speculative_config = None
        if speculate:
            speculative_config = serving.speculative_config(draft, k, max_model_len)
        elif model_free:
            speculative_config = {"method": method, "num_speculative_tokens": k, **MODEL_FREE_METHODS[method]}
        if speculative_config is not None and k_schedule is not None:
            speculative_config["num_speculative_tokens_per_batch_size"] = [tuple(int(v) for v in r) for r in k_schedule]
        self._k_schedule = ([tuple(int(v) for v in r) for r in k_schedule]
                            if speculative_config is not None and k_schedule else None)
        self._drafter_idle = False
        return serving, speculate, speculative_config

    def _check_target_and_draft(self, draft, serving, speculate: bool, dtype) -> dict[str, Any]:
        """Checks that vLLM would otherwise fail on late and cryptically (or not at all); the
        target's identity is what every swapped-in draft is held against. Sets the serving dtype
        and the tensor shapes a swap must match; returns the draft's manifest ({} without one)."""
        self._target_fp = target_fingerprint(self.target)
        self.dtype = model_dtype(self.target) if dtype is None else dtype_name(dtype)
        self._draft_ref_shapes: dict[str, tuple[int, ...]] | None = None
        self.draft_dir: Path | None = None
        meta: dict[str, Any] = {}
        if draft is not None:
            meta = check_draft_for_target(draft, self.target)
            check_serves(serving, draft, meta.get("format"), "start the engine with method='{method}'")
            self.draft_dir = Path(draft)
            self._draft_ref_shapes = _weight_shapes(self.draft_dir / WEIGHTS_FILE)
        elif speculate:  # the target's own MTP layers serve; a swap must match their tensors
            self._draft_ref_shapes = {k: v for k, v in _weight_shapes(self.target / WEIGHTS_FILE).items()
                                      if k.startswith(MTP_PREFIX)}
        return meta

    def _start(self, speculative_config: dict | None, in_process: bool | None, kv_cache_gib: int, threads: int | None,
               **llm_args) -> None:
        """vLLM's ``LLM`` on the target; the host's environment, torch thread count and
        ``torch.set_num_threads`` as they were (the thread count: ``threads`` in process)."""
        in_process = _choose_in_process(in_process)
        env = _startup_env(in_process, kv_cache_gib, threads)
        saved = dict(os.environ)  # vLLM's in-process start-up sets more of its own; all are put back
        if not in_process:
            for k in LAUNCHER_ENV:
                os.environ.pop(k, None)
        threads_before = torch.get_num_threads()
        # vLLM's CPU worker replaces torch.set_num_threads, process-wide, with a no-op that warns
        # (it binds its OpenMP threads in its own processes); in this process that would silently
        # pin every later thread count, the host's included. Put back after start-up.
        set_num_threads = torch.set_num_threads
        os.environ.update(env)
        from vllm import LLM, envs

        # vLLM caches its environment variables once an engine core has started (in this process,
        # for an in-process engine): let each engine read them anew.
        envs.disable_envs_cache()
        guard_llvmlite_lib()
        t0 = time.perf_counter()
        try:
            self.llm = LLM(model=str(self.target), speculative_config=speculative_config, dtype=self.dtype,
                           disable_log_stats=False, worker_extension_cls=WORKER_EXT,
                           distributed_executor_backend="uni" if in_process else "mp", **llm_args)
        finally:
            torch.set_num_threads = set_num_threads
            for k in set(os.environ) - set(saved):
                del os.environ[k]
            os.environ.update(saved)
            envs.disable_envs_cache()
        # The process's torch threads after start-up: the caller's explicit ``threads`` for an
        # in-process engine, else what they were before.
        torch.set_num_threads(threads if in_process and threads is not None else threads_before)
        self.in_process = in_process
        if in_process:
            _LIVE_IN_PROCESS.add(self)
        self.startup_s = time.perf_counter() - t0

    def _record_what_serves(self, meta: dict[str, Any], speculate: bool) -> None:
        """The engine's counters, tokenizer, and the draft and policy versions it starts with."""
        self._acceptance_counter = _attach_acceptance_counter(self.llm)
        self.tokenizer = self.llm.get_tokenizer()
        self._draft_version = meta.get("version")
        self._draft_sha = meta.get("sha256")
        self._newest_served: dict[str, int] = {}  # store lineage -> newest version served
        self._served(meta)
        # The policy version the engine serves; drafts trained on a newer policy are never
        # swapped in (asynchronous RL). The caller sets it with update_policy(..., version=).
        self.policy_version = 0
        if speculate:
            # Record what serves now so the first swap has a checksum to compare against.
            state = self._rpc(WorkerCall.DRAFT_STATE)
            self._live_checksum = state["checksum"]
        else:
            self._live_checksum = None

    # ------------------------------------------------------------------ generation

    def _rpc(self, name: str, *args) -> Any:
        results = self.llm.collective_rpc(name, args=args)
        return results[0]

    def acceptance_counters(self) -> AcceptanceStats:
        """Cumulative speculative-decoding counters of this engine since it started."""
        return self._acceptance_counter.snapshot()

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        temperature: float = 1.0,
        max_tokens: int = 64,
        seed: int | None = None,
        logprobs: bool = False,
        stop_token_ids: list[int] | None = None,
        top_p: float = 1.0,
        progress: bool = False,
    ) -> GenerateResult:
        """Generate one completion per prompt; returns rollouts and this call's acceptance counters."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # One seed per request (seed + i): reproducible, yet independent draws. A single shared
        # seed would make every request with the same prompt sample the same sequence.
        params = [
            SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                seed=None if seed is None else seed + i,
                logprobs=0 if logprobs else None,
                stop_token_ids=stop_token_ids,
            )
            for i in range(len(prompts))
        ]
        inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        before = self.acceptance_counters()
        t0 = time.perf_counter()
        self._acceptance_counter.begin()
        try:
            outs = self.llm.generate(inputs, params, use_tqdm=progress)
        finally:
            steps = self._acceptance_counter.end()
        seconds = time.perf_counter() - t0
        acceptance = self.acceptance_counters() - before
        rollouts = []
        for o in outs:
            c = o.outputs[0]
            lps = None
            if logprobs and c.logprobs is not None:
                lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, c.token_ids)]
            rollouts.append(Rollout(list(o.prompt_token_ids), list(c.token_ids), c.text, lps, c.finish_reason))
        return GenerateResult(rollouts, acceptance, seconds, steps)

    # ------------------------------------------------------------------ draft length

    @property
    def k_schedule(self) -> list[tuple[int, int, int]] | None:
        """The per-batch-size k table the engine drafts by now (None: ``k`` at every batch size)."""
        return None if self._k_schedule is None else list(self._k_schedule)

    def set_k_schedule(self, schedule: Sequence[tuple[int, int, int]], idle_drafter: bool = True) -> None:
        """Change the per-batch-size k table in place, between generations: vLLM's scheduler
        looks the k up in a dense batch-size table every step and the model runner drafts that
        many (docs/design.md, "Online k"). Needs an engine started with a ``k_schedule`` (a
        multiprocess one through draftadapt's EngineCore method, ``engine/k_table.py``); k
        above the engine's ``num_speculative_tokens`` is capped to it, as vLLM does at start-up. A table of zeros idles the drafter (no pass at all, where vLLM
        would still run its first one; docs/design.md, "Stepping aside"); ``idle_drafter=False``
        keeps vLLM's own behaviour (scripts/bench_k_table.py measures the two)."""
        if self._k_schedule is None:
            raise ValueError("this engine was started without a k schedule; start it with "
                             f"RolloutEngine(..., num_speculative_tokens=K_MAX, k_schedule=[(1, {self.max_num_seqs}, K)])")
        rows = k_table.normalize(schedule)
        # a model-free drafter (n-gram, suffix) has no forward to skip
        model_free = self.method in MODEL_FREE_METHODS
        if self.in_process:
            core = self.llm.llm_engine.engine_core.engine_core
            state = k_table.apply(core, rows, idle_drafter and not model_free,
                                  None if model_free else (lambda idle: self._rpc(WorkerCall.DRAFTER_IDLE, idle)))
        else:
            # the scheduler lives in the engine-core process: draftadapt's plugin gave EngineCore
            # the method that sets it there (draftadapt/engine/k_table.py)
            if not k_table.needed():
                raise ValueError(f"set_k_schedule on a multiprocess engine needs draftadapt's k-table plugin "
                                 f"(vLLM 0.32, {k_table.DISABLE_ENV} unset); start the engine with in_process=True")
            state = self.llm.llm_engine.engine_core.call_utility(k_table.CORE_METHOD, rows,
                                                                 idle_drafter and not model_free, model_free)
        self._drafter_idle = bool(state["idle"])
        self._k_schedule = rows

    @property
    def drafter_idle(self) -> bool:
        """True while the k table drafts at no batch size: then no step runs the drafter
        (``set_k_schedule`` switches it; docs/design.md, "Stepping aside")."""
        return self._drafter_idle

    def drafter_idle_steps(self) -> int:
        """Engine steps run so far without the drafter (a table of zeros; 0 if never idle)."""
        if self.method is None:
            return 0
        return int(self._rpc(WorkerCall.DRAFTER_IDLE, None)["idle_steps"])

    def zero_draft_steps(self) -> int:
        """Engine steps run so far in which no request had a draft token, so that the ordinary
        sampler drew every token and vLLM's rejection sampler did not run (every prefill step,
        every step at k = 0; ``draftadapt/engine/zero_draft.py``). 0 for a plain engine."""
        if self.method is None:
            return 0
        return int(self._rpc(WorkerCall.DRAFTER_IDLE, None)["zero_draft_steps"])

    # ------------------------------------------------------------------ draft swap

    def draft_state(self, full: bool = False) -> dict[str, Any]:
        """{"checksum", "version"} of the draft that serves now, read back from the worker.
        ``full``: a checksum of every element rather than the sampled fingerprint (see
        ``worker_ext.module_checksum``); the two are not comparable with each other."""
        return self._rpc(WorkerCall.DRAFT_STATE, full)

    def _validate_draft_file(self, draft_dir: Path, rollback: bool) -> tuple[Path, str, int | None, dict]:
        """Everything about a published draft that can be checked without loading it; raises
        :class:`DraftSwapError` naming the fix (docs/design.md, "Swap refusals")."""
        if self._draft_ref_shapes is None:
            raise DraftSwapError("this engine was started without a draft; nothing to swap")
        weights = draft_dir / WEIGHTS_FILE
        meta_path = draft_dir / META_FILE
        if not weights.is_file() or not meta_path.is_file():
            raise DraftSwapError(f"{draft_dir} is not a complete published draft (needs {WEIGHTS_FILE} and {META_FILE})")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise DraftSwapError(f"{meta_path} is corrupt ({exc}); not swapped") from None
        if not isinstance(meta, dict):
            raise DraftSwapError(f"{meta_path} is not a JSON object; not swapped")
        # The worker hashes the file against this before touching the draft (one mapped pass per
        # swap; a published version is never rewritten in place, DraftStore publishes by rename).
        # Without it nothing would catch bytes changed after export.
        sha = meta.get("sha256")
        if not isinstance(sha, str) or not sha:
            raise DraftSwapError(
                f"{meta_path} has no sha256 of {WEIGHTS_FILE}; not swapped. Publish drafts through "
                "DraftStore.publish or export them with draftadapt (both write it)"
            )
        recorded = meta.get("target")
        if not isinstance(recorded, dict):
            raise DraftSwapError(
                f"{meta_path} does not say which target it was built for; not swapped. Re-export it "
                f"for {self.target} (`draftadapt draft init --target {self.target} --from DRAFT`)"
            )
        check_identity(recorded, self._target_fp, f"{draft_dir} was built",
                       f"not swapped. Train or re-export a draft for {self.target}", require=True, error=DraftSwapError)
        version, lineage = meta.get("version"), meta.get("lineage")
        newest = self.served_version(lineage) if lineage is not None else None
        if not rollback and isinstance(version, int) and newest is not None and version < newest:
            raise DraftSwapError(
                f"{draft_dir} is version {version}, older than version {newest} of the same store that "
                "this engine served; not swapped. Pass rollback=True to go back on purpose"
            )
        shapes = _weight_shapes(weights)
        if shapes != self._draft_ref_shapes:
            missing = sorted(set(self._draft_ref_shapes) - set(shapes))
            extra = sorted(set(shapes) - set(self._draft_ref_shapes))
            wrong = sorted(k for k in set(shapes) & set(self._draft_ref_shapes) if shapes[k] != self._draft_ref_shapes[k])
            raise DraftSwapError(
                f"{weights} does not fit the serving draft (missing {missing[:4]}, unexpected {extra[:4]}, "
                f"wrong shape {wrong[:4]}); a swap keeps the architecture, restart the engine to change it"
            )
        return weights, sha, version, meta

    def served_version(self, lineage: str) -> int | None:
        """The newest version of store ``lineage`` this engine has served, or None."""
        return self._newest_served.get(lineage)

    def _served(self, meta: dict) -> None:
        lineage, version = meta.get("lineage"), meta.get("version")
        if lineage is not None and isinstance(version, int):
            self._newest_served[lineage] = max(version, self._newest_served.get(lineage, version))

    def swap_draft(self, draft_dir: str | Path, rollback: bool = False) -> SwapResult:
        """Load a published draft version into the running engine, in place, without a restart.

        Refused with :class:`DraftSwapError` before anything in the engine is touched, the
        previous draft serving on: a manifest without sha256 or target, a draft built for another
        target, an older version of a store whose newer version this engine served (unless
        ``rollback``), tensor names or shapes that do not fit; in the worker, bytes that do not
        match the sha256 and non-finite tensors. After a swap the prefix cache is dropped: its
        blocks hold the previous draft's KV for cached prompts (docs/design.md, "Swap refusals").
        """
        t0 = time.perf_counter()
        weights, sha, version, meta = self._validate_draft_file(Path(draft_dir), rollback)
        try:
            state = self._rpc(WorkerCall.LOAD_DRAFT, str(weights), sha, version)
        except Exception as exc:
            raise DraftSwapError(f"the engine refused {weights}: {exc}; the previous draft keeps serving") from None
        self.llm.reset_prefix_cache()
        self._served(meta)
        self._live_checksum = state["checksum"]
        self._draft_version = version
        self._draft_sha = sha
        self.draft_dir = Path(draft_dir)
        return SwapResult(version=state["version"], checksum=state["checksum"], ms=(time.perf_counter() - t0) * 1e3)

    # ------------------------------------------------------------------ policy update

    def update_policy(self, weights: str | Path | dict[str, torch.Tensor], version: int | None = None,
                      checks: bool = False) -> dict[str, Any]:
        """Load new policy (target) weights in place and reset the prefix cache.

        ``weights``: a safetensors file of HF-named tensors, or such a state dict in any float
        dtype (the engine casts each tensor into its own parameter, so a bf16 trainer's tensors
        stay bf16 until they land). An in-process engine takes the dict's tensors as they are, no
        copy and no file; a multiprocess one gets one file (:func:`policy_file`; to update several
        engines from one file, :func:`update_policies`). Stale prefix-cache KV would corrupt
        logprobs, so the cache is reset. ``checks``: also read back the policy checksum and the
        draft's state (a pass over the weights; off on the RL hot path, docs/design.md "Weight
        path"). Returns {"ms", "worker_ms"} and, with checks, "policy_checksum" and "draft".
        """
        t0 = time.perf_counter()
        if isinstance(weights, dict) and self.in_process:
            result = self._rpc(WorkerCall.LOAD_POLICY, {k: v.detach() for k, v in weights.items()}, checks)
        elif isinstance(weights, dict):
            with policy_file(weights) as path:
                result = self._rpc(WorkerCall.LOAD_POLICY, str(path), checks)
        else:
            result = self._rpc(WorkerCall.LOAD_POLICY, str(weights), checks)
        self.llm.reset_prefix_cache()
        if version is not None:
            self.policy_version = version
        result["ms"] = (time.perf_counter() - t0) * 1e3
        if checks and self._draft_ref_shapes is not None:  # a draft serves (a dir's, or the target's MTP)
            result["draft"] = self.draft_state()
        return result

    def policy_checksum(self, full: bool = False) -> str:
        return self._rpc(WorkerCall.POLICY_CHECKSUM, full)

    @property
    def live_checksum(self) -> str | None:
        """The draft checksum this object last saw the worker report (after start or a swap)."""
        return self._live_checksum

    @property
    def draft_version(self) -> int | None:
        return self._draft_version

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        client = llm.llm_engine.engine_core
        try:
            if getattr(self, "in_process", False):
                _LIVE_IN_PROCESS.discard(self)
                if _LIVE_IN_PROCESS:
                    # vLLM's engine-core shutdown also tears down this process's distributed
                    # groups, which the other in-process engines still use (they then fail with
                    # "pipeline model parallel group is not initialized"). Free only this one's
                    # worker and scheduler; the last engine to close does the full teardown.
                    client._finalizer.detach()
                    core = client.engine_core
                    core.model_executor.shutdown()
                    core.scheduler.shutdown()
                    gc.unfreeze()  # vLLM froze the heap at start-up: let its memory be collected
                    return
            client.shutdown()
        except Exception:  # best effort: a half-started or already dead engine
            pass
        finally:
            del llm, client
            gc.collect()


# in-process engines not closed yet (weakly: one dropped unclosed leaves the set by itself); they
# share this process's distributed groups
_LIVE_IN_PROCESS: weakref.WeakSet = weakref.WeakSet()


@contextmanager
def policy_file(weights: dict[str, torch.Tensor]) -> Iterator[Path]:
    """One safetensors file of ``weights`` in their own dtypes, for multiprocess engines, removed
    on exit. Written to shared memory (/dev/shm) where the machine has it: the worker's read is a
    memory copy, not a disk read."""
    from safetensors.torch import save_file

    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", prefix="draftadapt-policy-", dir=where)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, tmp)
        yield Path(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


def update_policies(engines: Sequence[RolloutEngine], weights: dict[str, torch.Tensor], version: int | None = None,
                    checks: bool = False) -> list[dict[str, Any]]:
    """The same new policy into several engines: in-process ones take the tensors, and every
    multiprocess one loads the same single file (written once, not once per engine)."""
    results: list[dict[str, Any] | None] = [None] * len(engines)
    remote = [i for i, e in enumerate(engines) if not e.in_process]
    for i, e in enumerate(engines):
        if e.in_process:
            results[i] = e.update_policy(weights, version, checks)
    if remote:
        with policy_file(weights) as path:
            for i in remote:
                results[i] = engines[i].update_policy(path, version, checks)
    return results  # type: ignore[return-value]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    idx = min(len(s) - 1, max(0, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[idx]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
