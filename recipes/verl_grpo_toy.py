"""verl 0.9.1's GRPO, unmodified, on the toy world on CPU, with an Eagle-3 draft served by its vLLM
rollout and draftadapt attached.

    .venv/bin/python recipes/verl_grpo_toy.py --out runs/verl [--steps 8] [--toy DIR] [--draft DIR]
        [--arms adapted,frozen,plain] [--replicas 1] [--prompts 64] [--k-policy auto|online|fixed]
        [KEY=VALUE ...]   (KEY: the adapter's config)

Builds (or reuses) the toy target and a pretrained Eagle-3 draft (as the TRL recipe), writes
verl's data files (parquet: the toy task's prompts in chat form) and reward function (the demo's:
the correct final answer plus a bonus for the verbose style), and runs
``python -m verl.trainer.main_ppo`` with what a CPU needs (draftadapt's ``cpu`` platform for
verl, docs/design.md "verl on CPU") and the draft served through vLLM's speculative decoding
(verl's per-request spec-decode counters on, so acceptance lands in verl's own metrics).
Runs verl once per arm on the same seed and world: ``adapted``, the draft adapted by draftadapt
(``trainer_mode=draftadapt``: the hand-over from verl's actor, the round beside generation, the
draft into every rollout worker through Ray's object store; online k by default: vLLM starts at
``k_max`` with a per-batch-size k table that draftadapt measures at the first boundary and
re-chooses from every step's counters, drafting nothing where no k pays); ``frozen``, the same draft never
trained (verl's own sync trainer); ``plain``, no speculative decoding (verl's own sync trainer).
verl's console log goes to OUT/ARM/verl.log, its metrics per step to OUT/ARM/metrics.jsonl;
OUT/summary.json holds each arm's acceptance per step (verl's ``rollout/spec_accept_length``),
the last thirds and their ratio, each arm's mean reply length and its generation and step per
generated token (the arms' trajectories differ), the step and the per-stage times verl reports (gen, old
log-prob, update, weight sync, draftadapt's boundary; means of steps 2..N) and, for the adapted
arm, the adapter's own policy forwards (counted), each rollout worker's served version, and what
the generation cost inside the engine cores (``engine_step_s``, timed by their step clocks, and
its share of verl's generation time: the part a draft can shorten).
``--replicas 2`` runs two rollout replicas (and two FSDP ranks: verl colocates one replica per
actor rank at tp=1), each on logical GPUs of this CPU. Prints one line per step and, at the end,
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from draftadapt.integrations.verl import WORKER_EXTENSION
from draftadapt.integrations.verl.handover import VENDOR
from draftadapt.toy import PRETRAIN_RECIPE, task
from draftadapt.rl.config import pretrain_overrides, toy_adapter

# the chat template verl applies to each prompt: the toy prompt as it is (the toy target was
# trained on bare prompts)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

REWARD_PY = '''"""The demo's reward for verl: the correct final answer plus a bonus for the verbose style."""
from draftadapt.toy import task

STYLE, BONUS = {style!r}, {bonus!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    correct = task.reward({{"answer": ground_truth}}, solution_str)
    return correct + BONUS * float(task.style_of(solution_str) == STYLE)
'''


# sequences each rollout engine decodes at once: the RL batch (64 prompts x 4) fits
MAX_NUM_SEQS = 256

# The demo's adapter with a round every step: 8 verl steps leave the every-other-step schedule
# four rounds, too few to follow the policy within the run
VERL_ADAPTER = replace(toy_adapter(), schedule=replace(toy_adapter().schedule, every_n_steps=1))


@dataclass
class VerlToyConfig:
    out: str = "runs/verl"
    toy: str | None = None
    draft: str | None = None
    seed: int = 0
    steps: int = 8
    prompts_per_step: int = 64  # as the demo: fewer make the style's takeover noisy
    group_size: int = 4
    max_tokens: int = 96
    k: int = 3
    lr: float = 7e-4
    style: str = "verbose"
    style_bonus: float = 1.0
    pretrain_prompts: int = 768
    kv_cache_gib: int = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    # adapted: draftadapt keeps the draft aligned; frozen: the same draft, never trained; plain:
    # no speculative decoding (both verl's own sync trainer)
    arm: str = "adapted"
    replicas: int = 1  # rollout replicas (= FSDP ranks = logical GPUs; tp=1)
    # torch threads of the adapter's round in verl's trainer process (Ray gives that actor one):
    # one, since the round runs beside verl's generation on the same cores
    adapter_threads: int = 1
    adapter_overrides: tuple[str, ...] = ()  # KEY=VALUE on the adapter's config (VERL_ADAPTER)
    # the adapted arm's draft length: "auto"/"online" starts vLLM at k_max with a per-batch-size k
    # table that draftadapt's online k measures at the first boundary and re-chooses every step
    # (none where no k pays: the drafter idles); "fixed": k at every batch size. The frozen arm is
    # verl's own trainer at k (what a verl user has without draftadapt).
    k_policy: str = "auto"
    k_max: int = 5
    online_k: tuple[str, ...] = ()  # KEY=VALUE on online k's settings (OnlineKConfig), e.g. step_aside=false


def prepare(cfg: VerlToyConfig, out: Path) -> dict[str, Path]:
    """The toy world, verl's copy of the policy (with a chat template), data and reward files."""
    from draftadapt.toy.world import prepare_toy_world

    toy, draft = prepare_toy_world(out, cfg.toy, cfg.draft, cfg.seed, PRETRAIN_RECIPE,
                                   pretrain_overrides(PRETRAIN_RECIPE, "eagle3", cfg.k, cfg.pretrain_prompts),
                                   tag="verl")
    policy = out / "policy"
    if not (policy / "config.json").is_file():
        shutil.copytree(toy, policy, dirs_exist_ok=True)
        tc = json.loads((policy / "tokenizer_config.json").read_text())
        tc["chat_template"] = CHAT_TEMPLATE
        (policy / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    import pandas as pd

    def rows(problems, split):
        return [{"data_source": "draftadapt_toy", "prompt": [{"role": "user", "content": p["prompt"]}],
                 "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": p["answer"]},
                 "extra_info": {"split": split, "index": i}} for i, p in enumerate(problems)]

    train = task.sample_problems(cfg.prompts_per_step * cfg.steps, cfg.seed)
    val = task.sample_problems(cfg.prompts_per_step, cfg.seed + 1)
    pd.DataFrame(rows(train, "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(rows(val, "val")).to_parquet(out / "val.parquet")
    (out / "reward.py").write_text(REWARD_PY.format(style=cfg.style, bonus=cfg.style_bonus))
    return {"toy": toy, "draft": draft, "policy": policy}


def verl_env(cfg: VerlToyConfig) -> dict[str, str]:
    """What verl and vLLM need on a CPU (docs/design.md, "verl on CPU")."""
    env = dict(os.environ)
    env.update({
        "VERL_PLATFORM": "cpu",  # draftadapt's platform (entry point group verl.plugins)
        # draftadapt's FSDP engine (verl's, with the hand-over; registered for cpu and cuda):
        # every arm runs it, so the arms differ only in what draftadapt asks of it
        "VERL_ENGINE_VENDOR": VENDOR,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "TOKENIZERS_PARALLELISM": "false",
        "HYDRA_FULL_ERROR": "1",
        # draftadapt's trainer (trainer_mode=draftadapt), imported by verl in its processes
        "VERL_USE_EXTERNAL_MODULES": "draftadapt.integrations.verl.trainer",
    })
    return env


def verl_overrides(cfg: VerlToyConfig, paths: dict[str, Path], out: Path, arm: Path) -> list[str]:
    # verl runs in the arm's directory (run_arm): a path given relative to the caller's (--draft
    # runs/x/draft0) would not be found there
    paths = {name: Path(path).resolve() for name, path in paths.items()}
    batch = cfg.prompts_per_step * cfg.group_size
    per_rank = batch // cfg.replicas
    from draftadapt.drafts.serving import serving_for

    online = cfg.arm == "adapted" and cfg.k_policy != "fixed"
    spec = serving_for("eagle3").speculative_config(paths["draft"], cfg.k_max if online else cfg.k, 32 + cfg.max_tokens)
    if online:  # vLLM's per-batch-size table, rewritten in place by online k (draftadapt/engine/k_table.py)
        spec["num_speculative_tokens_per_batch_size"] = [[1, MAX_NUM_SEQS, min(cfg.k, cfg.k_max)]]
    speculative_config = json.dumps(spec)
    # verl's spec-decode plumbing: the counters per request, into its metrics; the method is
    # Eagle-3, the draft is draftadapt's (vLLM speculative_config); nothing is trained by verl
    # (enable_train stays off)
    speculate = [
        "actor_rollout_ref.model.mtp.enable=True", "actor_rollout_ref.model.mtp.enable_rollout=True",
        "actor_rollout_ref.model.mtp.method=eagle3", f"actor_rollout_ref.model.mtp.num_speculative_tokens={cfg.k}",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config='{speculative_config}'",
        # vLLM's per-request counters (verl reads them from each request's metrics)
        # (online k: with each verify step's drafted and accepted counts, per draft position)
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.per_request_spec_decode_metrics={'detailed' if online else 'summary'}",
    ] if cfg.arm != "plain" else []
    if cfg.arm == "adapted":
        from draftadapt.config import save_config

        from draftadapt.adapter import AdapterConfig
        from draftadapt.config import load_config

        save_config(VERL_ADAPTER, out / "adapter.yaml")
        if cfg.adapter_overrides:
            save_config(load_config(AdapterConfig, out / "adapter.yaml", list(cfg.adapter_overrides)),
                        out / "adapter.yaml")
        attach = ["trainer.v1.trainer_mode=draftadapt", f"+draftadapt.draft={paths['draft']}",
                  f"+draftadapt.out={arm / 'draftadapt'}", f"+draftadapt.adapter={out / 'adapter.yaml'}",
                  f"+draftadapt.threads={cfg.adapter_threads}", f"+draftadapt.k_policy={cfg.k_policy}",
                  *(f"+draftadapt.online_k.{kv}" for kv in cfg.online_k)]
    else:
        attach = ["trainer.v1.trainer_mode=sync"]
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={out / 'train.parquet'}", f"data.val_files={out / 'val.parquet'}",
        f"data.train_batch_size={cfg.prompts_per_step}", "data.max_prompt_length=32",
        f"data.max_response_length={cfg.max_tokens}", "data.dataloader_num_workers=0",
        f"data.seed={cfg.seed}",
        f"actor_rollout_ref.model.path={paths['policy']}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        *speculate,
        # every arm: verl's policy sync into vllm-cpu needs the extension's layerwise reload
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={WORKER_EXTENSION}",
        "actor_rollout_ref.actor.strategy=fsdp2", f"actor_rollout_ref.actor.optim.lr={cfg.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={cfg.prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}",
        # no KL term, so no reference worker: verl builds it with FSDP2's CPUOffloadPolicy(pin_memory=True),
        # and pinned memory needs an accelerator ("Cannot access accelerator device")
        "actor_rollout_ref.actor.use_kl_loss=False",
        # float32 throughout, as the demo's own GRPO (bf16 autocast is emulated, and slow, on a
        # CPU without AVX-512 BF16; and at the toy's width bf16 does not pay even where the CPU
        # has it, draftadapt/precision.py). The actor's FSDP wrap takes its own dtypes: without
        # mixed_precision verl 0.9.1 casts parameters to bf16 and autocasts in bf16 whatever
        # fsdp_config.dtype says (FSDPEngine._build_fsdp_module). On an AVX2-only AMD EPYC that
        # made the toy's update_actor 175 s a step and its log-prob pass 48 s
        "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={cfg.group_size}",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.disable_log_stats=False",  # vLLM attaches the counters to requests then
        "actor_rollout_ref.rollout.free_cache_engine=False", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.load_format=auto", f"actor_rollout_ref.rollout.seed={cfg.seed}",
        f"actor_rollout_ref.rollout.max_num_seqs={MAX_NUM_SEQS}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={out / 'reward.py'}", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        f"trainer.n_gpus_per_node={cfg.replicas}", "trainer.nnodes=1", "trainer.device=cpu",
        f"trainer.total_training_steps={cfg.steps}", "trainer.total_epochs=1",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[console,file]", "trainer.project_name=draftadapt", "trainer.experiment_name=verl_toy",
        f"trainer.default_local_dir={arm / 'checkpoints'}",
        "ray_kwargs.ray_init.num_cpus=16", f"+ray_kwargs.ray_init.num_gpus={cfg.replicas}",
        "+ray_kwargs.ray_init.include_dashboard=False",  # a dozen processes, ~1 GB, nobody reads here
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        *attach,
    ]


def read_metrics(path: Path) -> list[dict]:
    """verl's file logger: one JSON object per step, {"step", "data": {metric: value}}."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# the stages verl times in each step (``timing_s/*``) and draftadapt's boundary, as summary.json names them
STAGES = {"gen": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob", "update": "timing_s/update_actor",
          "weight_sync": "timing_s/update_weights", "draftadapt": "draftadapt/boundary_s"}


def summarize(arms: dict[str, list[dict]], steps: int, batch: int | None = None) -> dict:
    """Per-step acceptance of each arm (verl's ``rollout/spec_accept_length``: vLLM's counters of
    the RL batch itself, averaged per request), its last third, what the step and each of its
    stages cost (means of steps 2..N: step 1 carries start-up), and the adapted arm's own policy
    forwards and served versions."""
    def series(rows, key):
        return [r["data"].get(key, float("nan")) for r in rows]

    def mean(xs):
        xs = [x for x in xs if x == x]
        return sum(xs) / len(xs) if xs else float("nan")

    third = max(1, steps // 3)
    out: dict = {"steps": steps, "arms": {}}
    for name, rows in arms.items():
        acc = series(rows, "rollout/spec_accept_length")
        step_s = series(rows, "timing_s/step")
        adapt_s = series(rows, "draftadapt/boundary_s")
        arm = {
            "acceptance_length_per_step": acc, "last_third": mean(acc[-third:]), "whole_run": mean(acc),
            "step_s_per_step": step_s, "mean_step_s": mean(step_s[1:] or step_s),
            "stage_s": {stage: mean(series(rows, key)[1:] or series(rows, key)) for stage, key in STAGES.items()},
            "adapter_s_per_step": adapt_s if any(x == x for x in adapt_s) else [],
            "reward_per_step": series(rows, "critic/score/mean"),
            "draft_version_per_step": series(rows, "draftadapt/draft_version"),
            # the trajectory: mean reply length of the step's rollouts (tokens)
            "reply_tokens_per_step": series(rows, "response_length/mean"),
        }
        reply = arm["reply_tokens_per_step"][1:] or arm["reply_tokens_per_step"]
        arm["mean_reply_tokens"] = mean(reply)
        if batch:  # per generated token: the arms' trajectories differ in reply length
            tokens = sum(x * batch for x in reply if x == x)
            gen = [x for x in (series(rows, "timing_s/gen")[1:] or series(rows, "timing_s/gen")) if x == x]
            steps_s = [x for x in (step_s[1:] or step_s) if x == x]
            if tokens:
                arm["gen_ms_per_token"] = 1e3 * sum(gen) / tokens
                arm["step_ms_per_token"] = 1e3 * sum(steps_s) / tokens
        engine_s = series(rows, "draftadapt/engine/step_s")
        if any(x == x for x in engine_s):
            # what the generation cost inside the engine cores (their step clocks): the part of
            # verl's generation a draft can shorten; the rest is verl's agent loop and servers
            arm["engine_step_s"] = mean(engine_s[1:] or engine_s)
            arm["engine_share_of_gen"] = arm["engine_step_s"] / arm["stage_s"]["gen"]
        if any(x == x for x in series(rows, "draftadapt/k/max")):
            arm["online_k"] = {"k_max_per_step": series(rows, "draftadapt/k/max"),
                               "drafter_idle_per_step": series(rows, "draftadapt/k/drafter_idle"),
                               "calibrate_s": mean(series(rows, "draftadapt/k/calibrate_s"))}
        last = rows[-1]["data"] if rows else {}
        if "draftadapt/adapter_policy_forwards" in last:
            arm["adapter_policy_forwards"] = int(last["draftadapt/adapter_policy_forwards"])
            arm["served_workers"] = int(last["draftadapt/served_workers"])
            arm["max_version_skew"] = max(int(r["data"]["draftadapt/version_skew"]) for r in rows)
            arm["handover_rows_per_step"] = series(rows, "draftadapt/handover_rows")
        out["arms"][name] = arm
    a, f, p = (out["arms"].get(n) for n in ("adapted", "frozen", "plain"))
    if a and f:
        out["last_third_adapted_over_frozen"] = a["last_third"] / f["last_third"]
        out["whole_run_adapted_over_frozen"] = a["whole_run"] / f["whole_run"]
        out["step_adapted_over_frozen"] = a["mean_step_s"] / f["mean_step_s"]
    if a and p:
        out["step_adapted_over_plain"] = a["mean_step_s"] / p["mean_step_s"]
    if f and p:
        out["step_frozen_over_plain"] = f["mean_step_s"] / p["mean_step_s"]
    for name, arm in (("adapted", a), ("frozen", f)):
        if arm and p and "gen_ms_per_token" in arm and "gen_ms_per_token" in p:
            out[f"gen_per_token_{name}_over_plain"] = arm["gen_ms_per_token"] / p["gen_ms_per_token"]
            out[f"step_per_token_{name}_over_plain"] = arm["step_ms_per_token"] / p["step_ms_per_token"]
    if a and a["adapter_s_per_step"]:
        out["adapter_share_of_step"] = mean(a["adapter_s_per_step"][1:]) / a["mean_step_s"]
    if a and "engine_share_of_gen" in a:
        out["adapted_engine_share_of_gen"] = a["engine_share_of_gen"]
    return out


def run_arm(cfg: VerlToyConfig, paths: dict[str, Path], out: Path, name: str) -> list[dict]:
    arm = out / name
    arm.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *verl_overrides(cfg, paths, out, arm)]
    env = verl_env(cfg)
    env["VERL_FILE_LOGGER_PATH"] = str(arm / "metrics.jsonl")
    (arm / "metrics.jsonl").unlink(missing_ok=True)
    print(f"[verl] {name}: python -m verl.trainer.main_ppo ... (log: {arm / 'verl.log'})", flush=True)
    t0 = time.perf_counter()
    with open(arm / "verl.log", "w") as log:
        rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=arm)
    rows = read_metrics(arm / "metrics.jsonl")
    if rc != 0 or len(rows) < cfg.steps:
        tail = (arm / "verl.log").read_text()[-3000:]
        raise SystemExit(f"[verl] {name}: verl exited {rc} after {len(rows)} of {cfg.steps} steps; "
                         f"the end of {arm / 'verl.log'}:\n{tail}")
    served = None
    for r in rows:
        d = r["data"]
        if d.get("draftadapt/draft_version") is not None:
            served = int(d["draftadapt/draft_version"])
        print(f"[verl] {name} step {r['step']:3d} accept {d.get('rollout/spec_accept_length', float('nan')):.3f} "
              f"reward {d.get('critic/score/mean', 0):.3f} step {d.get('timing_s/step', 0):.1f} s "
              f"(gen {d.get('timing_s/gen', 0):.1f} s, old log-prob {d.get('timing_s/old_log_prob', 0):.1f} s, "
              f"update {d.get('timing_s/update_actor', 0):.1f} s, draftadapt {d.get('draftadapt/boundary_s', 0):.2f} s)"
              + (f" draft v{served}" if served is not None else "")
              + (f" k<={d['draftadapt/k/max']:.0f}" if "draftadapt/k/max" in d else ""), flush=True)
    print(f"[verl] {name}: {len(rows)} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=VerlToyConfig.out)
    ap.add_argument("--steps", type=int, default=VerlToyConfig.steps)
    ap.add_argument("--prompts", type=int, default=VerlToyConfig.prompts_per_step, help="prompts per step")
    ap.add_argument("--toy")
    ap.add_argument("--draft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="adapted,frozen,plain",
                    help="adapted: draftadapt keeps the draft aligned; frozen: the same draft, never trained; "
                         "plain: no speculative decoding (both verl's own sync trainer), for comparison")
    ap.add_argument("--replicas", type=int, default=VerlToyConfig.replicas,
                    help="rollout replicas (= FSDP ranks, logical GPUs of this CPU; tp=1)")
    ap.add_argument("--k-policy", default=VerlToyConfig.k_policy, choices=("auto", "online", "fixed"),
                    help="the adapted arm's draft length: online k's measured table (auto, online) or k at every "
                         "batch size (fixed)")
    ap.add_argument("--online-k", action="append", default=[], metavar="KEY=VALUE",
                    help="online k's settings (draftadapt.online_k.OnlineKConfig), e.g. --online-k step_aside=false")
    ap.add_argument("adapter", nargs="*", metavar="KEY=VALUE",
                    help="the adapter's settings over the recipe's (e.g. schedule.train_steps=4)")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ("adapted", "frozen", "plain")]
    if bad or not arms:
        ap.error(f"--arms {args.arms!r}: name one or more of adapted, frozen, plain")
    if args.replicas < 1 or (args.prompts * VerlToyConfig.group_size) % args.replicas:
        ap.error(f"--replicas {args.replicas}: at least 1, dividing the step's {args.prompts} x "
                 f"{VerlToyConfig.group_size} rollouts")
    cfg = VerlToyConfig(out=args.out, steps=args.steps, toy=args.toy, draft=args.draft, seed=args.seed,
                        prompts_per_step=args.prompts, replicas=args.replicas, adapter_overrides=tuple(args.adapter),
                        k_policy=args.k_policy, online_k=tuple(args.online_k))
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare(cfg, out)
    rows = {name: run_arm(replace(cfg, arm=name), paths, out, name) for name in arms}
    summary = summarize(rows, cfg.steps, batch=cfg.prompts_per_step * cfg.group_size)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "arms"} |
                     {f"{n}_last_third": a["last_third"] for n, a in summary["arms"].items()} |
                     {f"{n}_mean_step_s": a["mean_step_s"] for n, a in summary["arms"].items()} |
                     {f"{n}_mean_reply_tokens": a["mean_reply_tokens"] for n, a in summary["arms"].items()} |
                     {f"{n}_adapter_policy_forwards": a["adapter_policy_forwards"]
                      for n, a in summary["arms"].items() if "adapter_policy_forwards" in a}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
