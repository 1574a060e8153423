"""verl's synchronous PPO trainer with draftadapt at its step boundary (``trainer.v1.trainer_mode=draftadapt``).

verl imports this module in each of its processes when ``VERL_USE_EXTERNAL_MODULES`` names it
(``verl/__init__.py``); it registers the trainer under "draftadapt". The trainer is verl's own
``PPOTrainerSync``; three of its hooks gain draftadapt's part:

- ``_update_actor``: the batch's token ids (prompt, response) are kept for the adapter;
- ``on_step_end``: after verl's weight sync to every rollout replica (its own code), the step
  boundary runs (:class:`~draftadapt.boundary.StepBoundary`, its one order): the live draft's
  integrity on every replica, the adapter's observe / policy update / round, and the newest
  validated draft swapped into every replica (:class:`VerlEngines`);
- ``_consume_sync_metrics``: the boundary's metrics (``draftadapt/*``) join verl's step metrics.

Importing it also bridges vLLM 0.32's per-request speculative counters to where verl 0.9.1 reads
them (:func:`~draftadapt.integrations.verl.cpu.bridge_spec_stats`), so ``rollout/spec_accept_length``
is in verl's metrics with or without draftadapt's trainer.

Settings, from verl's config: ``+draftadapt.draft=DIR`` (the draft vLLM was started with, also
given as ``engine_kwargs.vllm.speculative_config``), ``+draftadapt.out=DIR`` (the adapter's
draft store), ``+draftadapt.adapter=YAML`` (an AdapterConfig; optional), ``+draftadapt.adapt=false``
(the frozen draft: nothing trained, for comparison runs), ``+draftadapt.threads=N`` (torch threads
for the adapter's round: verl's trainer process is a Ray actor of one CPU, so Ray gives it
``OMP_NUM_THREADS=1``; the round runs while verl's other workers wait); and verl's rollout started
with draftadapt's worker extension (``+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=``
:data:`~draftadapt.integrations.verl.WORKER_EXTENSION`), which the swaps and the policy tap run in.

The adapter's copy of the policy reads each new policy from the file replica 0's worker writes
during verl's weight sync (``OUT/policy_tap.safetensors``, named to the workers at ``init``): one
node, or a shared filesystem (docs/design.md, "Where draftadapt attaches").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

# first: verl imports this module (VERL_USE_EXTERNAL_MODULES) before its entry-point plugins, and
# what follows asks verl's platform registry for the device at import
from draftadapt.integrations.verl import cpu as _cpu  # registers the cpu platform
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from draftadapt.integrations.verl import WORKER_EXTENSION, VerlWorkerCall

_cpu.bridge_spec_stats()  # vLLM 0.32's per-request counters where verl 0.9.1 reads them

# inside +draftadapt.out: replica 0's first worker writes each policy verl's sync brings there
# (safetensors), the adapter's policy copy reads it
POLICY_TAP_FILE = "policy_tap.safetensors"


@dataclass
class VerlSwap:
    """One replica's swap, as the boundary reports swaps (``ms``, ``version``, ``checksum``)."""

    replica: int
    version: int
    checksum: str
    ms: float


class VerlEngines:
    """verl's rollout replicas as the step boundary's engine set: the policy is verl's to load
    (its checkpoint manager already did), the draft is draftadapt's, swapped through each
    replica's server (``collective_rpc`` into :class:`~draftadapt.integrations.verl.worker.VerlDraftWorkerExtension`)."""

    engine_set = True

    def __init__(self, replicas: list, status_dir: str | Path):
        self.replicas = list(replicas)
        self.status_dir = Path(status_dir)
        self.status_dir.mkdir(parents=True, exist_ok=True)
        self.policy_version = 0
        self.refused: list[str] = []

    def _call(self, method: str, *args) -> list[dict]:
        """``method`` on every replica; each worker writes its result to a status file."""
        tag = f"{method}-{time.monotonic_ns()}"
        status = str(self.status_dir / f"{tag}-{{replica}}.json")
        ray.get([r.server_handle.collective_rpc.remote(method, args=(*args, status)) for r in self.replicas])
        out = []
        for i in range(len(self.replicas)):
            path = Path(status.format(replica=i))
            out.append(json.loads(path.read_text()))
            path.unlink()
        return out

    def update_policy(self, weights: Any, version: int) -> None:
        self.policy_version = version  # loaded by verl's own weight sync before the boundary

    def tap_policy(self, path: Path) -> None:
        """From now on, replica 0's first worker writes each policy verl's sync brings to ``path``."""
        self._call(VerlWorkerCall.TAP_POLICY, str(path))

    def check_integrity(self, adapter) -> bool:
        results = self._call(VerlWorkerCall.INTEGRITY)
        return all(r["intact"] for r in results)

    def swap(self, adapter) -> list:
        results = self._call(VerlWorkerCall.SWAP, str(adapter.store.out_dir), self.policy_version)
        self.refused.extend(r["refused"] for r in results if "refused" in r)
        return [VerlSwap(r["replica"], r["version"], r.get("checksum", ""), r["ms"]) for r in results if r["swapped"]]


@register_trainer("draftadapt")
class DraftAdaptPPOTrainer(PPOTrainerSync):
    """verl's PPOTrainerSync with draftadapt's step boundary (module docstring)."""

    def init(self):
        from draftadapt.adapter import AdapterConfig, DraftAdapter
        from draftadapt.boundary import StepBoundary
        from draftadapt.config import load_config, pass_down

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
        self._da_engines = VerlEngines(self.checkpoint_manager.replicas, self._da_out / "status")
        self._da_tap = self._da_out / POLICY_TAP_FILE
        if self._da_adapt:  # a frozen draft needs no policy copy, so no file per sync
            self._da_tap.unlink(missing_ok=True)  # an earlier run's policy is not this step's
            self._da_engines.tap_policy(self._da_tap)
        self._da_boundary = StepBoundary(adapter, self._da_engines)
        self._da_rollouts: list | None = None
        self._da_metrics: dict[str, float] = {}

    def _da_settings(self) -> dict:
        """``+draftadapt.*`` from verl's config, checked: the draft, the store, and (the draft
        adapted) the worker extension the swaps and the policy tap run in."""
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
        return da

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
        super().on_step_end()  # verl's weight sync: the new policy into every replica
        if self._da_rollouts is None:
            return
        t0 = time.perf_counter()
        version = self.global_steps
        if not self._da_tap.is_file():
            raise RuntimeError(f"{self._da_tap}: no policy written there by verl's weight sync, which the "
                               f"adapter's policy copy reads; {WORKER_EXTENSION} writes it on replica 0 when it "
                               "receives the actor's full weights (not with LoRA or QAT, which keep verl's own sync)")
        res = self._da_boundary.after_update(self._da_rollouts, sampled_version=version - 1,
                                             weights=str(self._da_tap), version=version)
        self._da_rollouts = None
        m = {f"draftadapt/{k}": float(v) for k, v in res.metrics.items()}
        m["draftadapt/adapter_s"] = res.adapter_s
        m["draftadapt/boundary_s"] = time.perf_counter() - t0
        m["draftadapt/swaps"] = float(len(res.swaps))
        if res.swaps:
            m["draftadapt/draft_version"] = float(max(s.version for s in res.swaps))
        m["draftadapt/refused"] = float(len(self._da_engines.refused))
        self._da_metrics = m

    def _consume_sync_metrics(self) -> dict:
        out = super()._consume_sync_metrics()
        out.update(self._da_metrics)
        self._da_metrics = {}
        return out
