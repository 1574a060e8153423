"""TRL's GRPOTrainer, unmodified, on a world of the demo's, with draftadapt attached through its rollout_func.

    .venv/bin/python recipes/trl_grpo_toy.py --out runs/trl [--steps 16] [--toy DIR] [--draft DIR]
    .venv/bin/python recipes/trl_grpo_toy.py --world smollm2 --out runs/trl_smol --target runs/smol/model --draft D

Builds (or reuses) the world's target and a pretrained Eagle-3 draft (``--world``: the toy, the
default, or SmolLM2-135M-Instruct on word problems, as ``draftadapt demo world=``; its RL sizes are
the demo's for that world), then runs TRL 1.16's GRPO on CPU: the target is the policy, the reward
is the world's (correct final answer plus a bonus for the style RL drifts to, the toy's verbose
answers or SmolLM2's replies in French, which moves the policy away from what the draft was
pretrained on), rollouts come from draftadapt's vLLM engine with speculation
(``draftadapt.integrations.trl.SpeculativeRollouts``) and the draft is adapted online. After
every optimizer step the frozen pretrained draft and the adapted one are measured on the same
held-out prompts (outside TRL's step time). Then TRL runs a few steps without draftadapt: with
its own generation (transformers ``generate``) and with vLLM rollouts without speculation.
Prints one line per step and, at the end, one JSON line:

    {"steps": 16, "adapted_over_frozen_acceptance": 1.366, "rl_step_speedup_over_trl_generate": 1.257, ...}

Writes OUT/summary.json (the demo's shape: arms with acceptance_length_per_step, last_third) and
OUT/trl/runs/*/events.out.tfevents.* (TensorBoard: accept/length, accept/pos_i, draft/version,
swap/ms next to TRL's own reward, loss and step_time).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Literal
from pathlib import Path

import torch

from draftadapt.adapter import AdapterConfig
from draftadapt.config import ConfigError, load_config, pass_down, save_config
from draftadapt.demo import make_world
from draftadapt.online_k import OnlineKConfig
from draftadapt.rl.config import toy_adapter, world_defaults
from draftadapt.rl.summary import whole_run


@dataclass
class TRLToyConfig:
    out: str = "runs/trl"
    # the demo's worlds (draftadapt/rl/world.py): "toy" or "smollm2"; the sizes below are the toy's,
    # smollm2's are the demo's for it (section_defaults)
    world: Literal["toy", "smollm2"] = "toy"
    # reuse a built target (the toy's `toy build` dir or `smollm2 build`'s; default: built once
    # into OUT/toy or OUT/model); --toy is the same
    target: str | None = None
    draft: str | None = None  # reuse a pretrained Eagle-3 draft (default: OUT/draft0, pretrained once)
    pretrain_recipe: str = ""  # how that draft is pretrained; empty: the world's own (package data)
    seed: int = 0
    # GRPO optimizer steps with draftadapt: the policy drifts from the draft slowly at first, so
    # fewer steps end before the frozen draft has fallen (docs/design.md, "TRL integration")
    steps: int = 16
    prompts_per_step: int = 64  # distinct problems per step (as the demo: 16 x 4 was too noisy)
    group_size: int = 4  # TRL's num_generations
    micro_batch: int = 64  # TRL's per_device_train_batch_size; accumulation makes up the step
    max_tokens: int = 96  # TRL's max_completion_length
    temperature: float = 1.0  # TRL's; passed down to adapter.temperature through the trainer
    lr: float = 7e-4  # the demo's policy rate and warmup (its GRPOConfig explains both)
    warmup_steps: int = 3
    beta: float = 0.1  # KL to the initial policy, as the demo
    style: str = ""  # the demo's reward: correct answer + style_bonus for this style (empty: the world's)
    style_bonus: float = 1.0
    k: int = 3  # the engine's draft length; passed down to adapter.k by SpeculativeRollouts
    # SpeculativeRollouts' k_policy: "auto" (online: the k table is measured on the first batch
    # and re-chosen from every batch's acceptance; where no k pays the drafter idles and the
    # adapter pauses, docs/design.md "Stepping aside"), "online" or "fixed" (k at every batch
    # size). The frozen/adapted arms are measured at k either way.
    k_policy: Literal["auto", "online", "fixed"] = "auto"
    online_k: OnlineKConfig = field(default_factory=OnlineKConfig)
    # torch threads of this process (trainer and in-process engine), both cores as the demo; on a
    # machine shared with other jobs use 1: two OpenMP threads on one free core wait on each
    # other at every barrier
    engine_threads: int = 2
    # the engines' weights (SpeculativeRollouts' engine_precision, the demo's): "auto" is bf16 on a
    # CPU with AMX-BF16 for a model at least 512 wide (SmolLM2), else the model's dtype (the toy)
    engine_precision: Literal["auto", "bf16", "fp32"] = "auto"
    eval_prompts: int = 32  # held-out prompts both drafts are measured on after every step
    eval_seed: int = 1234
    # Steps TRL runs without draftadapt, for its step time: with its own generation, and with
    # vLLM rollouts without speculation. 0 skips them. They are compared with the same steps
    # (2..baseline_steps) of the draftadapt run: completions grow as the policy drifts, so later
    # steps cost more whatever generates them.
    baseline_steps: int = 4
    # the demo's draft: pretrained on this many prompts (draftadapt/rl/config.py, DemoConfig explains
    # it; 0 = the recipe's own)
    pretrain_prompts: int = 768
    adapter: AdapterConfig = field(default_factory=toy_adapter)  # the demo's online schedule
    # what the worlds' prepare() also reads: an Eagle-3 head, pretrained (SpeculativeRollouts serves Eagle-3)
    method = "eagle3"
    initial_draft = "pretrain"

    @staticmethod
    def section_defaults(data: dict) -> dict:
        """The RL sizes of the demo's world (rl/config.py::world_defaults), where it has its own;
        a key given still sets only itself."""
        d = world_defaults(str(data.get("world", TRLToyConfig.world)))
        if not d:
            return {}
        g, e = d["grpo"], d["eval"]
        return {"steps": g.steps, "prompts_per_step": g.prompts_per_step, "group_size": g.group_size,
                "micro_batch": g.micro_batch, "max_tokens": g.max_tokens, "temperature": g.temperature, "lr": g.lr,
                "warmup_steps": g.warmup_steps,
                "beta": g.kl_coef, "eval_prompts": e.prompts, "pretrain_prompts": d["pretrain_prompts"],
                "adapter": d["adapter"]}

    @property
    def sampling_temperature(self) -> float:  # what the worlds' prepare() pretrains the draft at
        return self.temperature

    def validate(self) -> None:
        # what SpeculativeRollouts refuses (an Eagle-3 head at k), refused before the world is built
        pass_down(self.adapter, "adapter", method=("SpeculativeRollouts.method", "eagle3"), k=("k", self.k),
                  temperature=("temperature", self.temperature))


def reward_funcs(cfg: TRLToyConfig, world):
    """The world's reward as two TRL reward functions (TRL logs each one's mean and adds them).
    TRL hands them the dataset's other columns: ``answer``, each prompt's."""
    def correct(prompts, completions, answer, **_):
        return [world.score({"answer": a}, c, cfg)[1] for a, c in zip(answer, completions)]

    def style(prompts, completions, answer, **_):
        return [cfg.style_bonus * float(world.score({"answer": a}, c, cfg)[2]) for a, c in zip(answer, completions)]

    return [correct, style]


def make_trainer(cfg: TRLToyConfig, world, target: Path, out_dir: Path, steps: int, rollout_func=None, callbacks=()):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.integrations import import_framework

    # without TRL's VLLM_LOGGING_LEVEL=ERROR, which would silence the rollout engine's warnings
    trl = import_framework("trl")
    GRPOConfig, GRPOTrainer = trl.GRPOConfig, trl.GRPOTrainer
    n = cfg.prompts_per_step * cfg.group_size
    if n % cfg.micro_batch:
        raise ConfigError(f"prompts_per_step x group_size = {n} is not a multiple of micro_batch {cfg.micro_batch}")
    problems = world.sample_problems(target, cfg.prompts_per_step * steps, cfg.seed)
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, use_vllm=False, max_steps=steps, seed=cfg.seed,
        per_device_train_batch_size=cfg.micro_batch, gradient_accumulation_steps=n // cfg.micro_batch,
        num_generations=cfg.group_size, max_completion_length=cfg.max_tokens, temperature=cfg.temperature,
        learning_rate=cfg.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.warmup_steps,
        adam_beta2=0.99, max_grad_norm=1.0, beta=cfg.beta, loss_type="grpo",
        logging_steps=1, report_to=["tensorboard"], save_strategy="no", disable_tqdm=True,
        log_level="warning",
        # TRL's GRPOConfig defaults are GPU ones: bf16 autocast (emulated, and slow, on a CPU
        # without AVX-512 BF16) and gradient checkpointing (a second forward per micro-batch, for
        # memory a 5M-parameter policy does not need). float32 as the demo's own GRPO loop.
        bf16=False, gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return GRPOTrainer(model=model, reward_funcs=reward_funcs(cfg, world), args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in problems]),
                       rollout_func=rollout_func, callbacks=list(callbacks))


def measure(engine, prompts: list[str], cfg: TRLToyConfig) -> dict:
    # in-process engine: no collector pass over the trainer's heap inside a timing
    gc.collect()
    gc.disable()
    try:
        res = engine.generate(prompts, temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.eval_seed)
    finally:
        gc.enable()
    return {"acceptance_length": res.acceptance.length, "per_position": res.acceptance.per_position,
            "tokens_per_s": res.tokens_per_s, "tokens": res.num_tokens, "seconds": res.seconds}


@contextlib.contextmanager
def at_fixed_k(engine, k: int):
    """The engine drafts ``k`` at every batch size inside (an online table is put back after):
    the arms compare drafts at one k, whatever the RL batch's table says."""
    table = engine.k_schedule
    if table is None:
        yield
        return
    engine.set_k_schedule([(1, engine.max_num_seqs, k)])
    try:
        yield
    finally:
        engine.set_k_schedule(table)


def make_arms_callback(rollouts, draft0: Path, prompts: list[str], cfg: TRLToyConfig, arms: dict):
    """After each step (after draftadapt's own step end): the frozen and the adapted draft on the
    same prompts and policy, by in-place swaps; the order flips every step."""
    from transformers import TrainerCallback

    class Arms(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            engine = rollouts.engine

            def frozen():
                live = engine.draft_dir
                engine.swap_draft(draft0)
                try:
                    return measure(engine, prompts, cfg)
                finally:
                    engine.swap_draft(live)

            # the measurement is not the RL step's: off the adapter's cost clock (schedule.max_share)
            with rollouts.adapter.not_counted() if rollouts.adapter is not None else contextlib.nullcontext(), \
                    at_fixed_k(engine, cfg.k):
                if state.global_step % 2:
                    arms["frozen"].append(frozen())
                    arms["adapted"].append(measure(engine, prompts, cfg))
                else:
                    arms["adapted"].append(measure(engine, prompts, cfg))
                    arms["frozen"].append(frozen())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs or not arms["adapted"]:
                return
            f, a = arms["frozen"][-1], arms["adapted"][-1]
            print(f"[trl] step {state.global_step:3d}/{args.max_steps} reward {logs.get('reward', 0):.3f} "
                  f"style {logs.get('rewards/style/mean', 0):.2f} | accept frozen {f['acceptance_length']:.2f} "
                  f"adapted {a['acceptance_length']:.2f} (RL batch {logs.get('accept/length', float('nan')):.2f}) | "
                  f"TRL step {logs.get('step_time', 0):.1f} s, adapt {logs.get('stage/adapt_s', 0):.1f} s | "
                  f"draft v{int(logs.get('draft/version', 0))}", flush=True)

    return Arms()


def step_times(trainer) -> list[float]:
    """TRL's own step_time per optimizer step (generation + forward/backward, its metric)."""
    return [h["step_time"] for h in trainer.state.log_history if "step_time" in h]


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def run_baseline(cfg: TRLToyConfig, world, target: Path, out: Path, name: str, engine: bool) -> dict:
    """TRL without draftadapt for cfg.baseline_steps steps: its own generation, or vLLM rollouts
    without speculation (SpeculativeRollouts with no draft)."""
    from draftadapt.integrations.trl import SpeculativeRollouts

    rollouts = SpeculativeRollouts(target, None, engine_kwargs={"threads": cfg.engine_threads, "seed": cfg.seed},
                                   engine_precision=cfg.engine_precision) if engine else None
    try:
        trainer = make_trainer(cfg, world, target, out / name, cfg.baseline_steps, rollout_func=rollouts)
        torch.set_num_threads(cfg.engine_threads)
        trainer.train()
    finally:
        if rollouts is not None:
            rollouts.close()
    t = step_times(trainer)
    # the first step pays one-time costs (the engine's first sync, allocator warm-up)
    return {"step_time_s_per_step": t, "mean_step_time_s": mean(t[1:] or t)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--world", default=None, help="toy (default) or smollm2")
    ap.add_argument("--target", "--toy", dest="target", default=None, help="a built target to reuse")
    ap.add_argument("--draft", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of TRLToyConfig")
    a = ap.parse_args(argv)
    overrides = list(a.overrides) + [f"{k}={v}" for k, v in (("out", a.out), ("steps", a.steps), ("world", a.world),
                                                              ("target", a.target), ("draft", a.draft))
                                     if v is not None]
    try:
        cfg = load_config(TRLToyConfig, None, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t_run = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    world = make_world(cfg.world)
    target, draft0 = world.prepare(cfg, out)  # built once into OUT (or given), reused on a rerun

    # ---- the TRL run with draftadapt: the lines a TRL user adds are marked (+)
    from draftadapt.integrations.trl import SpeculativeRollouts

    rollouts = SpeculativeRollouts(target, draft0, out / "drafts", adapter_cfg=cfg.adapter, k=cfg.k,  # (+)
                                   engine_kwargs={"threads": cfg.engine_threads, "seed": cfg.seed},
                                   k_policy=cfg.k_policy, online_k=cfg.online_k, engine_precision=cfg.engine_precision)
    eval_prompts = world.heldout_prompts(target, cfg.eval_prompts)
    arms: dict[str, list[dict]] = {"frozen": [], "adapted": []}
    try:
        trainer = make_trainer(cfg, world, target, out / "trl", cfg.steps, rollout_func=rollouts,  # (+ rollout_func)
                               callbacks=[make_arms_callback(rollouts, draft0, eval_prompts, cfg, arms)])
        torch.set_num_threads(cfg.engine_threads)  # vLLM lowered it to 1 at start-up; the trainer takes both
        t0 = time.perf_counter()
        trainer.train()
        loop_seconds = time.perf_counter() - t0
    finally:
        rollouts.close()  # (+)
    history = rollouts.history
    logs = [h for h in trainer.state.log_history if "step_time" in h]

    # ---- TRL without draftadapt, same settings, for its step time
    baselines = {}
    if cfg.baseline_steps:
        baselines["trl_generate"] = run_baseline(cfg, world, target, out, "trl_generate", engine=False)
        baselines["vllm_no_spec"] = run_baseline(cfg, world, target, out, "vllm_no_spec", engine=True)

    # ---- summary (the demo's shape)
    n = len(history)
    last = max(1, n // 3)
    s = {"world": cfg.world, "steps": n, "seconds": loop_seconds, "spec": True, "framework": "trl " + __import__("trl").__version__,
         "reward_per_step": [h.get("reward") for h in logs],
         "accuracy_per_step": [h.get("rewards/correct/mean") for h in logs],
         "style_frac_per_step": [h.get("rewards/style/mean", 0.0) / cfg.style_bonus for h in logs],
         "arms_measured_at": f"{cfg.eval_prompts} eval prompts after every step", "arms": {}}
    for name, ms in arms.items():
        s["arms"][name] = {
            "acceptance_length_per_step": [m["acceptance_length"] for m in ms],
            "last_third_acceptance": mean([m["acceptance_length"] for m in ms[-last:]]),
            "mean_tokens_per_s": sum(m["tokens"] for m in ms) / max(1e-9, sum(m["seconds"] for m in ms)),
        }
    s["rl_batch_acceptance_per_step"] = [h.get("accept/length") for h in history]
    s["k_policy"] = "online" if rollouts.online else "fixed"
    if rollouts.online_k is not None:  # where the table drafted nothing, the RL batch ran undrafted
        s["online_k"] = {"calibrate_seconds": rollouts.online_k.calibrate_s,
                         "drafter_idle_per_step": [h.get("k/drafter_idle", 0.0) for h in history],
                         # the adapter trained nothing while no batch size drafted; what it
                         # simulated for its draft on those steps' rollouts is what resumes drafting
                         "adapter_paused_per_step": [h.get("adapt/paused", 0.0) for h in history],
                         # rollouts TRL's forward handed over: while paused, only those it simulates on
                         "handover_rows_per_step": [h.get("adapt/handover_rows") for h in history],
                         # paused, whether the step watched (its share of the run affords it: online_k.watch_share)
                         "watched_per_step": [h.get("adapt/watched") for h in history],
                         "simulated_length_per_step": [h.get("accept/simulated_live") for h in history],
                         "cost_model": rollouts.online_k.model.to_dict()}
    s["drafts"] = {"published": int(sum(h.get("adapt/published", 0.0) for h in history)),
                   "swapped_in": int(sum(h.get("swap/count", 0.0) for h in history)),
                   "final_version": int(history[-1].get("draft/version", 0)) if history else 0,
                   "swap_ms_per_step": [h.get("swap/ms") for h in history]}
    trl_t = step_times(trainer)
    e = {"trl_step_s": mean(trl_t[1:] or trl_t),  # TRL's step_time: generation + forward/backward
         "sync_s": mean([h["stage/sync_s"] for h in history[1:] or history]),  # weights into the engine
         "adapt_s": mean([h["stage/adapt_s"] for h in history[1:] or history]),  # draftadapt's round
         "gen_s": mean([h["stage/gen_s"] for h in history[1:] or history])}
    e["rl_step_s"] = e["trl_step_s"] + e["sync_s"] + e["adapt_s"]
    s["end_to_end"] = {**e, "trl_step_time_s_per_step": trl_t, "averaged_over": "steps 2..N (step 1 pays warm-up)"}
    s["without_draftadapt"] = baselines
    if baselines:
        # the same steps of the draftadapt run (2..baseline_steps; step 1 pays warm-up everywhere)
        span = slice(1, cfg.baseline_steps) if cfg.baseline_steps > 1 else slice(0, 1)
        m = {"steps": f"{span.start + 1}..{max(span.start + 1, span.stop)}",
             "trl_step_s": mean(trl_t[span]),
             "rl_step_s": mean([t + h["stage/sync_s"] + h["stage/adapt_s"] for t, h in zip(trl_t[span], history[span])])}
        for name, b in baselines.items():
            m[f"trl_step_s_{name}"] = b["mean_step_time_s"]
            m[f"trl_step_speedup_over_{name}"] = b["mean_step_time_s"] / m["trl_step_s"]
            m[f"rl_step_speedup_over_{name}"] = b["mean_step_time_s"] / m["rl_step_s"]
        s["end_to_end"]["matched_steps"] = m
    fa, aa = s["arms"]["frozen"]["last_third_acceptance"], s["arms"]["adapted"]["last_third_acceptance"]
    s["last_third"] = {"adapted_over_frozen_acceptance": aa / fa}
    s["whole_run"] = whole_run(s["arms"]["adapted"]["acceptance_length_per_step"],
                               s["arms"]["frozen"]["acceptance_length_per_step"],
                               [h.get("adapt/published", 0.0) > 0 for h in history])
    s["tensorboard"] = sorted(str(p) for p in (out / "trl").rglob("events.out.tfevents.*"))
    s["total_seconds"] = time.perf_counter() - t_run
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    line = {"world": cfg.world, "steps": n, "adapted_over_frozen_acceptance": round(aa / fa, 3),
            "frozen_last_third": round(fa, 3), "adapted_last_third": round(aa, 3),
            **{k: round(v, 3) for k, v in s["whole_run"].items() if k in ("adapted_worst_over_start", "adapted_retention")},
            "k_policy": s["k_policy"], "drafter_idle_steps": int(sum(s.get("online_k", {}).get("drafter_idle_per_step", []))),
            "drafts_published": s["drafts"]["published"], "drafts_swapped_in": s["drafts"]["swapped_in"],
            "trl_step_s": round(e["trl_step_s"], 2), "rl_step_s": round(e["rl_step_s"], 2),
            **{k: round(v, 3) for k, v in s["end_to_end"].get("matched_steps", {}).items() if k.startswith("rl_step_speedup")},
            **{f"trl_step_s_{k}": round(v["mean_step_time_s"], 2) for k, v in baselines.items()},
            "out": str(out)}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
