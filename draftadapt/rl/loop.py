"""The toy world's RL run: GRPO on the toy task playing "an existing RL run", with draftadapt
attached through its public API (what ``draftadapt demo`` runs; toy/build.py builds the world).

    draftadapt demo --out runs/demo [--steps N] [--seed N] [--toy DIR] [key=value ...]

Builds (or reuses) the toy target and a pretrained Eagle-3 draft, then runs GRPO on the toy task:
vLLM rollouts with speculation, rewards from the task verifier, policy-gradient updates on an HF
copy of the policy, the new policy weights loaded in place into the engines every step. At every
step three arms are measured on the same held-out prompts: no speculation, the frozen pretrained
draft, and the adapted draft (both drafts in one engine, by in-place swaps). Prints one line per
step and a summary; writes OUT/summary.json, OUT/acceptance.png, OUT/metrics.jsonl and
OUT/tb/ (TensorBoard).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from draftadapt.adapter import DraftAdapter
from draftadapt.boundary import StepBoundary
from draftadapt.config import load_config, save_config
from draftadapt.data.sequences import as_sequences, collate
from draftadapt.drafts.formats import META_FILE
from draftadapt.engine.remote import EngineProcess
from draftadapt.engine.rollout import RolloutEngine
from draftadapt.metrics.logger import make_logger
from draftadapt.online_k import OnlineK, schedule_text
from draftadapt.toy import task
from draftadapt.toy.arms import FIXED_K_ARM, compare_k, measure, measure_arms, measure_fixed_k, measure_fresh
from draftadapt.toy.demo_config import demo_adapter, demo_pretrain_overrides, DemoConfig, GRPOConfig
from draftadapt.toy.summary import fleet_summary, load_baseline, load_sync, plot, summarize
from draftadapt.train.trainer import torch_threads


def prepare_world(cfg, out: Path) -> tuple[Path, Path]:
    """The toy target and the draft RL starts from (built once; reused from OUT on a rerun)."""
    from draftadapt.toy.world import prepare_toy_world

    return prepare_toy_world(out, cfg.toy, cfg.draft, cfg.seed, cfg.pretrain_recipe, demo_pretrain_overrides(cfg), tag="demo",
                             method=cfg.method, own_draft=cfg.initial_draft == "own")


@dataclass
class Run:
    """What the steps of one demo run share: the RL run's parts, draftadapt's, and the records."""
    cfg: DemoConfig
    policy: Any
    reference: Any  # the initial policy, for the KL term
    opt: torch.optim.Optimizer
    pad_id: int
    logger: Any
    adapter: DraftAdapter | None
    spec: RolloutEngine | None  # with speculation: the engine the RL step generates with
    plain: RolloutEngine  # no speculation: the measurement arm (with spec) or the RL engine
    draft0: Path  # the frozen pretrained draft (an arm)
    eval_prompts: list[str]
    spool: Any
    rng: random.Random
    history: list[dict]
    arms: dict[str, list[dict]]
    baselines: dict[str, RolloutEngine] = field(default_factory=dict)  # model-free drafters, by name
    online_k: OnlineK | None = None  # k_policy=online: re-chooses the speculative engine's k table


def seed_online_k(r: Run, engine, swap, row: dict) -> None:
    """k_policy=online: a newly swapped-in draft starts from the acceptance its adapter simulated
    for it (``OnlineK.new_draft``), and the table is re-chosen for it before it generates."""
    sim = r.adapter.simulated_length(swap.version) if r.online_k is not None else None
    if sim is not None:
        row.update(r.online_k.new_draft(engine, sim, r.adapter.cfg.k))
        row["k/schedule"] = schedule_text(engine.k_schedule)


def measure_step(r: Run, row: dict, step: int, version: int, problems: list[dict]):
    """The arms of one step (see record_step); the row gains their figures."""
    cfg, spec, plain, adapter = r.cfg, r.spec, r.plain, r.adapter
    rl_batch = None
    if spec is not None:
        fixed_first = r.online_k is not None and step % 2 == 1  # beside the adapted arm, both orders
        if fixed_first:
            r.arms[FIXED_K_ARM].append(measure_fixed_k(spec, r.eval_prompts, cfg))
        m_plain, m_frozen, m_adapted = measure_arms(plain, spec, r.draft0, r.eval_prompts, cfg, step)
        for name, m in (("plain", m_plain), ("frozen", m_frozen), ("adapted", m_adapted)):
            r.arms[name].append(m)
        if r.online_k is not None and not fixed_first:
            r.arms[FIXED_K_ARM].append(measure_fixed_k(spec, r.eval_prompts, cfg))
        if r.online_k is not None:
            row[f"tps/{FIXED_K_ARM}"] = r.arms[FIXED_K_ARM][-1]["tokens_per_s"]
            row[f"accept/{FIXED_K_ARM}_length"] = r.arms[FIXED_K_ARM][-1]["acceptance_length"]
        for name, engine in r.baselines.items():
            r.arms[name].append(measure(engine, r.eval_prompts, cfg))
            row[f"accept/{name}_length"] = r.arms[name][-1]["acceptance_length"]
            row[f"tps/{name}"] = r.arms[name][-1]["tokens_per_s"]
        row.update({
            "accept/length": m_adapted["acceptance_length"],
            "accept/frozen_length": m_frozen["acceptance_length"],
            **{f"accept/pos_{i}": x for i, x in enumerate(m_adapted["per_position"])},
            "tps/plain": m_plain["tokens_per_s"], "tps/frozen": m_frozen["tokens_per_s"],
            "tps/adapted": m_adapted["tokens_per_s"],
            "draft/age_policy_versions": float(version - adapter.store.latest().policy_version),
        })
        if step == cfg.grpo.steps - 1 and cfg.rl_batch_arms:
            batch = [p["prompt"] for p in problems]
            rl_batch = measure_arms(plain, spec, r.draft0, batch, cfg, step, max_tokens=cfg.grpo.max_tokens)
            if r.online_k is not None:
                rl_batch = (*rl_batch, compare_k(plain, spec, batch, cfg, max_tokens=cfg.grpo.max_tokens))
    else:
        m_plain = measure(plain, r.eval_prompts, cfg)
        r.arms["plain"].append(m_plain)
        row["tps/plain"] = m_plain["tokens_per_s"]
    return rl_batch


def record_step(r: Run, row: dict, step: int, version: int, problems: list[dict]):
    """After a step: the arms on the held-out prompts with the engines at policy ``version``
    (outside the RL step's time, and off the adapter's cost clock: schedule.max_share shares the
    RL step's time, not the demo's measurements), the row logged and printed. Returns the arms
    at the RL batch on the last step (``rl_batch_arms``), else None."""
    cfg, spec, adapter = r.cfg, r.spec, r.adapter
    t_measure = time.perf_counter()
    with adapter.not_counted() if adapter is not None else contextlib.nullcontext():
        rl_batch = measure_step(r, row, step, version, problems)
    row["stage/measure_s"] = row.get("stage/measure_s", 0.0) + time.perf_counter() - t_measure
    r.logger.log_dict({k: v for k, v in row.items() if isinstance(v, float)}, step=version)
    r.history.append(row)
    accept = (f"accept frozen {row['accept/frozen_length']:.2f} adapted {row['accept/length']:.2f} | "
              if spec is not None else "no speculation | ")
    gen = (f"gen {row['stage/gen_s']:.1f} exposed {row['stage/exposed_gen_s']:.1f}" if cfg.async_lag
           else f"gen {row['stage/gen_s']:.1f}")
    print(f"[demo] step {step + 1:3d}/{cfg.grpo.steps} reward {row['rl/reward']:.3f} "
          f"acc {row['rl/accuracy']:.2f} style {row['rl/style_frac']:.2f} | {accept}"
          f"RL step {row['stage/rl_step_s']:.1f} s ({gen} train "
          f"{row['stage/train_s']:.1f} adapt {row['stage/adapt_s']:.2f})"
          + (f" | draft v{int(row['draft/version'])}" if spec is not None else "")
          + "".join(f" | {name} {row[f'accept/{name}_length']:.2f}" for name in r.baselines)
          + (f" | tok/s online/k={cfg.k} {row['tps/adapted'] / row[f'tps/{FIXED_K_ARM}']:.2f}"
             if r.online_k is not None else "")
          + (f" | k {row.get('k/schedule', 'unchanged')}" if r.online_k is not None else ""), flush=True)
    return rl_batch


def run(cfg: DemoConfig) -> dict:
    t_run = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, adapter=demo_adapter(cfg))  # config.yaml says what the adapter ran with
    save_config(cfg, out / "config.yaml")
    baseline = load_baseline(cfg.baseline) if cfg.baseline else None
    sync = load_sync(cfg.sync) if cfg.sync else None
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    toy, draft0 = prepare_world(cfg, out)

    # ---- setup: the "existing RL run" (policy + engine) and, with spec, draftadapt beside it
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(toy), torch_dtype=torch.float32)
    policy.eval()
    reference = copy.deepcopy(policy).requires_grad_(False)  # the initial policy, for the KL term
    pad_id = int(policy.config.pad_token_id or 0)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.grpo.lr, betas=(0.9, 0.99))
    logger = make_logger(["tensorboard", "jsonl"], out)
    adapter = spec = None
    # asynchronous: the RL engine in a child process, so generating beside the trainer does not
    # contend for this interpreter's lock (docs/design.md, "Asynchronous RL")
    rl_engine = EngineProcess if cfg.async_lag else RolloutEngine
    ray_cluster = None
    if cfg.spec and cfg.engines > 1:
        # the fleet: N engine actors on a local Ray cluster, the adapter in an actor of its own
        from draftadapt.integrations.ray import DraftFleet, RemoteAdapter, local_cluster

        ray_cluster = local_cluster()
        adapter = RemoteAdapter(toy, draft0, out / "drafts", cfg.adapter, threads=cfg.engine_threads)
        spec = DraftFleet(toy, draft0, engines=cfg.engines, cache_dir=out / "fleet",
                          engine_kwargs=dict(method=cfg.method, num_speculative_tokens=cfg.k, seed=cfg.seed,
                                             threads=max(1, cfg.engine_threads // cfg.engines),
                                             max_num_seqs=cfg.max_num_seqs))
    elif cfg.spec:
        adapter = DraftAdapter(toy, draft0, out / "drafts", cfg.adapter)
        online = cfg.k_policy == "online"
        spec = rl_engine(toy, draft0, method=cfg.method, num_speculative_tokens=cfg.online_k.k_max if online else cfg.k,
                         threads=cfg.engine_threads, seed=cfg.seed, max_num_seqs=cfg.max_num_seqs,
                         k_schedule=[(1, cfg.max_num_seqs, min(cfg.k, cfg.online_k.k_max))] if online else None)
    plain = (RolloutEngine if cfg.spec else rl_engine)(toy, None, threads=cfg.engine_threads, seed=cfg.seed,
                                                       max_num_seqs=cfg.max_num_seqs)
    # the model-free drafters each in a process of their own: in this one, the n-gram engine's
    # start made every later policy update 2.7x slower (3.2 s -> 8.4-8.9 s a step)
    baselines = {m: EngineProcess(toy, None, method=m, num_speculative_tokens=cfg.k, threads=cfg.engine_threads,
                                  seed=cfg.seed, max_num_seqs=cfg.max_num_seqs) for m in (cfg.baselines if cfg.spec else [])}
    rollout_engine = spec or plain  # what the RL step generates with
    eval_prompts = [p["prompt"] for p in task.load_heldout(toy)[: cfg.eval.prompts]]
    spool = None
    if cfg.spool:
        from draftadapt.spool import SpoolWriter

        spool = SpoolWriter(cfg.spool, writer_id="demo")
        spool.write_policy(0, toy)
    # vLLM lowers torch to one thread in this process when it starts; the engines idle while we
    # train, so the trainer takes the cores back.
    torch.set_num_threads(cfg.engine_threads)
    online_k = None
    if spec is not None and cfg.k_policy == "online":
        online_k = OnlineK.calibrate(spec, eval_prompts, cfg.online_k, cfg.grpo.temperature, cfg.eval.seed)
        print(f"[demo] online k: step costs measured in {online_k.calibrate_s:.1f} s, k table "
              f"{schedule_text(spec.k_schedule)} (batch sizes:k)", flush=True)
    history: list[dict] = []
    arms = {"plain": [], "frozen": [], "adapted": []} if cfg.spec else {"plain": []}
    if online_k is not None:
        arms[FIXED_K_ARM] = []
    arms.update({m: [] for m in baselines})
    rl_batch = None
    r = Run(cfg, policy, reference, opt, pad_id, logger, adapter, spec, plain, draft0, eval_prompts, spool, rng,
            history, arms, baselines, online_k)
    # the RL step's boundary: the engine's policy load and draftadapt's calls, in their one order
    boundary = StepBoundary(adapter, rollout_engine, background=cfg.adapter_background)
    t_start = time.perf_counter()

    try:
        for step in range(0 if cfg.async_lag else cfg.grpo.steps):
            row: dict = {"step": step}
            # 1. rollouts (with spec: from the live adapted draft; speculation changes nothing they contain)
            problems = [p for p in task.sample_problems(cfg.grpo.prompts_per_step, rng.randrange(1 << 30))
                        for _ in range(cfg.grpo.group_size)]
            boundary.before_generate()  # background rounds: the previous step's round runs beside this generation
            t0 = time.perf_counter()
            gen = rollout_engine.generate([p["prompt"] for p in problems], temperature=cfg.grpo.temperature,
                                          max_tokens=cfg.grpo.max_tokens, seed=rng.randrange(1 << 30))
            row["stage/gen_s"] = row["stage/exposed_gen_s"] = time.perf_counter() - t0
            row["tps/rl_batch"] = gen.tokens_per_s
            # what the engine measured for the live draft on the RL batch itself: free, and what
            # feeds the adapter's drift trigger (the eval arms below are not the step's)
            row.update(boundary.report(gen.spec))
            if online_k is not None:  # the same free counters re-choose the k table for what follows
                row.update(online_k.update(spec, gen.spec))
                row["k/schedule"] = schedule_text(spec.k_schedule)
            if spool is not None:
                spool.write_rollouts(step, step, [r.prompt_token_ids for r in gen.rollouts],
                                     [r.token_ids for r in gen.rollouts])
            # 2. the policy update (what the RL framework does anyway); with draftadapt its forward
            #    hands the aux states and log-probs over (hooks; the hand-over's own time is the adapter's)
            t0 = time.perf_counter()
            handover = adapter.handover(policy) if adapter is not None else contextlib.nullcontext()
            with handover as ho:
                row.update(grpo_update(policy, reference, opt, problems, gen.rollouts, cfg.grpo, pad_id, step, ho))
            version = step + 1
            weights = {k: v.detach() for k, v in policy.state_dict().items()}
            handover_s = ho.seconds if ho is not None else 0.0
            # 3. the step boundary: the engine's new policy, then draftadapt's calls in their order
            b = boundary.after_update(gen.rollouts, sampled_version=version - 1, weights=weights, version=version,
                                      handover=ho)
            row["stage/train_s"] = time.perf_counter() - t0 - handover_s - b.adapter_s
            t_measure = time.perf_counter()
            if spec is not None:
                plain.update_policy(weights, version=version)  # the no-speculation arm only
                for engine in baselines.values():
                    engine.update_policy(weights, version=version)
            if spool is not None:
                spool.write_policy(version, weights, step=step)
            row["stage/measure_s"] = time.perf_counter() - t_measure
            if adapter is not None:
                row.update(b.metrics)
                if b.swap is not None:
                    seed_online_k(r, spec, b.swap, row)
                row["stage/adapt_s"] = b.adapter_s + handover_s
                row["adapt/handover_s"] = handover_s
                row["draft/version"] = float(spec.draft_version or 0)
                if cfg.engines > 1:  # the version each engine served, read back from every actor
                    row["fleet/versions"] = spec.versions()
            else:
                row["stage/adapt_s"] = 0.0
            row["stage/rl_step_s"] = row["stage/gen_s"] + row["stage/train_s"] + row["stage/adapt_s"]
            # 4. the arms on the same prompts, same policy (outside the RL step's time)
            rl_batch = record_step(r, row, step, version, problems) or rl_batch
        if cfg.async_lag:
            rl_batch = async_steps(r)
        loop_seconds = time.perf_counter() - t_start
        if spool is not None:
            spool.finish(steps=len(history))
        save_policy(policy, toy, out / "final_policy")
        fresh = measure_fresh(cfg, out, spec, eval_prompts) if cfg.fresh_final and history and spec else None
    finally:
        if adapter is not None:
            adapter.close()  # a background round still open is finished, not abandoned mid-write
        for engine in (spec, plain, *baselines.values()):
            if engine is not None:
                engine.close()
        if ray_cluster is not None:
            ray_cluster.close()
        logger.close()

    summary = summarize(cfg, history, arms, loop_seconds, fresh, rl_batch, baseline, sync)
    if ray_cluster is not None:
        summary["fleet"] = fleet_summary(spec, history)
    if online_k is not None:
        summary["online_k"] = {"calibrate_seconds": online_k.calibrate_s, "cost_model": online_k.model.to_dict(),
                               "k_table_per_step": [h.get("k/schedule") for h in history]}
    summary["total_seconds"] = time.perf_counter() - t_run  # world setup + RL loop + fresh reference
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if spec is not None:
        plot(history, out / "acceptance.png")
    return summary


def async_steps(r: Run):
    """The RL loop with the rollouts ``async_lag`` (L) steps ahead of the trainer (docs/design.md,
    "Asynchronous RL"). Returns the arms at the RL batch of the last step (or None).

    Step t trains on rollouts the engine sampled at policy v(t-L) (v0 for the first L steps)
    while a background thread generates the rollouts of step t+L on the engine serving v(t).
    The adapter's round runs beside that generation, in this thread, on the trainer's own forward
    at v(t) (the hand-over): each candidate is trained and validated against v(t). At the step's
    end (the boundary) the loop waits for the generation, loads v(t+1) into the engines and swaps
    in the newest draft the engine may serve (DraftStore: never one trained on a newer policy),
    so a new draft serves one version behind the engine, as in the synchronous loop.
    """
    cfg, adapter, engine = r.cfg, r.adapter, r.spec or r.plain
    lag, steps = cfg.async_lag, cfg.grpo.steps
    boundary = StepBoundary(adapter, engine)
    # the thread that waits for the engine process's generation (it holds no lock meanwhile)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-gen")
    ready: dict[int, tuple[list[dict], Any, int]] = {}  # step -> (problems, GenerateResult, sampling version)
    rl_batch = None

    def launch(step: int, background: bool = True):
        # the synchronous loop's draws, in its order: the same problems and seeds step by step
        problems = [p for p in task.sample_problems(cfg.grpo.prompts_per_step, r.rng.randrange(1 << 30))
                    for _ in range(cfg.grpo.group_size)]
        args = ([p["prompt"] for p in problems],)
        kwargs = dict(temperature=cfg.grpo.temperature, max_tokens=cfg.grpo.max_tokens, seed=r.rng.randrange(1 << 30),
                      logprobs=cfg.grpo.off_policy_clip > 0)  # the sampler's, for the update's importance weights
        # read before the generation starts: the engine answers one call at a time, so a read
        # after it would wait for the whole generation
        version = engine.policy_version
        if background:  # the engine's share of the cores, beside the trainer
            engine.set_threads(cfg.async_threads)
            future = pool.submit(engine.generate, *args, **kwargs)
        else:  # nothing to overlap with: every core
            engine.set_threads(cfg.engine_threads)
            future = Future()
            future.set_result(engine.generate(*args, **kwargs))
        return step, problems, future, version

    def collect(job) -> None:
        step, problems, future, version = job
        ready[step] = (problems, future.result(), version)

    def threads_beside(job) -> int:
        # the trainer's threads: its share while the generation runs, every core once it is done
        return cfg.async_threads if job is not None and not job[2].done() else cfg.engine_threads

    try:
        t0 = time.perf_counter()
        for step in range(min(lag, steps)):  # the pipeline fills: these generations are all exposed
            collect(launch(step, background=False))
        fill_s = time.perf_counter() - t0
        for step in range(steps):
            row: dict = {"step": step}
            t_step = time.perf_counter()
            problems, gen, sampled = ready.pop(step)
            job = launch(step + lag) if step + lag < steps else None
            # 1. the policy update, beside the generation; the trainer is at v(step)
            t0 = time.perf_counter()
            handover = adapter.handover(r.policy) if adapter is not None else contextlib.nullcontext()
            with handover as ho:
                row.update(grpo_update(r.policy, r.reference, r.opt, problems, gen.rollouts, cfg.grpo, r.pad_id,
                                       step, ho, threads=lambda: threads_beside(job)))
            version = step + 1
            weights = {k: v.detach() for k, v in r.policy.state_dict().items()}
            handover_s = ho.seconds if ho is not None else 0.0
            row["stage/train_s"] = time.perf_counter() - t0 - handover_s
            # 2. draftadapt's round, beside the generation: targets from v(step), the hand-over's
            t0 = time.perf_counter()
            torch.set_num_threads(threads_beside(job))
            if adapter is not None:
                row.update(boundary.report(gen.spec))
                row.update(boundary.learn(gen.rollouts, sampled_version=step, weights=weights, version=version,
                                          handover=ho))
            adapt_s = time.perf_counter() - t0 + handover_s
            # 3. the boundary: the generation done, v(step+1) into the engine, the newest draft it may serve
            t0 = time.perf_counter()
            if job is not None:
                collect(job)
            row["stage/exposed_gen_s"] = time.perf_counter() - t0 + (fill_s if step == 0 else 0.0)
            if step == 0:
                row["async/fill_s"] = fill_s  # the first batch's generation, alone: part of the exposed time
            row["stage/gen_s"] = ready[step + lag][1].seconds if job is not None else 0.0
            boundary.load_policy(weights, version)
            if r.online_k is not None and job is not None:  # the newest batch's counters, the engine idle
                row.update(r.online_k.update(engine, ready[step + lag][1].spec))
                row["k/schedule"] = schedule_text(engine.k_schedule)
            if adapter is not None:
                b = boundary.serve()
                row.update(b.metrics)
                if b.swap is not None:
                    seed_online_k(r, engine, b.swap, row)
                adapt_s += b.adapter_s
                row["draft/version"] = float(engine.draft_version or 0)
                row["draft/policy_version"] = float(served_policy_version(engine))
            row["stage/adapt_s"] = adapt_s
            row["stage/rl_step_s"] = time.perf_counter() - t_step + (fill_s if step == 0 else 0.0)
            # the versions each side held this step (tests/integration/test_async.py checks them)
            row.update({"async/rollout_version": float(sampled), "async/trainer_version": float(step),
                        "async/engine_version": float(engine.policy_version)})
            t_measure = time.perf_counter()
            if r.spec is not None:
                r.plain.update_policy(weights, version=version)  # the no-speculation arm only
                for baseline in r.baselines.values():
                    baseline.update_policy(weights, version=version)
            if r.spool is not None:
                r.spool.write_rollouts(step, sampled, [x.prompt_token_ids for x in gen.rollouts],
                                       [x.token_ids for x in gen.rollouts])
                r.spool.write_policy(version, weights, step=step)
            row["stage/measure_s"] = time.perf_counter() - t_measure
            # 4. the arms, with the generation idle and every core back
            engine.set_threads(cfg.engine_threads)
            with torch_threads(cfg.engine_threads):
                rl_batch = record_step(r, row, step, version, problems) or rl_batch
    finally:
        pool.shutdown(wait=True)
    return rl_batch


def served_policy_version(engine: RolloutEngine) -> int:
    """The policy version the engine's live draft was trained against (0: the starting draft)."""
    meta = json.loads((engine.draft_dir / META_FILE).read_text())
    return int(meta.get("policy_version") or 0)


def save_policy(policy, toy: Path, path: Path) -> None:
    """The final policy as a model dir transformers and vLLM load (tokenizer copied from the toy)."""
    import shutil

    from draftadapt.toy.mtp import carry_mtp_layers

    policy.save_pretrained(str(path), safe_serialization=True)
    carry_mtp_layers(toy, path)  # an MTP toy's final policy is an MTP target again (no-op otherwise)
    for f in toy.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("generation_config.json", "heldout.jsonl"):
            shutil.copy2(f, path / f.name)


def demo_cli(overrides: list[str]) -> int:
    """``draftadapt demo``: ``overrides`` are DemoConfig's ``key=value`` (the command's flags
    arrive as their fields: --steps as grpo.steps). A bad key or baseline= raises ConfigError
    before anything starts."""
    cfg = load_config(DemoConfig, None, overrides)
    if cfg.baseline:
        load_baseline(cfg.baseline)
    if cfg.sync:
        load_sync(cfg.sync)
    # SIGTERM (a scheduler's kill, `kill PID`) unwinds like Ctrl-C, so run()'s finally closes the
    # vLLM engines: otherwise their EngineCore/Worker processes outlive us and keep polling a core.
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    summary = run(cfg)
    e = summary["end_to_end"]
    line = {"steps": summary["steps"], "seconds": round(summary["seconds"], 1),
            "total_seconds": round(summary["total_seconds"], 1), "spec": cfg.spec,
            **{k: round(v, 3) for k, v in summary.get("last_third", {}).items()},
            **{f"whole_run_{k}": round(v, 3) if isinstance(v, float) else v
               for k, v in summary.get("whole_run", {}).items()
               if k in ("adapted_over_frozen", "adapted_worst_over_start", "adapted_retention", "first_publish_step")},
            "rl_step_s": round(e["rl_step_s"], 2), "adapt_share": round(e["adapt_share"], 4),
            "gen_share": round(e["gen_share"], 3)}
    if "rl_batch_arms" in summary:
        line["rl_batch_adapted_over_plain_tokens_per_s"] = round(summary["rl_batch_arms"]["adapted_over_plain_tokens_per_s"], 3)
    if "vs_baseline" in summary:
        line.update({k: round(v, 3) for k, v in summary["vs_baseline"].items() if k != "baseline_rl_step_s"})
    if "async" in summary:
        a = summary["async"]
        line["async"] = {k: round(a[k], 3) for k in ("lag", "exposed_gen_s", "step_s", "overlap")}
        if "sync" in a:
            line["async"].update(sync_step_s=round(a["sync"]["step_s"], 3), speedup_over_sync=round(a["speedup_over_sync"], 3))
    line["out"] = cfg.out
    print(json.dumps(line))
    return 0

