"""The demo's measurement arms: no speculation, the frozen draft, the adapted draft (and the fixed-k
and fresh-draft references) on the same prompts and policy, outside the RL step's time. The loop
calls ``record_step`` after each RL step (draftadapt/rl/loop.py)."""

from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path

import torch

from draftadapt.config import load_config
from draftadapt.engine.rollout import DraftSwapError, RolloutEngine
from draftadapt.online_k import schedule_text
from draftadapt.precision import engine_dtype
from draftadapt.rl.config import demo_pretrain_overrides, DemoConfig


def measure(engine: RolloutEngine, prompts: list[str], cfg: DemoConfig, max_tokens: int | None = None) -> dict:
    # The engine runs in this process (CPU): a garbage-collector pass over the trainer's heap
    # inside a ~2 s timing would land on whichever arm it hits. Collect first, then hold it off.
    gc.collect()
    gc.disable()
    try:
        res = engine.generate(prompts, temperature=cfg.grpo.temperature, max_tokens=max_tokens or cfg.eval.max_tokens,
                              seed=cfg.eval.seed)
    finally:
        gc.enable()
    out = {"tokens_per_s": res.tokens_per_s, "tokens": res.num_tokens, "seconds": res.seconds,
           "acceptance_length": res.acceptance.acceptance_length,  # nan without speculation
           "per_position": res.acceptance.per_position_rate}
    return out

def served_undrafted(r) -> bool:
    """The synchronous RL step generates on the undrafted engine: online k's table drafts at no
    batch size, so the speculative engine's drafter idles and the no-speculation arm's engine,
    which holds the same policy, serves the RL batch (docs/design.md, "Stepping aside")."""
    return (r.online_k is not None and not r.cfg.async_lag and r.spec_engine is not None
            and r.spec_engine.drafter_idle)

def measure_arms(plain: RolloutEngine, spec_engine: RolloutEngine, draft0: Path, prompts: list[str], cfg: DemoConfig,
                 step: int, max_tokens: int | None = None, undrafted: bool = False) -> tuple[dict, dict, dict]:
    """No speculation, the frozen draft, the adapted draft: same prompts, same policy. The order
    flips every step (plain first, then last), so a slow drift of this machine's speed does not
    favour one arm's tokens/s. Under online k the frozen draft is measured at ``cfg.k`` (as the
    adapted one is in its fixed-k arm): the drift is compared at one k, also on steps whose
    table drafts nothing. The adapted arm is what the RL step serves: ``undrafted`` (the step
    generates on the plain engine, :func:`served_undrafted`), the plain arm's own generation,
    not the speculative engine idling beside it."""
    def frozen() -> dict:
        table = getattr(spec_engine, "k_schedule", None)  # a Ray fleet drafts a fixed k
        if table is None:
            return measure_draft(spec_engine, draft0, prompts, cfg, max_tokens)
        spec_engine.set_k_schedule([(1, spec_engine.max_num_seqs, cfg.k)])
        try:
            return measure_draft(spec_engine, draft0, prompts, cfg, max_tokens)
        finally:
            spec_engine.set_k_schedule(table)

    def adapted() -> dict | None:
        return None if undrafted else measure(spec_engine, prompts, cfg, max_tokens)

    if step % 2 == 0:
        m_plain = measure(plain, prompts, cfg, max_tokens)
        m_frozen = frozen()
        m_adapted = adapted()
    else:
        m_adapted = adapted()
        m_frozen = frozen()
        m_plain = measure(plain, prompts, cfg, max_tokens)
    return m_plain, m_frozen, dict(m_plain) if m_adapted is None else m_adapted

# k_policy=online: the adapted draft also served at the fixed k, on the same engine, prompts and
# policy, every step: online k against fixed k measured in one run (two runs' RL trajectories
# differ with every sample, and their drafts with them).
FIXED_K_ARM = "adapted_fixed_k"

def measure_fixed_k(spec_engine: RolloutEngine, prompts: list[str], cfg: DemoConfig, max_tokens: int | None = None) -> dict:
    """The live draft at ``cfg.k`` tokens at every batch size: swap the engine's k table, generate,
    put the online table back."""
    table = spec_engine.k_schedule
    spec_engine.set_k_schedule([(1, spec_engine.max_num_seqs, cfg.k)])
    try:
        return measure(spec_engine, prompts, cfg, max_tokens)
    finally:
        spec_engine.set_k_schedule(table)

def fastest(arms: dict, repeats: int) -> dict[str, dict]:
    """Each arm's fastest measurement over ``repeats`` rounds of ``arms`` (name -> a call returning
    :func:`measure`'s dict), each round starting one arm later than the one before."""
    names, best = list(arms), {}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            m = arms[name]()
            if name not in best or m["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = m
    return best

def compare_k(plain: RolloutEngine, spec_engine: RolloutEngine, prompts: list[str], cfg: DemoConfig,
              max_tokens: int | None = None, undrafted: bool = False) -> dict:
    """Online k against fixed k on ``prompts``, one engine, one draft, one policy: ``k_compare_repeats``
    rounds of plain / online table / fixed k, each round starting one arm later; the fastest
    generation of each arm counts. ``undrafted``: the online table drafts nowhere and the RL step
    generates on the plain engine, so the online arm is the plain arm's generations."""
    arms = {"plain": lambda: measure(plain, prompts, cfg, max_tokens),
            "fixed_k": lambda: measure_fixed_k(spec_engine, prompts, cfg, max_tokens)}
    if not undrafted:
        arms["online"] = lambda: measure(spec_engine, prompts, cfg, max_tokens)
    best = fastest(arms, cfg.k_compare_repeats)
    if undrafted:
        best["online"] = best["plain"]
    tps = {name: m["tokens_per_s"] for name, m in best.items()}
    return {"k": cfg.k, "repeats": cfg.k_compare_repeats, "table": schedule_text(spec_engine.k_schedule),
            "undrafted": undrafted,
            **{f"{name}_tokens_per_s": v for name, v in tps.items()},
            "online_acceptance_length": best["online"]["acceptance_length"],
            "fixed_k_acceptance_length": best["fixed_k"]["acceptance_length"],
            "online_over_plain_tokens_per_s": tps["online"] / tps["plain"],
            "fixed_k_over_plain_tokens_per_s": tps["fixed_k"] / tps["plain"],
            "online_over_fixed_k_tokens_per_s": tps["online"] / tps["fixed_k"]}

def third_ends(steps: int) -> list[int]:
    """The steps (0-based) that end each third of a run of ``steps``; the last step is one."""
    return sorted({max(0, round(steps * i / 3) - 1) for i in (1, 2, 3)})

def compare_served(plain: RolloutEngine, spec_engine: RolloutEngine, prompts: list[str], cfg: DemoConfig,
                   max_tokens: int | None = None, undrafted: bool = False) -> float:
    """Tokens/s of the configuration the RL step serves over no draft's on ``prompts`` (the RL
    batch), one policy: ``k_compare_repeats`` rounds of the two, each round starting with the other,
    the fastest generation of each. ``undrafted``: the plain engine itself serves, 1.0 with no
    generation (the same engine, prompts and seed sample the same tokens)."""
    if undrafted:
        return 1.0
    best = fastest({"plain": lambda: measure(plain, prompts, cfg, max_tokens),
                    "served": lambda: measure(spec_engine, prompts, cfg, max_tokens)}, cfg.k_compare_repeats)
    return best["served"]["tokens_per_s"] / best["plain"]["tokens_per_s"]

def measure_draft(spec_engine: RolloutEngine, draft: Path, prompts: list[str], cfg: DemoConfig,
                  max_tokens: int | None = None) -> dict:
    """Measure another draft in the running engine: swap it in, generate, swap the live one back."""
    live = spec_engine.draft_dir
    spec_engine.swap_draft(draft)
    try:
        return measure(spec_engine, prompts, cfg, max_tokens)
    finally:
        spec_engine.swap_draft(live)

def measure_fresh(cfg: DemoConfig, world, out: Path, spec_engine: RolloutEngine, prompts: list[str]) -> dict:
    """Pretrain a draft from scratch on the final policy (the ``world``'s recipe), swap it into the
    running engine (which serves the final policy) and measure it on the same prompts."""
    from draftadapt.pretrain import PretrainConfig, pretrain

    fresh_dir = out / "draft_fresh_final"
    print(f"[demo] pretraining a fresh draft on the final policy into {fresh_dir} (reference)", flush=True)
    t0 = time.perf_counter()
    # The pretrain seeds its data's requests itself; the fork keeps anything else in it that
    # draws from torch's global generator independent of what ran before in this process (a world
    # built in it or passed in once gave 3.04 against 2.84 for the same seed-0 run).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        pretrain(load_config(PretrainConfig, cfg.pretrain_recipe or world.pretrain_recipe, [
            f"target={out / 'final_policy'}", f"out={fresh_dir}", *world.fresh_overrides(out / "final_policy"),
            f"max_minutes={cfg.fresh_max_minutes}", f"method={cfg.method}",
            *demo_pretrain_overrides(cfg, world.pretrain_recipe)]), world.pretrain_source)
    seconds = time.perf_counter() - t0
    try:
        m = measure_draft(spec_engine, fresh_dir, prompts, cfg)
    except DraftSwapError:  # a user's draft= of another architecture: serve the fresh one apart
        engine = RolloutEngine(out / "final_policy", fresh_dir, method=cfg.method, num_speculative_tokens=cfg.k,
                               threads=cfg.engine_threads, seed=cfg.seed,
                               dtype=engine_dtype(cfg.engine_precision, out / "final_policy"))
        try:
            m = measure(engine, prompts, cfg)
        finally:
            engine.close()
    m_adapted = measure(spec_engine, prompts, cfg)
    return {"acceptance_length": m["acceptance_length"], "per_position": m["per_position"],
            "tokens_per_s": m["tokens_per_s"], "adapted_final_acceptance": m_adapted["acceptance_length"],
            "pretrain_seconds": seconds}

def throughput(ms: list[dict]) -> float:
    seconds = sum(m["seconds"] for m in ms)
    return sum(m["tokens"] for m in ms) / seconds if seconds > 0 else float("nan")


def seed_online_k(r, engine, swap, row: dict) -> None:
    """k_policy=online: a newly swapped-in draft starts from the acceptance its adapter simulated
    for it (``OnlineK.new_draft``), and the table is re-chosen for it before it generates."""
    sim = r.adapter.simulated_length(swap.version) if r.online_k is not None else None
    if sim is not None:
        row.update(r.online_k.new_draft(engine, sim, r.adapter.cfg.k))
        row["k/schedule"] = schedule_text(engine.k_schedule)


def measure_step(r, row: dict, step: int, version: int, problems: list[dict]):
    """The arms of one step (see record_step); the row gains their figures."""
    cfg, spec_engine, plain, adapter = r.cfg, r.spec_engine, r.plain, r.adapter
    rl_batch = None
    if spec_engine is not None:
        undrafted = served_undrafted(r)  # the next RL step generates on the plain engine
        fixed_first = r.online_k is not None and step % 2 == 1  # beside the adapted arm, both orders
        if fixed_first:
            r.arms[FIXED_K_ARM].append(measure_fixed_k(spec_engine, r.eval_prompts, cfg))
        m_plain, m_frozen, m_adapted = measure_arms(plain, spec_engine, r.draft0, r.eval_prompts, cfg, step,
                                                    undrafted=undrafted)
        for name, m in (("plain", m_plain), ("frozen", m_frozen), ("adapted", m_adapted)):
            r.arms[name].append(m)
        if r.online_k is not None and not fixed_first:
            r.arms[FIXED_K_ARM].append(measure_fixed_k(spec_engine, r.eval_prompts, cfg))
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
        if step in third_ends(cfg.grpo.steps) and cfg.rl_batch_arms:
            # at the end of each third, at the RL batch and its policy: what the step serves over no draft
            batch, tokens = [p["prompt"] for p in problems], cfg.grpo.max_tokens
            if step == cfg.grpo.steps - 1:  # and every arm (compare_k's online arm is the served one)
                rl_batch = measure_arms(plain, spec_engine, r.draft0, batch, cfg, step, tokens, undrafted)
                if r.online_k is not None:
                    rl_batch = (*rl_batch, compare_k(plain, spec_engine, batch, cfg, tokens, undrafted))
                    served = rl_batch[3]["online_over_plain_tokens_per_s"]
                else:
                    served = rl_batch[2]["tokens_per_s"] / rl_batch[0]["tokens_per_s"]
            else:
                served = compare_served(plain, spec_engine, batch, cfg, tokens, undrafted)
            row["tps/rl_batch_served_over_plain"] = served
            row["k/served_undrafted"] = float(undrafted)
    else:
        m_plain = measure(plain, r.eval_prompts, cfg)
        r.arms["plain"].append(m_plain)
        row["tps/plain"] = m_plain["tokens_per_s"]
    return rl_batch


def record_step(r, row: dict, step: int, version: int, problems: list[dict]):
    """After a step: the arms on the held-out prompts with the engines at policy ``version``
    (outside the RL step's time, and off the adapter's cost clock: schedule.max_share shares the
    RL step's time, not the demo's measurements), the row logged and printed. Returns the arms
    at the RL batch on the last step (``rl_batch_arms``), else None."""
    cfg, spec_engine, adapter = r.cfg, r.spec_engine, r.adapter
    t_measure = time.perf_counter()
    with adapter.not_counted() if adapter is not None else contextlib.nullcontext():
        rl_batch = measure_step(r, row, step, version, problems)
    row["stage/measure_s"] = row.get("stage/measure_s", 0.0) + time.perf_counter() - t_measure
    r.logger.log_dict({k: v for k, v in row.items() if isinstance(v, float)}, step=version)
    r.history.append(row)
    accept = (f"accept frozen {row['accept/frozen_length']:.2f} adapted {row['accept/length']:.2f} | "
              if spec_engine is not None else "no speculation | ")
    gen = (f"gen {row['stage/gen_s']:.1f} exposed {row['stage/exposed_gen_s']:.1f}" if cfg.async_lag
           else f"gen {row['stage/gen_s']:.1f}")
    print(f"[demo] step {step + 1:3d}/{cfg.grpo.steps} reward {row['rl/reward']:.3f} "
          f"acc {row['rl/accuracy']:.2f} style {row['rl/style_frac']:.2f} | {accept}"
          f"RL step {row['stage/rl_step_s']:.1f} s ({gen} train "
          f"{row['stage/train_s']:.1f} adapt {row['stage/adapt_s']:.2f})"
          + (f" | draft v{int(row['draft/version'])}" if spec_engine is not None else "")
          + "".join(f" | {name} {row[f'accept/{name}_length']:.2f}" for name in r.baselines)
          + (f" | tok/s online/k={cfg.k} {row['tps/adapted'] / row[f'tps/{FIXED_K_ARM}']:.2f}"
             if r.online_k is not None else "")
          + (f" | k {row.get('k/schedule', 'unchanged')}" if r.online_k is not None else ""), flush=True)
    return rl_batch
