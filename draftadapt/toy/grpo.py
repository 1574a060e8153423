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
import gc
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from draftadapt.adapter import AdapterConfig, DraftAdapter, ScheduleConfig, ValidateConfig
from draftadapt.config import ConfigError, load_config, save_config
from draftadapt.data.sequences import Sequence, collate
from draftadapt.engine.rollout import DraftSwapError, RolloutEngine
from draftadapt.metrics.logger import make_logger
from draftadapt.toy import PRETRAIN_RECIPE, task


@dataclass
class GRPOConfig:
    # RL steps: the last third runs on the drifted policy, where a frozen draft stays low and an
    # adapted one has had time to catch up (docs/design.md, "The demo's RL settings")
    steps: int = 18
    # distinct problems per step; fewer made the gradient too noisy to move the style without
    # wrecking the arithmetic
    prompts_per_step: int = 64
    group_size: int = 4  # samples per problem (GRPO group)
    max_tokens: int = 96  # response budget
    temperature: float = 1.0
    # policy learning rate, reached after warmup_steps: the highest that kept the arithmetic on
    # every seed tried
    lr: float = 7e-4
    warmup_steps: int = 3  # linear warmup: Adam's first, sign-like step at full rate cost half the accuracy
    kl_coef: float = 0.1  # KL(policy || initial policy) per token (k3 estimator), as in GRPO
    # Reward = correct final answer + style_bonus if the completion uses `style`: the toy target
    # rarely writes verbose (toy build's SFT stage), so the bonus drifts the policy away from what
    # its pretrained draft has seen.
    style: str = "verbose"
    style_bonus: float = 1.0
    micro_batch: int = 32  # sequences per forward/backward in the update (gradients accumulate)

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, (step + 1) / (self.warmup_steps + 1))


@dataclass
class EvalConfig:
    prompts: int = 32  # held-out prompts every arm generates on, every step
    max_tokens: int = 96
    seed: int = 1234


def toy_adapter() -> AdapterConfig:
    """The adapter the toy world's RL runs attach (this demo and recipes/trl_grpo_toy.py).

    A round every other RL step: 8 optimizer steps of 16 sequences, the TTT steps >= 1 at a
    quarter of the positions, 32 held-out rollouts to decide the publish (docs/design.md,
    "Adapter cost"; chosen from the replay table in the README). The validation gate turns down
    the early candidates, while the draft is still current, that come out worse than it.
    """
    return AdapterConfig(
        recency_decay=0.25,  # the newest rollouts weigh most: the policy moves fast here
        schedule=ScheduleConfig(every_n_steps=2, drift_fraction=0.0, train_steps=8),
        validation=ValidateConfig(max_heldout=32),
        train=replace(AdapterConfig().train, lr=2e-3, batch_size=16, ttt_slots=0.25))


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    toy: str | None = None  # reuse a built toy target (default: OUT/toy, built once)
    draft: str | None = None  # reuse a pretrained draft (default: OUT/draft0, pretrained once)
    seed: int = 0
    # "eagle3": an Eagle-3 head; "mtp": MTP layers of a toy built with `toy build --mtp 1`, served
    # with vLLM's method="mtp". Either draft is pretrained on the toy's own samples by
    # pretrain_recipe (method= set to this), as is the fresh one (docs/design.md, "MTP")
    method: str = "eagle3"
    k: int = 3
    engine_threads: int = 2
    # how the initial and the fresh reference drafts are pretrained (package data: the demo runs
    # from any directory)
    pretrain_recipe: str = str(PRETRAIN_RECIPE)
    # Prompts those drafts are pretrained on (0 = the recipe's data.num_prompts): few enough that
    # the draft has seen little of the style RL drifts to (docs/design.md, "The toy world's
    # proportions").
    pretrain_prompts: int = 768
    # At the end, pretrain a fresh draft from scratch on the final policy (same recipe) and measure
    # it on the same prompts: the reference the adapted draft is held to (issue 4's 95% bar).
    fresh_final: bool = True
    fresh_max_minutes: float = 2.5  # training-time guard of that pretrain
    # Also write every step's rollouts and the policy after it into this spool directory
    # (draftadapt.spool.SpoolWriter): a recorded run to replay adapter configs on offline
    # (scripts/replay_adapter.py) or to feed a sidecar. ~20 MB of policy weights per step here.
    spool: str | None = None
    # false: the same RL loop with no speculation and no draftadapt (plain vLLM rollouts): the
    # baseline a user has today. Its summary's end_to_end is what baseline= compares against.
    spec: bool = True
    baseline: str | None = None  # a finished spec=false run's OUT: the summary gains the speedup over it
    # At the last step, also measure the arms at the RL batch (every rollout prompt of that step):
    # on CPU the speedup falls with the batch size, so the small eval set flatters it.
    rl_batch_arms: bool = True
    # Run each adaptation round in a background thread beside the next step's generation and
    # policy update (DraftAdapter.start_step / finish_step) instead of between steps. It is swapped
    # in one step later; what it costs is the slower generation and update plus any wait for it.
    adapter_background: bool = False
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    adapter: AdapterConfig = field(default_factory=toy_adapter)


def token_logprobs(model, batch: dict, handover=None, index=None) -> torch.Tensor:
    """log p_model(token u+1 | tokens <= u) for every slot: [B, T-1]. With a draftadapt
    ``handover`` the forward's aux states and logits are also handed to the adapter (rows
    ``index`` of the step's rollouts): the adapter then runs no forward of its own."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if handover is not None:
        handover.add(index, logits, batch["attention_mask"])
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    return logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def kl_to_reference(lp: torch.Tensor, ref_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens of the k3 estimator of KL(policy || reference), from the sampled
    tokens' log-probabilities under each; differentiable in ``lp``."""
    d = ref_lp - lp  # log(ref / policy) per token
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()


def grpo_update(policy, reference, opt, problems, rollouts, cfg: GRPOConfig, pad_id: int, step: int,
                handover=None) -> dict:
    """One on-policy GRPO step: group-normalised advantages, REINFORCE on the sampled tokens
    (length-normalised per sequence), plus a per-token KL penalty to the initial policy.
    ``handover``: draftadapt's HandOver, fed from this update's own forward (no second pass)."""
    rewards = []
    for prob, r in zip(problems, rollouts):
        rew = task.reward(prob, r.text)
        if cfg.style_bonus and task.style_of(r.text) == cfg.style:
            rew += cfg.style_bonus
        rewards.append(rew)
    R = torch.tensor(rewards).view(-1, cfg.group_size)  # [P, G]
    adv = ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-4)).view(-1)
    seqs = [Sequence(list(r.prompt_token_ids), list(r.token_ids)) for r in rollouts]
    n = len(seqs)
    n_tokens = sum(len(s.ids) - len(s.prompt_ids) for s in seqs)  # response tokens, for the KL mean
    policy.train()
    for g in opt.param_groups:
        g["lr"] = cfg.lr_at(step)
    opt.zero_grad(set_to_none=True)
    # Length-sorted micro-batches: the same loss and gradient as one padded batch (each term is a
    # sum over sequences scaled by the whole batch's counts), without padding every sequence to
    # the longest response of the step (verbose answers are ~2x the terse ones).
    order = sorted(range(n), key=lambda i: len(seqs[i].ids))
    pg_sum = kl_sum = 0.0
    for lo in range(0, n, cfg.micro_batch):
        idx = order[lo: lo + cfg.micro_batch]
        batch = collate([seqs[i] for i in idx], pad_id)
        mask = batch["loss_mask"][:, :-1].float()  # slots whose next token is a response token
        lp = token_logprobs(policy, batch, handover, idx)
        pg = -(adv[idx] * (lp * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n
        loss = pg
        if cfg.kl_coef and mask.sum() > 0:
            with torch.no_grad():
                ref_lp = token_logprobs(reference, batch)
            kl = kl_to_reference(lp, ref_lp, mask) * mask.sum() / max(n_tokens, 1)
            loss = loss + cfg.kl_coef * kl
            kl_sum += float(kl.detach())
        loss.backward()
        pg_sum += float(pg.detach())
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    policy.eval()
    correct = [task.reward(p, r.text) for p, r in zip(problems, rollouts)]
    styled = [task.style_of(r.text) == cfg.style for r in rollouts]
    return {"rl/reward": float(R.mean()), "rl/accuracy": sum(correct) / len(correct),
            "rl/style_frac": sum(styled) / len(styled), "rl/loss": pg_sum + cfg.kl_coef * kl_sum, "rl/kl": kl_sum}


def pretrain_overrides(cfg: DemoConfig) -> list[str]:
    return [f"data.num_prompts={cfg.pretrain_prompts}"] if cfg.pretrain_prompts else []


def prepare_world(cfg, out: Path) -> tuple[Path, Path]:
    """The toy target and a draft pretrained on it (built once; reused from OUT on a rerun)."""
    from draftadapt.pretrain import prepare_toy_world

    return prepare_toy_world(out, cfg.toy, cfg.draft, cfg.seed, cfg.pretrain_recipe, pretrain_overrides(cfg), tag="demo",
                             method=cfg.method)


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
           "acceptance_length": res.spec.acceptance_length,  # nan without speculation
           "per_position": res.spec.per_position_rate}
    return out


def measure_arms(plain: RolloutEngine, spec: RolloutEngine, draft0: Path, prompts: list[str], cfg: DemoConfig,
                 step: int, max_tokens: int | None = None) -> tuple[dict, dict, dict]:
    """No speculation, the frozen draft, the adapted draft: same prompts, same policy. The order
    flips every step (plain first, then last), so a slow drift of this machine's speed does not
    favour one arm's tokens/s."""
    if step % 2 == 0:
        m_plain = measure(plain, prompts, cfg, max_tokens)
        m_frozen = measure_draft(spec, draft0, prompts, cfg, max_tokens)
        m_adapted = measure(spec, prompts, cfg, max_tokens)
    else:
        m_adapted = measure(spec, prompts, cfg, max_tokens)
        m_frozen = measure_draft(spec, draft0, prompts, cfg, max_tokens)
        m_plain = measure(plain, prompts, cfg, max_tokens)
    return m_plain, m_frozen, m_adapted


def measure_draft(spec: RolloutEngine, draft: Path, prompts: list[str], cfg: DemoConfig,
                  max_tokens: int | None = None) -> dict:
    """Measure another draft in the running engine: swap it in, generate, swap the live one back."""
    live = spec.draft_dir
    spec.swap_draft(draft)
    try:
        return measure(spec, prompts, cfg, max_tokens)
    finally:
        spec.swap_draft(live)


def run(cfg: DemoConfig) -> dict:
    t_run = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    baseline = load_baseline(cfg.baseline) if cfg.baseline else None
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
    if cfg.spec:
        adapter = DraftAdapter(toy, draft0, out / "drafts", replace(cfg.adapter, method=cfg.method))
        spec = RolloutEngine(toy, draft0, method=cfg.method, num_speculative_tokens=cfg.k,
                             threads=cfg.engine_threads, seed=cfg.seed)
    plain = RolloutEngine(toy, None, threads=cfg.engine_threads, seed=cfg.seed)
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
    history: list[dict] = []
    arms = {"plain": [], "frozen": [], "adapted": []} if cfg.spec else {"plain": []}
    rl_batch = None
    t_start = time.perf_counter()
    round_due = False  # adapter_background: a round to start before the next generation

    try:
        for step in range(cfg.grpo.steps):
            row: dict = {"step": step}
            # 1. rollouts (with spec: from the live adapted draft; speculation changes nothing they contain)
            problems = [p for p in task.sample_problems(cfg.grpo.prompts_per_step, rng.randrange(1 << 30))
                        for _ in range(cfg.grpo.group_size)]
            if round_due:  # background rounds: the one for the previous step's rollouts runs from here
                adapter.start_step()
                round_due = False
            t0 = time.perf_counter()
            gen = rollout_engine.generate([p["prompt"] for p in problems], temperature=cfg.grpo.temperature,
                                          max_tokens=cfg.grpo.max_tokens, seed=rng.randrange(1 << 30))
            row["stage/gen_s"] = time.perf_counter() - t0
            row["tps/rl_batch"] = gen.tokens_per_s
            if adapter is not None and gen.spec.drafts:
                # what the engine measured for the live draft on the RL batch itself: free, and
                # what feeds the adapter's drift trigger (the eval arms below are not the step's)
                adapter.report_measured(gen.spec.length)
                row["accept/rl_batch_length"] = gen.spec.length
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
            rollout_engine.update_policy(weights, version=version)
            handover_s = ho.seconds if ho is not None else 0.0
            row["stage/train_s"] = time.perf_counter() - t0 - handover_s
            t_measure = time.perf_counter()
            if spec is not None:
                plain.update_policy(weights, version=version)  # the no-speculation arm only
            if spool is not None:
                spool.write_policy(version, weights, step=step)
            row["stage/measure_s"] = time.perf_counter() - t_measure
            # 3. draftadapt, through its public API only
            if adapter is not None:
                t0 = time.perf_counter()
                if cfg.adapter_background:
                    row.update(adapter.finish_step())  # waits for the round if it is not done yet
                    swap = adapter.swap(spec)
                row["draft/integrity_ok"] = float(adapter.check_integrity(spec))
                adapter.observe(gen.rollouts, policy_version=version - 1, handover=ho)
                adapter.update_policy(weights, version=version)
                if cfg.adapter_background:
                    round_due = True
                else:
                    row.update(adapter.step())
                    swap = adapter.swap(spec)
                if swap is not None:
                    row["swap/ms"] = swap.ms
                row["stage/adapt_s"] = time.perf_counter() - t0 + handover_s
                row["adapt/handover_s"] = handover_s
                row["draft/version"] = float(spec.draft_version or 0)
            else:
                row["stage/adapt_s"] = 0.0
            row["stage/rl_step_s"] = row["stage/gen_s"] + row["stage/train_s"] + row["stage/adapt_s"]
            # 4. the arms on the same prompts, same policy (outside the RL step's time)
            t_measure = time.perf_counter()
            last = step == cfg.grpo.steps - 1
            if spec is not None:
                m_plain, m_frozen, m_adapted = measure_arms(plain, spec, draft0, eval_prompts, cfg, step)
                for name, m in (("plain", m_plain), ("frozen", m_frozen), ("adapted", m_adapted)):
                    arms[name].append(m)
                row.update({
                    "accept/length": m_adapted["acceptance_length"],
                    "accept/frozen_length": m_frozen["acceptance_length"],
                    **{f"accept/pos_{i}": r for i, r in enumerate(m_adapted["per_position"])},
                    "tps/plain": m_plain["tokens_per_s"], "tps/frozen": m_frozen["tokens_per_s"],
                    "tps/adapted": m_adapted["tokens_per_s"],
                    "draft/age_policy_versions": float(version - adapter.store.latest().policy_version),
                })
                if last and cfg.rl_batch_arms:
                    rl_batch = measure_arms(plain, spec, draft0, [p["prompt"] for p in problems], cfg, step,
                                            max_tokens=cfg.grpo.max_tokens)
            else:
                m_plain = measure(plain, eval_prompts, cfg)
                arms["plain"].append(m_plain)
                row["tps/plain"] = m_plain["tokens_per_s"]
            row["stage/measure_s"] += time.perf_counter() - t_measure
            logger.log_dict({k: v for k, v in row.items() if isinstance(v, float)}, step=version)
            history.append(row)
            accept = (f"accept frozen {row['accept/frozen_length']:.2f} adapted {row['accept/length']:.2f} | "
                      if spec is not None else "no speculation | ")
            print(f"[demo] step {step + 1:3d}/{cfg.grpo.steps} reward {row['rl/reward']:.3f} "
                  f"acc {row['rl/accuracy']:.2f} style {row['rl/style_frac']:.2f} | {accept}"
                  f"RL step {row['stage/rl_step_s']:.1f} s (gen {row['stage/gen_s']:.1f} train "
                  f"{row['stage/train_s']:.1f} adapt {row['stage/adapt_s']:.2f})"
                  + (f" | draft v{int(row['draft/version'])}" if spec is not None else ""), flush=True)
        loop_seconds = time.perf_counter() - t_start
        if spool is not None:
            spool.finish(steps=len(history))
        save_policy(policy, toy, out / "final_policy")
        fresh = measure_fresh(cfg, out, spec, eval_prompts) if cfg.fresh_final and history and spec else None
    finally:
        if adapter is not None:
            adapter.close()  # a background round still open is finished, not abandoned mid-write
        for engine in (spec, plain):
            if engine is not None:
                engine.close()
        logger.close()

    summary = summarize(cfg, history, arms, loop_seconds, fresh, rl_batch, baseline)
    summary["total_seconds"] = time.perf_counter() - t_run  # world setup + RL loop + fresh reference
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if spec is not None:
        plot(history, out / "acceptance.png")
    return summary


def load_baseline(path: str) -> dict:
    """A finished ``spec=false`` run's end_to_end (checked before the run starts, not after)."""
    f = Path(path) / "summary.json"
    if not f.is_file():
        raise ConfigError(f"baseline={path}: no summary.json there; pass the OUT of a finished "
                          "`draftadapt demo spec=false` run")
    s = json.loads(f.read_text())
    if s.get("spec", True) or "end_to_end" not in s:
        raise ConfigError(f"baseline={path} is not a spec=false run (its summary has spec={s.get('spec')}); "
                          "run `draftadapt demo --out DIR spec=false` on the same world and seed")
    return s


def save_policy(policy, toy: Path, path: Path) -> None:
    """The final policy as a model dir transformers and vLLM load (tokenizer copied from the toy)."""
    import shutil

    from draftadapt.toy.mtp import carry_mtp_layers

    policy.save_pretrained(str(path), safe_serialization=True)
    carry_mtp_layers(toy, path)  # an MTP toy's final policy is an MTP target again (no-op otherwise)
    for f in toy.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("generation_config.json", "heldout.jsonl"):
            shutil.copy2(f, path / f.name)


def measure_fresh(cfg: DemoConfig, out: Path, spec: RolloutEngine, prompts: list[str]) -> dict:
    """Pretrain a draft from scratch on the final policy (the demo's recipe), swap it into the
    running engine (which serves the final policy) and measure it on the same prompts."""
    from draftadapt.pretrain import PretrainConfig, pretrain

    fresh_dir = out / "draft_fresh_final"
    print(f"[demo] pretraining a fresh draft on the final policy into {fresh_dir} (reference)", flush=True)
    t0 = time.perf_counter()
    # The pretrain's engine samples its data from torch's global generator, whose state here
    # depends on what ran before in this process (a world built in it or passed in: 3.04 against
    # 2.84 for the same seed-0 run). Seeded, the reference is the same either way.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        pretrain(load_config(PretrainConfig, cfg.pretrain_recipe, [
            f"target={out / 'final_policy'}", f"out={fresh_dir}", "build_toy=false",
            f"max_minutes={cfg.fresh_max_minutes}", f"method={cfg.method}",
            *pretrain_overrides(cfg)]))
    seconds = time.perf_counter() - t0
    try:
        m = measure_draft(spec, fresh_dir, prompts, cfg)
    except DraftSwapError:  # a user's draft= of another architecture: serve the fresh one apart
        engine = RolloutEngine(out / "final_policy", fresh_dir, method=cfg.method, num_speculative_tokens=cfg.k,
                               threads=cfg.engine_threads, seed=cfg.seed)
        try:
            m = measure(engine, prompts, cfg)
        finally:
            engine.close()
    m_adapted = measure(spec, prompts, cfg)
    return {"acceptance_length": m["acceptance_length"], "per_position": m["per_position"],
            "tokens_per_s": m["tokens_per_s"], "adapted_final_acceptance": m_adapted["acceptance_length"],
            "pretrain_seconds": seconds}


def throughput(ms: list[dict]) -> float:
    seconds = sum(m["seconds"] for m in ms)
    return sum(m["tokens"] for m in ms) / seconds if seconds > 0 else float("nan")


def end_to_end(history: list[dict]) -> dict:
    """Means per RL step of what the user's RL step pays (measurement arms excluded)."""
    n = max(1, len(history))
    e = {key: sum(h[f"stage/{key}"] for h in history) / n for key in ("rl_step_s", "gen_s", "train_s", "adapt_s")}
    e["gen_share"] = e["gen_s"] / e["rl_step_s"] if e["rl_step_s"] > 0 else float("nan")
    e["rl_step_without_adapter_s"] = e["gen_s"] + e["train_s"]
    e["adapt_share"] = e["adapt_s"] / e["rl_step_s"] if e["rl_step_s"] > 0 else float("nan")
    return e


def summarize(cfg: DemoConfig, history: list[dict], arms: dict, seconds: float, fresh: dict | None = None,
              rl_batch: tuple[dict, dict, dict] | None = None, baseline: dict | None = None) -> dict:
    n = len(history)
    last = max(1, n // 3)

    def mean(xs):
        xs = [x for x in xs if x == x]  # drop nan (a step where nothing was drafted)
        return sum(xs) / len(xs) if xs else float("nan")

    s = {"steps": n, "seconds": seconds, "spec": cfg.spec, "reward_per_step": [h["rl/reward"] for h in history],
         "accuracy_per_step": [h["rl/accuracy"] for h in history], "arms": {},
         "end_to_end": end_to_end(history),
         "arms_measured_at": f"{cfg.eval.prompts} eval prompts every step"}
    for name, ms in arms.items():
        s["arms"][name] = {
            "acceptance_length_per_step": [m.get("acceptance_length") for m in ms],
            "mean_tokens_per_s": throughput(ms),
            "last_third_acceptance": mean([m["acceptance_length"] for m in ms[-last:]]) if name != "plain" else None,
            # throughput: all tokens over all seconds (a mean of per-step rates over-weights
            # the short, noisy timings of this 2-core machine)
            "last_third_tokens_per_s": throughput(ms[-last:]),
        }
    if rl_batch is not None:
        p, f, a = rl_batch
        s["rl_batch_arms"] = {
            "measured_at": f"the last step's {cfg.grpo.prompts_per_step * cfg.grpo.group_size} rollout prompts "
                           f"(the RL batch), final policy",
            **{name: {"tokens_per_s": m["tokens_per_s"], "acceptance_length": m["acceptance_length"]}
               for name, m in (("plain", p), ("frozen", f), ("adapted", a))},
            "adapted_over_plain_tokens_per_s": a["tokens_per_s"] / p["tokens_per_s"],
            "frozen_over_plain_tokens_per_s": f["tokens_per_s"] / p["tokens_per_s"],
        }
    if baseline is not None:
        b = baseline["end_to_end"]
        e = s["end_to_end"]
        s["vs_baseline"] = {
            "baseline_rl_step_s": b["rl_step_s"],
            "rl_step_speedup": b["rl_step_s"] / e["rl_step_s"],  # >= 1: the RL run is faster with draftadapt
            "rl_step_speedup_without_adapter": b["rl_step_s"] / e["rl_step_without_adapter_s"],
            "gen_speedup": b["gen_s"] / e["gen_s"],
        }
    if not cfg.spec:
        return s
    a, f, p = s["arms"]["adapted"], s["arms"]["frozen"], s["arms"]["plain"]
    s["last_third"] = {
        "adapted_over_frozen_acceptance": a["last_third_acceptance"] / f["last_third_acceptance"],
        "adapted_over_plain_tokens_per_s": a["last_third_tokens_per_s"] / p["last_third_tokens_per_s"],
    }
    if fresh is not None:
        s["fresh_final"] = fresh
        s["last_third"]["adapted_over_fresh_final_acceptance"] = a["last_third_acceptance"] / fresh["acceptance_length"]
        s["adapted_final_over_fresh_final_acceptance"] = fresh["adapted_final_acceptance"] / fresh["acceptance_length"]
    return s


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] + 1 for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [h["accept/length"] for h in history], "o-", label="adapted draft")
    ax[0].plot(steps, [h["accept/frozen_length"] for h in history], "s-", label="frozen pretrained draft")
    ax[0].axhline(1.0, color="gray", ls=":", label="no speculation")
    ax[0].set_xlabel("RL step")
    ax[0].set_ylabel("acceptance length (k=3, measured in vLLM)")
    ax[0].legend()
    ax[1].plot(steps, [h["rl/reward"] for h in history], "o-", color="C2")
    ax[1].set_xlabel("RL step")
    ax[1].set_ylabel("mean reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def demo_cli(overrides: list[str]) -> int:
    """``draftadapt demo``: ``overrides`` are DemoConfig's ``key=value`` (the command's flags
    arrive as their fields: --steps as grpo.steps). A bad key or baseline= raises ConfigError
    before anything starts."""
    cfg = load_config(DemoConfig, None, overrides)
    if cfg.baseline:
        load_baseline(cfg.baseline)
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
            "rl_step_s": round(e["rl_step_s"], 2), "adapt_share": round(e["adapt_share"], 4),
            "gen_share": round(e["gen_share"], 3)}
    if "rl_batch_arms" in summary:
        line["rl_batch_adapted_over_plain_tokens_per_s"] = round(summary["rl_batch_arms"]["adapted_over_plain_tokens_per_s"], 3)
    if "vs_baseline" in summary:
        line.update({k: round(v, 3) for k, v in summary["vs_baseline"].items() if k != "baseline_rl_step_s"})
    line["out"] = cfg.out
    print(json.dumps(line))
    return 0

