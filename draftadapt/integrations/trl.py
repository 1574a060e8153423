"""draftadapt inside TRL's GRPOTrainer: speculative rollouts from our vLLM engine, and a draft
kept aligned with the policy while TRL trains it. What a TRL GRPO script adds:

    from draftadapt.integrations.trl import SpeculativeRollouts
    rollouts = SpeculativeRollouts(policy_dir, draft_dir, out_dir="runs/drafts")
    trainer = GRPOTrainer(model=policy_dir, reward_funcs=..., train_dataset=...,
                          args=GRPOConfig(..., use_vllm=False), rollout_func=rollouts)
    trainer.train()
    rollouts.close()

TRL 1.16 calls ``rollout_func(prompts, trainer)`` once per generation batch, with each prompt
already repeated ``num_generations`` times (one completion is returned per prompt received), and
starts no engine of its own with ``use_vllm=False``. On its first call this object attaches
itself to the trainer (:meth:`SpeculativeRollouts.attach`):

- sampling follows the trainer: ``temperature``, ``top_p``, ``max_completion_length``; settings
  the engine does not apply (top_k, min_p, repetition_penalty, generation_kwargs) are refused;
- after every optimizer step (a ``TrainerCallback``'s ``on_step_end``) the trainer's weights are
  loaded into the engine in place, the adapter observes the batch TRL just trained on and runs
  its round (train, validate, publish), and a better draft is swapped in;
- the adapter's targets come from TRL's own forward (docs/design.md, "TRL integration"): forward
  hooks on the aux layers and on the decoder's output; TRL computes its log-probs without
  materialising logits, so the adapter projects the final hidden states through the LM head
  (one [tokens, H] x [H, V] product, no second pass of the decoder);
- acceptance length, per-position acceptance, draft version, swap ms and the adapter's time go
  into the trainer's logs (``report_to="tensorboard"`` shows them), summed over each logging
  window and divided once.

``draft_dir=None`` serves the policy without speculation and without an adapter (the baseline
a user has with vLLM rollouts alone).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from draftadapt.boundary import StepBoundary
from draftadapt.config import ConfigError, pass_down

# transformers (and torch) load when a SpeculativeRollouts is made, not with this module: the
# package promises lazy imports of the frameworks it attaches to (tests/unit/test_imports.py).


def _unwrap(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class SpeculativeRollouts:
    """A TRL ``rollout_func`` backed by :class:`~draftadapt.engine.rollout.RolloutEngine`, with
    :class:`~draftadapt.adapter.DraftAdapter` keeping the draft aligned (see the module docstring).

    policy_dir: the HF model directory TRL's policy starts from (the engine serves it, the adapter
    loads its own copy); draft_dir: an Eagle-3 head or draft LM for it (None: no speculation);
    out_dir: where the adapter publishes draft versions; adapter_cfg: the adapter's settings (an
    AdapterConfig; its method, k and temperature are passed down from ``method``, ``k`` and the
    trainer's GRPOConfig.temperature: leave them unset there, a different value is a ConfigError);
    engine_kwargs: more RolloutEngine arguments (max_model_len, max_num_seqs, kv_cache_gib, threads,
    ...); check_integrity: read the draft's fingerprint back after every weight sync and repair a
    lost draft (a sampled pass over the draft's weights; False skips it); k_policy: "online" starts
    the engine at ``online_k.k_max`` with a per-batch-size k table, measures its step costs on the
    first batch's prompts and re-chooses the table after every generation from the batch's own
    acceptance counters, 0 where no k pays: then the drafter idles, the adapter trains nothing
    and its simulated acceptance says when a draft would pay again (docs/design.md, "Online k"
    and "Stepping aside"); "fixed" drafts ``k`` at every batch size; "auto" (the default) is
    online wherever there is a draft; engine_precision: the engine's weights, "auto" (bf16 on a CPU
    with AMX-BF16 or avx512_bf16 for a model at least 512 wide, else the model's own dtype), "bf16" or "fp32"
    (draftadapt/precision.py; a ``dtype`` in engine_kwargs wins).
    """

    def __init__(self, policy_dir: str | Path, draft_dir: str | Path | None, out_dir: str | Path = "runs/drafts",
                 adapter_cfg=None, method: str = "eagle3", k: int = 3, adapt: bool = True,
                 engine_kwargs: dict[str, Any] | None = None, check_integrity: bool = True,
                 k_policy: str = "auto", online_k=None, engine_precision: str = "auto"):
        from draftadapt.engine.rollout import RolloutEngine
        from draftadapt.online_k import OnlineKConfig
        from draftadapt.precision import engine_dtype

        self.policy_dir = Path(policy_dir)
        self.draft_dir = None if draft_dir is None else Path(draft_dir)
        self.out_dir = Path(out_dir)
        self.method, self.k = method, k
        self.adapt = adapt and draft_dir is not None
        self.check_integrity = check_integrity
        if self.adapt:  # a clash is refused before the engine starts (the temperature's, when attached)
            from draftadapt.adapter import AdapterConfig

            adapter_cfg = pass_down(adapter_cfg or AdapterConfig(), "adapter_cfg",
                                    method=("SpeculativeRollouts.method", method), k=("SpeculativeRollouts.k", k))
        self._adapter_cfg = adapter_cfg
        # log-probs of the distribution sampled from (after temperature and top_p), as TRL's own
        # recomputation divides by its temperature: raw ones would differ at any T != 1
        engine_kwargs = {"logprobs_mode": "processed_logprobs", **(engine_kwargs or {})}
        if k_policy not in ("auto", "online", "fixed"):
            raise ConfigError(f"k_policy={k_policy!r}: choose 'auto', 'online' or 'fixed'")
        self.online_cfg = online_k or OnlineKConfig()
        self.online_cfg.validate()
        online = k_policy == "online" or (k_policy == "auto" and self.draft_dir is not None)
        if online:  # the table starts at k; the calibration re-chooses it on the first batch
            max_seqs = engine_kwargs.setdefault("max_num_seqs", 64)
            engine_kwargs["k_schedule"] = [(1, max_seqs, min(k, self.online_cfg.k_max))]
        try:
            engine_kwargs.setdefault("dtype", engine_dtype(engine_precision, self.policy_dir))
        except ValueError as exc:
            raise ConfigError(f"SpeculativeRollouts: {exc}") from None
        self.engine = RolloutEngine(self.policy_dir, self.draft_dir, method=method,
                                    num_speculative_tokens=self.online_cfg.k_max if online else k, **engine_kwargs)
        self.online = online
        self.online_k = None  # the OnlineK, once calibrated
        self.adapter = None
        self.trainer = None
        self._hooks: list = []
        self._handover = None  # the hand-over of the batch being trained on
        self._batch: list | None = None  # its rollouts, and their token sequences -> rollout indices
        self._keys: dict[tuple[int, ...], list[int]] = {}
        self._batch_version = 0
        self._synced_step: int | None = None
        self._rng = random.Random(0)
        self._window = _Window()
        self._boundary = StepBoundary(None, self.engine)  # the adapter joins in attach()
        self.history: list[dict[str, float]] = []  # one row per optimizer step (what was logged)

    # ------------------------------------------------------------------ TRL's entry point

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        self.attach(trainer)
        if self._synced_step != trainer.state.global_step:  # also without the callback's step end
            self._sync(trainer)
        texts = [self._as_text(p, trainer) for p in prompts]
        if self.online and self.online_k is None:
            self._calibrate(texts, trainer)
        if self.online_k is not None:  # whether this generation runs with no draft at all
            self._window.last["k/drafter_idle"] = float(self.engine.drafter_idle)
        t0 = time.perf_counter()
        res = self.engine.generate(
            texts, temperature=trainer.temperature, top_p=trainer.top_p, max_tokens=trainer.max_completion_length,
            seed=self._rng.randrange(1 << 30), logprobs=True)
        self._window.gen_s += time.perf_counter() - t0
        self._window.acceptance = self._window.acceptance + res.acceptance
        self._window.tokens += res.num_tokens
        self._boundary.report(res.acceptance)  # the live draft, measured on the RL batch (drift trigger)
        if self.online_k is not None:  # the same free counters re-choose the table for what follows
            self._window.last.update(self.online_k.update(self.engine, res.acceptance))
        self._start_batch(res.rollouts, trainer.state.global_step)
        return {"prompt_ids": [rollout.prompt_token_ids for rollout in res.rollouts],
                "completion_ids": [rollout.token_ids for rollout in res.rollouts],
                "logprobs": [rollout.logprobs for rollout in res.rollouts]}

    def attach(self, trainer) -> None:
        """Check the trainer's settings, start the adapter, hook the policy, add the callback.
        Idempotent; called by the first rollout."""
        if self.trainer is trainer:
            return
        if self.trainer is not None:
            raise RuntimeError("this SpeculativeRollouts is attached to another trainer; make one per trainer")
        args = trainer.args
        if getattr(args, "use_vllm", False):
            raise ConfigError("GRPOConfig(use_vllm=True) starts TRL's own vLLM engine; pass use_vllm=False "
                              "with rollout_func=SpeculativeRollouts(...)")
        unsupported = {"top_k": (args.top_k, (0, -1, None)), "min_p": (args.min_p, (None, 0.0)),
                       "repetition_penalty": (args.repetition_penalty, (1.0,)),
                       "generation_kwargs": (args.generation_kwargs, (None, {}))}
        bad = {k: v for k, (v, ok) in unsupported.items() if v not in ok}
        if bad:
            raise ConfigError(f"GRPOConfig sets {bad}, which draftadapt's engine does not apply; it samples with "
                              "temperature, top_p and max_completion_length only: leave these at their defaults")
        self.trainer = trainer
        self._rng = random.Random(args.seed)
        if self.adapt:
            from draftadapt.adapter import DraftAdapter

            cfg = pass_down(self._adapter_cfg, "adapter_cfg",
                            temperature=("GRPOConfig.temperature", float(trainer.temperature)))
            self.adapter = DraftAdapter(self.policy_dir, self.draft_dir, self.out_dir, cfg)
            self._hook_policy(_unwrap(trainer))
        self._boundary = StepBoundary(self.adapter, self.engine)
        # First in line: on_log must add our numbers before TensorBoard's callback writes the row.
        trainer.callback_handler.callbacks.insert(0, _callback(self))

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._handover is not None:
            self._handover.__exit__(None, None, None)
            self._handover = None
        self.engine.close()

    # ------------------------------------------------------------------ the step boundary

    def _sync(self, trainer) -> None:
        """New weights into the engine; the adapter learns from the batch just trained on (the
        step boundary, :class:`~draftadapt.boundary.StepBoundary`, in its one order)."""
        step = trainer.state.global_step
        t0 = time.perf_counter()
        weights = {k: v.detach() for k, v in _unwrap(trainer).state_dict().items()}
        self._synced_step = step
        rollouts = ho = None
        # whether the adapter is paused (no batch size drafts) was planned when the batch's
        # hand-over began (StepBoundary.plan: then it kept the held-out rollouts, or none)
        if self.adapter is not None and self._batch is not None:
            rollouts, ho, self._handover = self._batch, self._handover, None
            if ho is not None:
                ho.__exit__(None, None, None)
                wanted = len(self._batch) if ho.subset is None else len(ho.subset)
                kept = sorted(ho.rows)  # rollouts TRL's forward covered (a masked-out one is not)
                self._window.add("adapt/handover_missed", float(wanted - len(kept)))
                rollouts, ho = [self._batch[i] for i in kept], ho.keep(kept)
            self._window.add("adapt/handover_rows", float(0 if ho is None else len(ho.rows)))
            self._batch, self._keys = None, {}
        b = self._boundary.after_update(rollouts, sampled_version=self._batch_version, weights=weights,
                                        version=step, handover=ho, integrity=self.check_integrity)
        self._window.sync_s += time.perf_counter() - t0 - b.adapter_s
        if rollouts is None:
            return
        self._follow_draft(b)
        for name, v in b.metrics.items():
            if name == "adapt/watch_share":  # a share of the run so far: the newest holds
                self._window.last[name] = v
            elif name.startswith(("adapt/", "train/", "accept/simulated", "draft/integrity")):
                self._window.add(name, v)
        self._window.swaps.extend(s.ms for s in b.swaps)
        self._window.adapt_s += b.adapter_s + (0.0 if ho is None else ho.seconds)

    def _calibrate(self, texts: list[str], trainer) -> None:
        """Online k: the engine's step costs at every k, measured on this first batch's prompts
        (``OnlineK.calibrate``); its time counts as generation (the user's step pays it)."""
        from draftadapt.online_k import OnlineK, schedule_text

        self.online_k = OnlineK.calibrate(self.engine, texts, self.online_cfg, float(trainer.temperature),
                                          int(trainer.args.seed), rl_batch=len(texts))
        self._window.gen_s += self.online_k.calibrate_s
        self._window.last["k/calibrate_s"] = self.online_k.calibrate_s
        print(f"[draftadapt] online k: step costs measured in {self.online_k.calibrate_s:.1f} s, k table "
              f"{schedule_text(self.engine.k_schedule)} (batch sizes:k)", flush=True)

    def _follow_draft(self, b) -> None:
        """Online k after a boundary: a new draft starts from the acceptance its adapter simulated;
        while the drafter idles, the simulated acceptance of the draft it would serve says when a
        draft pays again."""
        if self.online_k is None or self.adapter is None:
            return
        k = self.adapter.cfg.k
        sim = self.adapter.simulated_length(b.swap.version) if b.swap is not None else None
        if sim is not None:
            self._window.last.update(self.online_k.new_draft(self.engine, sim, k))
        elif self._boundary.paused and "accept/simulated_live" in b.metrics:
            self._window.last.update(self.online_k.simulated(self.engine, b.metrics["accept/simulated_live"], k))

    def _start_batch(self, rollouts: list, version: int) -> None:
        """Hand-over for this generation batch: TRL's next forwards over it feed the adapter."""
        if self.adapter is None:
            return
        if self._handover is not None:  # generated again with no step between (e.g. an eval pass)
            self._handover.__exit__(None, None, None)
        self._batch, self._batch_version = rollouts, version
        self._keys = {}
        for i, rollout in enumerate(rollouts):
            self._keys.setdefault((*rollout.prompt_token_ids, *rollout.token_ids), []).append(i)
        # paused (no batch size drafts): only the rollouts the simulated acceptance scores are
        # handed over, on the steps the paused adapter's watch affords, and the adapter trains on
        # none of them (docs/design.md, "Stepping aside")
        subset = self._boundary.plan(self.online_k, self.engine, rollouts, version)
        self._handover = (self.adapter.handover(_unwrap(self.trainer), subset).__enter__()
                          if self._boundary.hands_over else None)

    def _hook_policy(self, model) -> None:
        """A hook on the decoder's output (input ids, mask, final hidden states): every forward of
        the policy over a rollout of the current batch hands that rollout's states over, once."""
        import torch

        decoder = model.get_decoder()
        head = model.get_output_embeddings()
        cfg = model.config.get_text_config()
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
            raise ConfigError(f"{type(model).__name__} scales or caps its logits; the hand-over projects hidden "
                              "states through the LM head only. Use SpeculativeRollouts(adapt=False) with it")

        def hook(_module, _args, kwargs, output):
            ho = self._handover
            ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
            if ho is None or ids is None or mask is None:
                return
            keep = None if ho.subset is None else set(ho.subset)
            index, rows = [], []
            for r in range(ids.shape[0]):
                for i in self._keys.get(tuple(ids[r][mask[r].bool()].tolist()), ()):
                    if i not in ho.rows and (keep is None or i in keep):
                        index.append(i)
                        rows.append(r)
            if not rows:  # a forward over rollouts already handed over, not chosen, or not ours
                return
            # TRL's own forward projects only the completions' last positions: the output head over
            # every token is the hand-over's, run on the rows it keeps only, and counted as its cost
            t0 = time.perf_counter()
            fwd = sorted(set(rows))
            hidden = output.last_hidden_state.detach()
            with torch.no_grad():
                logits = head((hidden if len(fwd) == ids.shape[0] else hidden[fwd]).to(head.weight.dtype))
            ho.seconds += time.perf_counter() - t0
            at = {r: j for j, r in enumerate(fwd)}
            ho.add(index, logits, mask[fwd], rows=[at[r] for r in rows], forward_rows=fwd)

        self._hooks.append(decoder.register_forward_hook(hook, with_kwargs=True))

    @staticmethod
    def _as_text(prompt, trainer) -> str:
        if isinstance(prompt, str):
            return prompt
        # conversational: the trainer's own chat template, as TRL renders it for its generation
        return trainer.processing_class.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                            **(trainer.chat_template_kwargs or {}))

    # ------------------------------------------------------------------ metrics

    def _log_row(self, step: int) -> dict[str, float]:
        """The window's metrics (sums divided once), then a fresh window."""
        w, self._window = self._window, _Window()
        row: dict[str, float] = {"stage/gen_s": w.gen_s, "stage/sync_s": w.sync_s, "stage/adapt_s": w.adapt_s}
        if w.acceptance.drafts:
            row["accept/length"] = w.acceptance.length
            row.update({f"accept/pos_{i}": r for i, r in enumerate(w.acceptance.per_position)})
        if self.engine.draft_version is not None:
            row["draft/version"] = float(self.engine.draft_version)
        if w.swaps:
            row["swap/ms"] = sum(w.swaps) / len(w.swaps)
            row["swap/count"] = float(len(w.swaps))
        row.update(w.sums)
        row.update(w.last)
        self.history.append({"step": float(step), **row})
        return row


class _Window:
    """What happened since the last log line: counts and seconds, summed."""

    def __init__(self):
        from draftadapt.metrics.acceptance import AcceptanceStats

        self.acceptance = AcceptanceStats()
        self.tokens = 0
        self.gen_s = self.sync_s = self.adapt_s = 0.0
        self.swaps: list[float] = []
        self.sums: dict[str, float] = {}
        self.last: dict[str, float] = {}  # the newest value (the k table's figures)

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)


def _callback(rollouts: SpeculativeRollouts):
    """The trainer callback. Step end: weights to the engine, the adapter's round, the swap. Log:
    our metrics join the row."""
    from transformers import TrainerCallback

    class _Callback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rollouts.trainer is not None and rollouts._synced_step != state.global_step:
                rollouts._sync(rollouts.trainer)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None and "loss" in logs:  # training rows only (not the run's final summary)
                logs.update(rollouts._log_row(state.global_step))

    return _Callback()
