"""verl's synchronous PPO trainer with draftadapt at its step boundary (``trainer.v1.trainer_mode=draftadapt``).

verl imports this module in each of its processes when ``VERL_USE_EXTERNAL_MODULES`` names it
(``verl/__init__.py``); it registers the trainer under "draftadapt" and draftadapt's FSDP engine
in verl's engine registry (:mod:`~draftadapt.integrations.verl.engine`). The trainer is verl's own
``PPOTrainerSync``; six of its hooks gain draftadapt's part:

- ``prepare_step``: the adapter's round left due by the last boundary starts (a thread of this
  process) just before verl submits the step's prompts, so it trains while verl generates
  (``StepBoundary(background=True)``, the default; ``+draftadapt.background=false``: the round
  runs at the boundary);
- ``_submit_batch_to_rollout``: with online k, the first step's prompts calibrate the k table
  on the servers before they generate;
- ``_compute_old_log_prob``: the adapter's request rides in the batch's ``extra_info``; verl's
  actor keeps the aux states and log-probs of its own log-prob forward for the rows asked for
  and puts them in Ray's object store (the hand-over); the references are taken from every actor
  worker here;
- ``_update_actor``: the batch's (prompt, response) token ids, which the handed-over rows are
  matched against;
- ``on_step_end``: after verl's weight sync to every rollout replica (its own code), the step
  boundary (:class:`~draftadapt.boundary.StepBoundary`, its one order): the round started beside
  this step's generation collected and its draft swapped into every worker of every replica
  (:class:`~draftadapt.integrations.verl.rollout.VerlEngines`, drafts through Ray's object store),
  the live draft's integrity read back, and this step's hand-over observed;
- ``_consume_sync_metrics``: the boundary's metrics (``draftadapt/*``: the round, the swap, each
  worker's served version and their skew, the adapter's own policy forwards) join verl's step row.

With the hand-over the adapter runs no policy forward and its policy copy takes no weights
(only what the draft shares with the policy, the embeddings, comes with the hand-over). When
verl's actor hands nothing over (``+draftadapt.handover=false``, verl's bypass mode without a
log-prob pass, another engine than draftadapt's) the fallback is the policy tap: replica 0's first
worker writes each policy verl's sync brings to ``OUT/policy_tap.safetensors`` for the adapter's
copy, which then forwards itself (one node or a shared filesystem); the log says so.

Importing it also bridges vLLM 0.32's per-request speculative counters to where verl 0.9.1 reads
them (:func:`~draftadapt.integrations.verl.cpu.bridge_spec_stats`), so ``rollout/spec_accept_length``
is in verl's metrics with or without draftadapt's trainer.

Settings, from verl's config: ``+draftadapt.draft=DIR`` (the draft vLLM was started with, also
given as ``engine_kwargs.vllm.speculative_config``), ``+draftadapt.out=DIR`` (the adapter's
draft store), ``+draftadapt.adapter=YAML`` (an AdapterConfig; optional), ``+draftadapt.adapt=false``
(the frozen draft: nothing trained, for comparison runs), ``+draftadapt.threads=N`` (torch threads
for the adapter's round: verl's trainer process is a Ray actor of one CPU, so Ray gives it
``OMP_NUM_THREADS=1``), ``+draftadapt.handover_rows=N`` (rollouts a step hands over, spread over
the actor's data-parallel ranks; default all), ``+draftadapt.background=false``; and verl's
rollout started with draftadapt's worker extension
(``+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=``
:data:`~draftadapt.integrations.verl.WORKER_EXTENSION`), which the swaps run in.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

# first: verl imports this module (VERL_USE_EXTERNAL_MODULES) before its entry-point plugins, and
# what follows asks verl's platform registry for the device at import
from draftadapt.integrations.verl import cpu as _cpu  # registers the cpu platform
from draftadapt.integrations.verl import engine as _engine  # registers the hand-over engine
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from draftadapt.integrations.verl import WORKER_EXTENSION
from draftadapt.integrations.verl.handover import REQUEST, VENDOR, HandOverRequest, gather, rows_per_rank

_cpu.bridge_spec_stats()  # vLLM 0.32's per-request counters where verl 0.9.1 reads them

log = logging.getLogger(__name__)

# inside +draftadapt.out, the fallback only: replica 0's first worker writes each policy verl's
# sync brings there (safetensors), the adapter's policy copy reads it
POLICY_TAP_FILE = "policy_tap.safetensors"


def handover_request(adapter, rows: int | None) -> HandOverRequest:
    """What verl's log-prob forward must keep for ``adapter``'s draft."""
    c = adapter.capture
    d2t = None if c.draft_to_target is None else [int(i) for i in c.draft_to_target.tolist()]
    return HandOverRequest(list(c.aux_layer_ids), d2t, float(c.temperature), adapter.cfg.handover_store,
                           rows_per_rank=rows, shared=list(adapter.method.shared_policy_modules(adapter.trainer.draft)))


@register_trainer("draftadapt")
class DraftAdaptPPOTrainer(PPOTrainerSync):
    """verl's PPOTrainerSync with draftadapt's step boundary (module docstring)."""

    def init(self):
        from draftadapt.adapter import AdapterConfig, DraftAdapter
        from draftadapt.boundary import StepBoundary
        from draftadapt.config import load_config, pass_down
        from draftadapt.integrations.verl.rollout import VerlEngines

        da = self._da_settings()  # before verl starts its workers: a missing setting fails in seconds
        super().init()
        self._da_out = Path(da["out"])
        self._da_out.mkdir(parents=True, exist_ok=True)
        mtp = self.config.actor_rollout_ref.model.mtp
        cfg = load_config(AdapterConfig, da.get("adapter"))
        cfg = pass_down(cfg, "draftadapt.adapter", method=("actor_rollout_ref.model.mtp.method", mtp.method),
                        k=("actor_rollout_ref.model.mtp.num_speculative_tokens", int(mtp.num_speculative_tokens)),
                        temperature=("actor_rollout_ref.rollout.temperature",
                                     float(self.config.actor_rollout_ref.rollout.temperature)))
        policy = self.config.actor_rollout_ref.model.path
        self._da_adapt = bool(da.get("adapt", True))
        if da.get("threads"):
            import torch

            torch.set_num_threads(int(da["threads"]))
        adapter = DraftAdapter(policy, da["draft"], self._da_out / "drafts", cfg) if self._da_adapt else None
        self._da_engines = VerlEngines(self.checkpoint_manager)
        self._da_boundary = StepBoundary(adapter, self._da_engines,
                                         background=self._da_adapt and bool(da.get("background", True)))
        self._da_request = None
        if self._da_adapt and da.get("handover", True):
            from draftadapt.config import ConfigError

            if cfg.handover_store != "logp":
                raise ConfigError(f"+draftadapt.adapter: handover_store={cfg.handover_store!r}; the hand-over from "
                                  "verl's FSDP actor keeps log-probs (the output head it would read is sharded): "
                                  "set handover_store=logp")
            dp = len(self.actor_rollout_wg.workers)  # FSDP: one data-parallel rank per actor worker
            self._da_request = handover_request(adapter, rows_per_rank(da.get("handover_rows"), dp))
        self._da_tap: Path | None = None
        if self._da_adapt and self._da_request is None:
            self._da_arm_tap("+draftadapt.handover=false")
        self._da_refs: list = []
        self._da_rollouts: list | None = None
        self._da_metrics: dict[str, float] = {}
        self._da_online = self._da_online_k(da)  # an OnlineKConfig, or None (fixed k)
        self._da_k = None  # the OnlineK, calibrated before the first step's generation

    def _da_settings(self) -> dict:
        """``+draftadapt.*`` from verl's config, checked: the draft, the store, and (the draft
        adapted) the worker extension the swaps run in and the engine the hand-over runs in."""
        import os

        from omegaconf import OmegaConf

        from draftadapt.config import ConfigError

        da = self.config.get("draftadapt") or {}
        if not da.get("draft") or not da.get("out"):
            raise ConfigError("trainer.v1.trainer_mode=draftadapt needs +draftadapt.draft=DIR (the draft vLLM "
                              "serves) and +draftadapt.out=DIR (where the adapter publishes drafts)")
        key = "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls"
        if da.get("adapt", True) and not OmegaConf.select(self.config, key):
            raise ConfigError(f"trainer.v1.trainer_mode=draftadapt swaps drafts through its vLLM worker extension, "
                              f"which verl's rollout does not load by default: pass +{key}={WORKER_EXTENSION}")
        if da.get("adapt", True) and da.get("handover", True) and os.environ.get("VERL_ENGINE_VENDOR") != VENDOR:
            raise ConfigError(f"trainer.v1.trainer_mode=draftadapt takes the draft's targets from verl's actor through "
                              f"draftadapt's FSDP engine, which verl picks with VERL_ENGINE_VENDOR={VENDOR} in its "
                              "environment; set it, or pass +draftadapt.handover=false (the adapter then forwards "
                              "its own policy copy, read from a file replica 0 writes)")
        return da

    def _da_online_k(self, da):
        """``+draftadapt.k_policy`` (auto, online, fixed) and ``+draftadapt.online_k`` (OnlineKConfig's
        fields): online k where the rollout's speculative_config starts vLLM with a per-batch-size
        k table (``num_speculative_tokens_per_batch_size``; "auto": only there). Online k reads
        each draft position's counters from vLLM's per-request record, kept at
        ``per_request_spec_decode_metrics=detailed``."""
        import json

        from omegaconf import OmegaConf

        from draftadapt.config import ConfigError, load_config
        from draftadapt.online_k import OnlineKConfig

        policy = str(da.get("k_policy", "auto"))
        if policy not in ("auto", "online", "fixed"):
            raise ConfigError(f"+draftadapt.k_policy={policy}: choose auto, online or fixed")
        vllm_kwargs = OmegaConf.select(self.config, "actor_rollout_ref.rollout.engine_kwargs.vllm") or {}
        spec = vllm_kwargs.get("speculative_config") or {}
        if isinstance(spec, str):
            spec = json.loads(spec)
        has_table = bool(dict(spec).get("num_speculative_tokens_per_batch_size"))
        if policy == "fixed" or (policy == "auto" and not has_table):
            if policy == "auto" and spec:
                log.info("draftadapt: fixed k (the rollout's speculative_config has no "
                         "num_speculative_tokens_per_batch_size; give it [[1, MAX_NUM_SEQS, K]] for online k)")
            return None
        key = "actor_rollout_ref.rollout.engine_kwargs.vllm"
        if not has_table:
            raise ConfigError(f"+draftadapt.k_policy=online needs vLLM started with a per-batch-size k table: "
                              f"give {key}.speculative_config num_speculative_tokens=K_MAX and "
                              "num_speculative_tokens_per_batch_size=[[1, MAX_NUM_SEQS, K]]")
        if vllm_kwargs.get("per_request_spec_decode_metrics") != "detailed":
            raise ConfigError(f"+draftadapt.k_policy={policy} reads each draft position's counters: pass "
                              f"+{key}.per_request_spec_decode_metrics=detailed (or +draftadapt.k_policy=fixed)")
        online = da.get("online_k") or {}
        overrides = [f"{k}={json.dumps(OmegaConf.to_container(v) if OmegaConf.is_config(v) else v)}"
                     for k, v in dict(online).items()]
        return load_config(OnlineKConfig, None, overrides)

    def _da_follow_k(self, res, m: dict) -> None:
        """Online k after the boundary (as the demo and the TRL recipe): a new draft starts from
        the acceptance its adapter simulated; while the drafter idles, the simulated acceptance of
        the draft it would serve says when a draft pays again."""
        adapter = self._da_boundary.adapter
        if self._da_k is None or adapter is None:
            return
        k = adapter.cfg.k
        sim = adapter.simulated_length(res.swap.version) if res.swap is not None else None
        if sim is not None:
            m.update(self._da_k.new_draft(self._da_engines, sim, k))
        elif self._da_boundary.paused and "accept/simulated_live" in res.metrics:
            m.update(self._da_k.simulated(self._da_engines, res.metrics["accept/simulated_live"], k))

    def _da_arm_tap(self, why: str) -> None:
        """The fallback (module docstring), said in the log."""
        self._da_tap = self._da_out / POLICY_TAP_FILE
        self._da_tap.unlink(missing_ok=True)  # an earlier run's policy is not this step's
        log.warning("draftadapt: no hand-over from verl's actor (%s): the adapter reads each policy from %s, "
                    "which replica 0 writes during verl's weight sync (one node or a shared filesystem), and "
                    "forwards its own copy", why, self._da_tap)
        self._da_engines.tap_policy(self._da_tap)

    def prepare_step(self) -> dict:
        # background: the round the last boundary left due trains while this step generates
        self._da_boundary.before_generate()
        return super().prepare_step()

    def _submit_batch_to_rollout(self, batch) -> int:
        # online k: the table is measured on the first step's own prompts before they generate, so
        # no step drafts at a k nothing measured (calibrated at the first boundary, as before
        # session 42, step 1 drafted a blind k=3: on verl's toy at 256 sequences a server on 2
        # cores a k=3 step cost 2.6 plain ones, docs/results.md "Online k in verl")
        if self._da_online is not None and self._da_k is None:
            prompts = self._da_prompt_ids(batch)
            if prompts:
                self._da_calibrate(prompts, len(prompts) * int(self.config.actor_rollout_ref.rollout.n))
        # the engines' step clocks from here: the boundary reads what this step's generation cost
        # inside the engines (the first call starts them; a calibration's steps are not the step's)
        self._da_engines.engine_steps()
        return super()._submit_batch_to_rollout(batch)

    def _da_prompt_ids(self, batch) -> list[list[int]]:
        """The batch's prompts as token ids, through the tokenizer's chat template with the data
        config's ``apply_chat_template_kwargs``, as verl's single-turn agent loop renders them
        (its multi-turn and multimodal paths may differ by a few tokens: the calibration
        times step costs and first acceptances, which a token or two of prompt does not move)."""
        from omegaconf import OmegaConf

        if "raw_prompt" not in batch.keys():
            return []
        kwargs = OmegaConf.select(self.config, "data.apply_chat_template_kwargs") or {}
        kwargs = OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else dict(kwargs)
        out = []
        for p in list(batch["raw_prompt"]):
            text = p if isinstance(p, str) else self.tokenizer.apply_chat_template(
                [dict(m) for m in p], add_generation_prompt=True, tokenize=False, **kwargs)
            out.append(self.tokenizer.encode(text, add_special_tokens=False))
        return out

    def _da_calibrate(self, prompts: list, sequences: int) -> None:
        """Online k's calibration on ``prompts`` (token ids) through the servers' own generate;
        ``sequences``: the step's rollouts, spread over the servers."""
        from draftadapt.online_k import OnlineK, schedule_text

        servers = max(1, len(self._da_engines.fleet.actors))
        rl_batch = -(-sequences // servers)  # the requests each server starts a step with
        rollout = self.config.actor_rollout_ref.rollout
        self._da_k = OnlineK.calibrate(self._da_engines, prompts, self._da_online, float(rollout.temperature),
                                       int(self.config.get("data", {}).get("seed", 0) or 0), rl_batch=rl_batch)
        log.warning("draftadapt: online k: step costs measured in %.1f s, k table %s (batch sizes:k)",
                    self._da_k.calibrate_s, schedule_text(self._da_engines.k_schedule))

    def _compute_old_log_prob(self, batch, metrics: dict):
        if self._da_request is None:
            return super()._compute_old_log_prob(batch, metrics)
        from draftadapt.integrations.verl.engine import take_handed_over

        req = HandOverRequest.from_dict({**self._da_request.to_dict(), "seed": self.global_steps})
        batch.extra_info[REQUEST] = req.to_dict()
        try:
            out = super()._compute_old_log_prob(batch, metrics)
        finally:
            batch.extra_info.pop(REQUEST, None)
        if out is not batch:
            out.extra_info.pop(REQUEST, None)  # the update's batch must not ask again
        taken = ray.get([w.__ray_call__.remote(take_handed_over) for w in self.actor_rollout_wg.workers])
        self._da_refs = [ref for refs in taken for ref in refs]
        return out

    def _update_actor(self, batch, metrics: dict):
        if self._da_adapt or (self._da_online is not None and self._da_k is None):  # online k calibrates on them
            import transfer_queue as tq

            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=["prompts", "responses", "response_mask"])
            keep = [not t.get("is_padding", False) for t in batch.tags]
            rows = []
            for i, (p, r, m) in enumerate(zip(data["prompts"].unbind(), data["responses"].unbind(),
                                               data["response_mask"].unbind())):
                if keep[i]:
                    n = int(m.sum())  # the response's own tokens (a multi-turn mask would differ)
                    rows.append((p.tolist(), r[:n].tolist()))
            self._da_rollouts = rows
        return super()._update_actor(batch, metrics)

    def on_step_end(self):
        if self._da_adapt and self._da_rollouts is not None and not self._da_refs and self._da_tap is None:
            self._da_arm_tap("the log-prob pass handed nothing over: verl's bypass mode, or an engine other "
                             f"than draftadapt's (VERL_ENGINE_VENDOR={VENDOR})")
        super().on_step_end()  # verl's weight sync: the new policy into every replica
        t0 = time.perf_counter()
        from draftadapt.integrations.verl.rollout import engine_step_metrics

        acceptance, m = self._da_engines.take_acceptance()  # this step's generation, every server
        m.update(engine_step_metrics(self._da_engines.engine_steps()))
        m = {f"draftadapt/{k}": v for k, v in m.items()}
        if self._da_online is not None:
            m.update(self._da_step_k(acceptance))
        if self._da_rollouts is None or not self._da_adapt:
            self._da_rollouts, self._da_refs = None, []
            m.update(self._da_fleet_metrics())
            m["draftadapt/boundary_s"] = time.perf_counter() - t0
            self._da_metrics = m
            return
        version = self.global_steps
        rollouts, handed, weights = self._da_rollouts, None, None
        # no batch size drafts: the adapter trains nothing nobody serves, and watches only on the
        # steps its budget affords (docs/design.md, "Stepping aside"); the actor's hand-over ran
        # before this was known, so a paused step that does not watch only leaves it unread
        self._da_boundary.plan(self._da_k, self._da_engines, rollouts, version - 1)
        if self._da_refs and not self._da_boundary.hands_over:
            m["draftadapt/handover_rows"] = 0.0
        elif self._da_refs:
            payloads = ray.get(self._da_refs)
            rollouts, handed = gather(payloads, self._da_rollouts)
            m["draftadapt/handover_rows"] = float(len(rollouts))
            m["draftadapt/handover_ranks"] = float(len(payloads))
            m["draftadapt/handover_fetch_s"] = time.perf_counter() - t0
        else:
            if not self._da_tap.is_file():
                raise RuntimeError(f"{self._da_tap}: no policy written there by verl's weight sync, which the "
                                   f"adapter's policy copy reads; {WORKER_EXTENSION} writes it on replica 0 when it "
                                   "receives the actor's full weights on a CPU (not with LoRA or QAT, nor on a GPU, "
                                   "where verl's own receive path runs): hand over from verl's actor instead")
            weights = str(self._da_tap)
        res = self._da_boundary.after_update(rollouts, sampled_version=version - 1, weights=weights,
                                             version=version, handover=handed)
        self._da_rollouts, self._da_refs = None, []
        m.update({f"draftadapt/{k}": float(v) for k, v in res.metrics.items()})
        follow: dict[str, float] = {}
        self._da_follow_k(res, follow)
        m.update({f"draftadapt/{k}": float(v) for k, v in follow.items()})
        m["draftadapt/adapter_s"] = res.adapter_s
        m["draftadapt/swaps"] = float(len(res.swaps))
        m.update(self._da_fleet_metrics())
        m["draftadapt/adapter_policy_forwards"] = float(self._da_boundary.adapter.policy_forwards)
        m["draftadapt/boundary_s"] = time.perf_counter() - t0  # all of draftadapt's in verl's step, reads included
        self._da_metrics = m

    def _da_step_k(self, acceptance) -> dict[str, float]:
        """Online k at this boundary: the table re-chosen from the step's counters, and the
        calibration's seconds (spent before the first step's generation and outside
        ``draftadapt/boundary_s``; where nothing calibrated then, the first boundary calibrates
        here on the step's own prompts)."""
        out: dict[str, float] = {}
        if self._da_k is None:  # nothing calibrated before this step generated (no raw prompts)
            if not self._da_rollouts:
                return out
            self._da_calibrate([p for p, _ in self._da_rollouts], len(self._da_rollouts))
        elif acceptance is not None:
            out.update(self._da_k.update(self._da_engines, acceptance))
        out["k/calibrate_s"] = self._da_k.calibrate_s  # all of it so far, as OnlineK.update reports it
        out["k/drafter_idle"] = float(self._da_engines.drafter_idle)
        out["k/max"] = float(max(k for _, _, k in self._da_engines.k_schedule))
        return {f"draftadapt/{k}": float(v) for k, v in out.items()}
    def _da_fleet_metrics(self) -> dict[str, float]:
        """Every rollout worker's served draft version (-1: none of the store's yet), how many
        answered, their skew, the refusals so far, and the step's acceptance from every server."""
        served = self._da_engines.served()
        m = {f"draftadapt/served/{name}": float(-1 if v is None else v) for name, v in served["versions"].items()}
        m["draftadapt/served_workers"] = float(served["workers"])
        m["draftadapt/version_skew"] = float(served["skew"])
        known = [v for v in served["versions"].values() if v is not None]
        if known:
            m["draftadapt/draft_version"] = float(max(known))
        m["draftadapt/refused"] = float(len(self._da_engines.refused))
        return m

    def _consume_sync_metrics(self) -> dict:
        out = super()._consume_sync_metrics()
        out.update(self._da_metrics)
        self._da_metrics = {}
        return out
