"""The demo's RL run as a recipe: GRPO playing "an existing RL run" on a world (the toy, or
SmolLM2-135M-Instruct), with draftadapt attached through its public API.

    draftadapt demo --out runs/demo [world=toy|smollm2] [--steps N] [--seed N] [key=value ...]

prints one line per RL step ("[demo] step 3/18 reward ... | accept frozen 2.90 adapted 3.31 |
RL step 9.2 s (gen 3.4 train 5.4 adapt 0.40)") and one JSON summary line; writes OUT/summary.json,
OUT/acceptance.png, OUT/metrics.jsonl and OUT/tb/ (TensorBoard).

Read top to bottom: ``run`` sets up (the world's target and first draft, the policy, the engines,
draftadapt), loops, saves and cleans up. One synchronous RL step is ``sync_step``: generate,
reward and update (``grpo.grpo_update``), the step boundary; the asynchronous one,
``async_step``, trains on rollouts ``async_lag`` steps old while the next batch generates. The
measurement arms (no speculation, the frozen draft, the adapted draft on held-out prompts) run
after each step, outside its time (``arms.record_step``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from draftadapt.adapter import DraftAdapter
from draftadapt.boundary import StepBoundary
from draftadapt.config import save_config
from draftadapt.drafts.formats import META_FILE
from draftadapt.engine.remote import EngineProcess
from draftadapt.engine.rollout import RolloutEngine
from draftadapt.metrics.logger import make_logger
from draftadapt.online_k import OnlineK, schedule_text
from draftadapt.precision import engine_dtype, served_dtype
from draftadapt.rl.arms import FIXED_K_ARM, measure_fresh, record_step, seed_online_k, served_undrafted
from draftadapt.rl.config import demo_adapter, DemoConfig
from draftadapt.rl.grpo import grpo_update, policy_precision
from draftadapt.rl.summary import fleet_summary, load_baseline, load_sync, plot, summarize
from draftadapt.rl.world import World
from draftadapt.train.trainer import torch_threads


@dataclass
class Run:
    """What the steps of one demo run share: the world, the RL run's parts, draftadapt's, the records."""
    cfg: DemoConfig
    world: World
    target: Path  # the model RL starts from
    policy: Any
    reference: Any  # the initial policy, for the KL term
    opt: torch.optim.Optimizer
    pad_id: int
    logger: Any
    adapter: DraftAdapter | None
    spec_engine: RolloutEngine | None  # with speculation: the engine the RL step generates with
    plain: RolloutEngine  # no speculation: the measurement arm (with spec) or the RL engine
    draft0: Path  # the frozen pretrained draft (an arm)
    eval_prompts: list[str]
    spool: Any
    rng: random.Random
    history: list[dict] = field(default_factory=list)
    arms: dict[str, list[dict]] = field(default_factory=dict)
    baselines: dict[str, RolloutEngine] = field(default_factory=dict)  # model-free drafters, by name
    online_k: OnlineK | None = None  # k_policy=online: re-chooses the speculative engine's k table
    ray_cluster: Any = None  # engines > 1: the local Ray cluster the fleet runs on

    @property
    def engine(self) -> RolloutEngine:
        """The engine the RL step generates with."""
        return self.spec_engine or self.plain


def run(cfg: DemoConfig, world: World) -> dict:
    """The demo on ``world``: setup, the loop, the final policy and the fresh reference, the summary."""
    t_run = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, adapter=demo_adapter(cfg))  # config.yaml says what the adapter ran with
    save_config(cfg, out / "config.yaml")
    baseline = load_baseline(cfg.baseline) if cfg.baseline else None
    sync = load_sync(cfg.sync) if cfg.sync else None
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    target, draft0 = world.prepare(cfg, out, need_draft=cfg.spec)  # spec=false serves no draft: none pretrained
    r = setup(cfg, world, target, draft0, out, rng)
    try:
        t_start = time.perf_counter()
        rl_batch = async_loop(r) if cfg.async_lag else sync_loop(r)
        loop_seconds = time.perf_counter() - t_start
        if r.spool is not None:
            r.spool.finish(steps=len(r.history))
        world.save_policy(r.policy, target, out / "final_policy")
        fresh = (measure_fresh(cfg, world, out, r.spec_engine, r.eval_prompts)
                 if cfg.fresh_final and r.history and r.spec_engine else None)
    finally:
        close(r)
    summary = summarize(cfg, r.history, r.arms, loop_seconds, fresh, rl_batch, baseline, sync)
    if r.ray_cluster is not None:
        summary["fleet"] = fleet_summary(r.spec_engine, r.history)
    if r.online_k is not None:
        summary["online_k"] = {"calibrate_seconds": r.online_k.calibrate_s, "cost_model": r.online_k.model.to_dict(),
                               "k_table_per_step": [h.get("k/schedule") for h in r.history]}
    # what ran in bf16 autocast ("Precision" in docs/design.md): the policy's update, the adapter's trainer
    # (a Ray fleet's adapter trains in its actor: not read from here)
    trainer = getattr(r.adapter, "trainer", None)
    summary["precision"] = {"policy_update": policy_precision(r.policy, cfg.grpo),
                            "adapter": trainer.precision if trainer is not None else None,
                            "engine": served_dtype(cfg.engine_precision, r.target)}
    summary["total_seconds"] = time.perf_counter() - t_run  # world setup + RL loop + fresh reference
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if r.spec_engine is not None:
        plot(r.history, out / "acceptance.png")
    return summary


# ---- setup: the "existing RL run" (policy + engine) and, with spec, draftadapt beside it

def setup(cfg: DemoConfig, world: World, target: Path, draft0: Path, out: Path, rng: random.Random) -> Run:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32)
    policy.eval()
    reference = copy.deepcopy(policy).requires_grad_(False)  # the initial policy, for the KL term
    pad_id = int(policy.config.pad_token_id or 0)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.grpo.lr, betas=(0.9, 0.99))
    logger = make_logger(["tensorboard", "jsonl"], out)
    adapter, spec_engine, plain, baselines, ray_cluster = start_engines(cfg, target, draft0, out)
    eval_prompts = world.heldout_prompts(target, cfg.eval.prompts)
    spool = None
    if cfg.spool:
        from draftadapt.spool import SpoolWriter

        spool = SpoolWriter(cfg.spool, writer_id="demo")
        spool.write_policy(0, target)
    # vLLM lowers torch to one thread in this process when it starts; the engines idle while we
    # train, so the trainer takes the cores back.
    torch.set_num_threads(cfg.engine_threads)
    online_k = None
    if spec_engine is not None and cfg.online:
        online_k = OnlineK.calibrate(spec_engine, eval_prompts, cfg.online_k, cfg.grpo.temperature, cfg.eval.seed,
                                     rl_batch=cfg.grpo.prompts_per_step * cfg.grpo.group_size)
        print(f"[demo] online k: step costs measured in {online_k.calibrate_s:.1f} s, k table "
              f"{schedule_text(spec_engine.k_schedule)} (batch sizes:k)", flush=True)
    arms = {"plain": [], "frozen": [], "adapted": []} if cfg.spec else {"plain": []}
    if online_k is not None:
        arms[FIXED_K_ARM] = []
    arms.update({m: [] for m in baselines})
    return Run(cfg, world, target, policy, reference, opt, pad_id, logger, adapter, spec_engine, plain, draft0,
               eval_prompts, spool, rng, arms=arms, baselines=baselines, online_k=online_k, ray_cluster=ray_cluster)


def start_engines(cfg: DemoConfig, target: Path, draft0: Path, out: Path):
    """(adapter, speculative engine, plain engine, model-free baselines, Ray cluster): the RL
    engine is the speculative one with spec (else the plain one); asynchronous runs generate in a
    child process, so generating beside the trainer does not contend for this interpreter's lock
    (docs/design.md, "Asynchronous RL")."""
    adapter = spec_engine = ray_cluster = None
    rl_engine = EngineProcess if cfg.async_lag else RolloutEngine
    dtype = engine_dtype(cfg.engine_precision, target)  # every engine alike: the arms differ only in the draft
    if cfg.spec and cfg.engines > 1:
        # the fleet: N engine actors on a local Ray cluster, the adapter in an actor of its own
        from draftadapt.integrations.ray import DraftFleet, RemoteAdapter, local_cluster

        ray_cluster = local_cluster()
        adapter = RemoteAdapter(target, draft0, out / "drafts", cfg.adapter, threads=cfg.engine_threads)
        spec_engine = DraftFleet(target, draft0, engines=cfg.engines, cache_dir=out / "fleet",
                                 engine_kwargs=dict(method=cfg.method, num_speculative_tokens=cfg.k, seed=cfg.seed,
                                                    threads=max(1, cfg.engine_threads // cfg.engines),
                                                    max_num_seqs=cfg.max_num_seqs, dtype=dtype))
    elif cfg.spec:
        adapter = DraftAdapter(target, draft0, out / "drafts", cfg.adapter)
        online = cfg.online
        spec_engine = rl_engine(target, draft0, method=cfg.method,
                                num_speculative_tokens=cfg.online_k.k_max if online else cfg.k,
                                threads=cfg.engine_threads, seed=cfg.seed, max_num_seqs=cfg.max_num_seqs, dtype=dtype,
                                k_schedule=[(1, cfg.max_num_seqs, min(cfg.k, cfg.online_k.k_max))] if online else None)
    plain = (RolloutEngine if cfg.spec else rl_engine)(target, None, threads=cfg.engine_threads, seed=cfg.seed,
                                                       max_num_seqs=cfg.max_num_seqs, dtype=dtype)
    # the model-free drafters each in a process of their own: in this one, the n-gram engine's
    # start made every later policy update 2.7x slower (3.2 s -> 8.4-8.9 s a step)
    baselines = {m: EngineProcess(target, None, method=m, num_speculative_tokens=cfg.k, threads=cfg.engine_threads,
                                  seed=cfg.seed, max_num_seqs=cfg.max_num_seqs, dtype=dtype)
                 for m in (cfg.baselines if cfg.spec else [])}
    return adapter, spec_engine, plain, baselines, ray_cluster


def close(r: Run) -> None:
    if r.adapter is not None:
        r.adapter.close()  # a background round still open is finished, not abandoned mid-write
    for engine in (r.spec_engine, r.plain, *r.baselines.values()):
        if engine is not None:
            engine.close()
    if r.ray_cluster is not None:
        r.ray_cluster.close()
    r.logger.close()


# ---- the synchronous loop: generate, update, boundary; then the arms

def sync_loop(r: Run):
    """Every step on rollouts of the policy it trains. Returns the arms at the last RL batch (or None)."""
    boundary = StepBoundary(r.adapter, r.engine, background=r.cfg.adapter_background)
    rl_batch = None
    for step in range(r.cfg.grpo.steps):
        row, problems, weights = sync_step(r, boundary, step)
        follow_policy(r, row, weights, step + 1, step, sampled=step, rollouts=None)
        rl_batch = record_step(r, row, step, step + 1, problems) or rl_batch
    return rl_batch


def draw_batch(r: Run) -> tuple[list[dict], dict]:
    """The step's problems (each ``group_size`` times) and its sampling arguments, in one draw order."""
    cfg = r.cfg.grpo
    problems = [p for p in r.world.sample_problems(r.target, cfg.prompts_per_step, r.rng.randrange(1 << 30))
                for _ in range(cfg.group_size)]
    return problems, dict(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=r.rng.randrange(1 << 30))


def update(r: Run, step: int, problems: list[dict], rollouts, threads=None,
           subset: list[int] | None = None, handover: bool = True) -> tuple[dict, dict, Any]:
    """The policy update (what the RL framework does anyway); with draftadapt and ``handover`` its
    forward hands the aux states and log-probs over (of rollouts ``subset`` only, when given).
    Returns (metrics, the new weights, the hand-over or None)."""
    handover = (r.adapter.handover(r.policy, subset) if r.adapter is not None and handover
                else contextlib.nullcontext())
    with handover as ho:
        metrics = grpo_update(r.policy, r.reference, r.opt, problems, rollouts, r.cfg.grpo, r.pad_id, step,
                              lambda p, text: r.world.score(p, text, r.cfg.grpo), ho, threads=threads)
    return metrics, {k: v.detach() for k, v in r.policy.state_dict().items()}, ho


def sync_step(r: Run, boundary: StepBoundary, step: int) -> tuple[dict, list[dict], dict]:
    """One RL step: rollouts (with spec, from the live adapted draft: speculation changes nothing
    they contain), rewards and the policy update, the step boundary (the engine's new policy, then
    draftadapt's calls in their order). Returns (the step's row, its problems, the new weights)."""
    row: dict = {"step": step}
    problems, sampling = draw_batch(r)
    boundary.before_generate()  # background rounds: the previous step's round runs beside this generation
    engine = r.engine
    if served_undrafted(r):
        # no batch size drafts: the undrafted engine generates (it holds the current policy: the
        # no-speculation arm's), which costs a plain step; a speculative engine at k = 0, even
        # with its drafter idle, measured 1.10-1.15x a plain one at 8-32 sequences on SmolLM2
        # (docs/design.md, "Stepping aside")
        engine = r.plain
        row["k/undrafted_path"] = 1.0
    t0 = time.perf_counter()
    gen = engine.generate([p["prompt"] for p in problems], **sampling)
    row["stage/gen_s"] = row["stage/exposed_gen_s"] = time.perf_counter() - t0
    row["tps/rl_batch"] = gen.tokens_per_s
    # the engine's counters for the live draft on the RL batch itself: free, and what feeds the
    # adapter's drift trigger (the eval arms are not the step's)
    row.update(boundary.report(gen.acceptance))
    if r.online_k is not None:  # the same free counters re-choose the k table for what follows
        row.update(r.online_k.update(r.spec_engine, gen.acceptance))
        row["k/schedule"] = schedule_text(r.spec_engine.k_schedule)
    if r.spool is not None:
        r.spool.write_rollouts(step, step, [x.prompt_token_ids for x in gen.rollouts], [x.token_ids for x in gen.rollouts])
    # no batch size drafts: the adapter trains nothing nobody serves, and the update's forward
    # hands over only the rollouts its simulated acceptance scores, on the steps its watch
    # affords (docs/design.md, "Stepping aside")
    subset = boundary.plan(r.online_k, r.spec_engine, gen.rollouts, step)
    t0 = time.perf_counter()
    metrics, weights, ho = update(r, step, problems, gen.rollouts, subset=subset, handover=boundary.hands_over)
    row.update(metrics)
    handover_s = ho.seconds if ho is not None else 0.0
    if r.adapter is not None:
        row["adapt/handover_rows"] = float(len(ho.rows)) if ho is not None else 0.0
    b = boundary.after_update(gen.rollouts, sampled_version=step, weights=weights, version=step + 1, handover=ho)
    row["stage/train_s"] = time.perf_counter() - t0 - handover_s - b.adapter_s
    row["stage/adapt_s"] = 0.0
    if r.adapter is not None:
        row.update(b.metrics)
        if b.swap is not None:
            seed_online_k(r, r.spec_engine, b.swap, row)
        if boundary.paused and "accept/simulated_live" in b.metrics:  # what says a draft pays again
            row.update(r.online_k.simulated(r.spec_engine, b.metrics["accept/simulated_live"], r.adapter.cfg.k))
            row["k/schedule"] = schedule_text(r.spec_engine.k_schedule)
        row["stage/adapt_s"] = b.adapter_s + handover_s
        row["adapt/handover_s"] = handover_s
        row["draft/version"] = float(r.spec_engine.draft_version or 0)
        if r.cfg.engines > 1:  # the version each engine served, read back from every actor
            row["fleet/versions"] = r.spec_engine.versions()
    row["stage/rl_step_s"] = row["stage/gen_s"] + row["stage/train_s"] + row["stage/adapt_s"]
    return row, problems, weights


def follow_policy(r: Run, row: dict, weights: dict, version: int, step: int, sampled: int, rollouts) -> None:
    """Outside the RL step: the measurement engines load the new policy, and the spool records the
    step (the asynchronous loop's ``rollouts`` with the version that sampled them; the synchronous
    step wrote its own before the update)."""
    t0 = time.perf_counter()
    if r.spec_engine is not None:
        r.plain.update_policy(weights, version=version)  # the no-speculation arm only
        for engine in r.baselines.values():
            engine.update_policy(weights, version=version)
    if r.spool is not None:
        if rollouts is not None:
            r.spool.write_rollouts(step, sampled, [x.prompt_token_ids for x in rollouts], [x.token_ids for x in rollouts])
        r.spool.write_policy(version, weights, step=step)
    row["stage/measure_s"] = time.perf_counter() - t0


# ---- the asynchronous loop: the rollouts of step t+L generate while step t trains

class Pipeline:
    """The rollouts ``async_lag`` (L) steps ahead of the trainer (docs/design.md, "Asynchronous
    RL"): a background thread waits for the engine process's generation (it holds no lock
    meanwhile) while this thread trains. Draws the synchronous loop's problems and seeds, step by step."""

    def __init__(self, r: Run):
        self.r, self.engine = r, r.engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-gen")
        self.ready: dict[int, tuple[list[dict], Any, int]] = {}  # step -> (problems, GenerateResult, sampling version)
        self.job = None

    def launch(self, step: int, background: bool = True):
        cfg = self.r.cfg
        problems, sampling = draw_batch(self.r)
        sampling["logprobs"] = cfg.grpo.off_policy_clip > 0  # the sampler's, for the update's importance weights
        # read before the generation starts: the engine answers one call at a time, so a read
        # after it would wait for the whole generation
        version = self.engine.policy_version
        prompts = [p["prompt"] for p in problems]
        if background:  # the engine's share of the cores, beside the trainer
            self.engine.set_threads(cfg.async_threads)
            future = self.pool.submit(self.engine.generate, prompts, **sampling)
        else:  # nothing to overlap with: every core
            self.engine.set_threads(cfg.engine_threads)
            future = Future()
            future.set_result(self.engine.generate(prompts, **sampling))
        return step, problems, future, version

    def collect(self, job) -> None:
        step, problems, future, version = job
        self.ready[step] = (problems, future.result(), version)

    def threads(self) -> int:
        """The trainer's threads: its share while the generation runs, every core once it is done."""
        job = self.job
        return self.r.cfg.async_threads if job is not None and not job[2].done() else self.r.cfg.engine_threads

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def async_loop(r: Run):
    """Step t trains on rollouts the engine sampled at policy v(t-L) (v0 for the first L steps)
    while the rollouts of step t+L generate on the engine serving v(t); the adapter's round runs
    beside that generation on the trainer's own forward at v(t). At the step's end the boundary
    loads v(t+1) and swaps in the newest draft the engine may serve (never one trained on a newer
    policy). Returns the arms at the last RL batch (or None)."""
    cfg = r.cfg
    lag, steps = cfg.async_lag, cfg.grpo.steps
    boundary = StepBoundary(r.adapter, r.engine)
    pipe = Pipeline(r)
    rl_batch = None
    try:
        t0 = time.perf_counter()
        for step in range(min(lag, steps)):  # the pipeline fills: these generations are all exposed
            pipe.collect(pipe.launch(step, background=False))
        fill_s = time.perf_counter() - t0
        for step in range(steps):
            row, problems, weights, gen, sampled = async_step(r, boundary, pipe, step, fill_s if step == 0 else 0.0)
            follow_policy(r, row, weights, step + 1, step, sampled=sampled, rollouts=gen.rollouts)
            # the arms, with the generation idle and every core back
            r.engine.set_threads(cfg.engine_threads)
            with torch_threads(cfg.engine_threads):
                rl_batch = record_step(r, row, step, step + 1, problems) or rl_batch
    finally:
        pipe.close()
    return rl_batch


def async_step(r: Run, boundary: StepBoundary, pipe: Pipeline, step: int, fill_s: float):
    """One asynchronous RL step: launch step+L's generation, update on step's rollouts beside it,
    the adapter's round beside it too, then the boundary (the generation done, v(step+1) into the
    engine, the newest draft it may serve). Returns (row, problems, weights, the rollouts' result,
    the version that sampled them)."""
    cfg, engine, lag = r.cfg, r.engine, r.cfg.async_lag
    row: dict = {"step": step}
    t_step = time.perf_counter()
    problems, gen, sampled = pipe.ready.pop(step)
    pipe.job = pipe.launch(step + lag) if step + lag < cfg.grpo.steps else None
    t0 = time.perf_counter()  # the policy update, beside the generation; the trainer is at v(step)
    metrics, weights, ho = update(r, step, problems, gen.rollouts, threads=pipe.threads)
    row.update(metrics)
    handover_s = ho.seconds if ho is not None else 0.0
    row["stage/train_s"] = time.perf_counter() - t0 - handover_s
    t0 = time.perf_counter()  # draftadapt's round, beside the generation: targets from v(step), the hand-over's
    torch.set_num_threads(pipe.threads())
    row.update(boundary.beside_generation(gen.acceptance, gen.rollouts, sampled_version=step, weights=weights,
                                          version=step + 1, handover=ho))
    adapt_s = time.perf_counter() - t0 + handover_s
    t0 = time.perf_counter()  # the generation done
    if pipe.job is not None:
        pipe.collect(pipe.job)
    row["stage/exposed_gen_s"] = time.perf_counter() - t0 + fill_s
    if step == 0:
        row["async/fill_s"] = fill_s  # the first batch's generation, alone: part of the exposed time
    row["stage/gen_s"] = pipe.ready[step + lag][1].seconds if pipe.job is not None else 0.0
    if r.online_k is not None and pipe.job is not None:  # the newest batch's counters, the engine idle
        row.update(r.online_k.update(engine, pipe.ready[step + lag][1].acceptance))
        row["k/schedule"] = schedule_text(engine.k_schedule)
    b = boundary.after_generation(weights, step + 1)  # v(step+1) in, the newest draft it may serve
    if r.adapter is not None:
        row.update(b.metrics)
        if b.swap is not None:
            seed_online_k(r, engine, b.swap, row)
        adapt_s += b.adapter_s
        row["draft/version"] = float(engine.draft_version or 0)
        row["draft/policy_version"] = float(served_policy_version(engine))
    row["stage/adapt_s"] = adapt_s
    row["stage/rl_step_s"] = time.perf_counter() - t_step + fill_s
    # the versions each side held this step (tests/integration/test_async.py checks them)
    row.update({"async/rollout_version": float(sampled), "async/trainer_version": float(step),
                "async/engine_version": float(engine.policy_version)})
    return row, problems, weights, gen, sampled


def served_policy_version(engine: RolloutEngine) -> int:
    """The policy version the engine's live draft was trained against (0: the starting draft)."""
    meta = json.loads((engine.draft_dir / META_FILE).read_text())
    return int(meta.get("policy_version") or 0)
