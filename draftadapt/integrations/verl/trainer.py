"""verl's synchronous PPO trainer with draftadapt at its step boundary (``trainer.v1.trainer_mode=draftadapt``).

verl imports this module in each of its processes when ``VERL_USE_EXTERNAL_MODULES`` names it
(``verl/__init__.py``); it registers the trainer under "draftadapt" and draftadapt's FSDP engine
in verl's engine registry (:mod:`~draftadapt.integrations.verl.engine`). The trainer is verl's own
``PPOTrainerSync``; five of its hooks gain draftadapt's part:

- ``prepare_step``: the adapter's round left due by the last boundary starts (a thread of this
  process) just before verl submits the step's prompts, so it trains while verl generates
  (``StepBoundary(background=True)``, the default; ``+draftadapt.background=false``: the round
  runs at the boundary);
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
        if self._da_adapt:
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
        if self._da_rollouts is not None and not self._da_refs and self._da_tap is None:
            self._da_arm_tap("the log-prob pass handed nothing over: verl's bypass mode, or an engine other "
                             f"than draftadapt's (VERL_ENGINE_VENDOR={VENDOR})")
        super().on_step_end()  # verl's weight sync: the new policy into every replica
        if self._da_rollouts is None:
            return
        t0 = time.perf_counter()
        version = self.global_steps
        rollouts, handed, weights = self._da_rollouts, None, None
        m: dict[str, float] = {}
        if self._da_refs:
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
        m["draftadapt/adapter_s"] = res.adapter_s
        m["draftadapt/swaps"] = float(len(res.swaps))
        m.update(self._da_fleet_metrics())
        m["draftadapt/adapter_policy_forwards"] = float(self._da_boundary.adapter.policy_forwards)
        m["draftadapt/boundary_s"] = time.perf_counter() - t0  # all of draftadapt's in verl's step, reads included
        self._da_metrics = m

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
        m.update({f"draftadapt/{k}": v for k, v in self._da_engines.acceptance().items()})
        return m

    def _consume_sync_metrics(self) -> dict:
        out = super()._consume_sync_metrics()
        out.update(self._da_metrics)
        self._da_metrics = {}
        return out
