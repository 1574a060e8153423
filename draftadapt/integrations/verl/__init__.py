"""draftadapt attached to verl 0.9.1 (docs/design.md, "verl on CPU").

- :mod:`draftadapt.integrations.verl.cpu`: a ``cpu`` platform for verl's platform registry (the
  ``verl.plugins`` entry point), so verl's trainer, FSDP actor and vLLM rollout run on a machine
  without an accelerator (``VERL_PLATFORM=cpu``);
- :mod:`draftadapt.integrations.verl.worker`: the vLLM worker extension verl's rollout servers
  run with (``engine_kwargs.vllm.worker_extension_cls``): verl's weight sync, loaded in place with
  vLLM's layerwise reload, and draftadapt's draft swap beside it.

- :mod:`draftadapt.integrations.verl.engine`: verl's FSDP engine with the hand-over in its log-prob
  pass (registered in verl's engine registry; ``VERL_ENGINE_VENDOR=draftadapt``);
- :mod:`draftadapt.integrations.verl.rollout`: verl's rollout servers as a
  :class:`~draftadapt.integrations.ray.DraftFleet` (drafts through Ray's object store, results
  from every worker of every engine);
- :mod:`draftadapt.integrations.verl.trainer`: verl's sync PPO trainer with draftadapt's step
  boundary (``trainer.v1.trainer_mode=draftadapt``).

This package imports no verl; its modules do (verl imports them in its own processes).
"""

# the worker extension verl's rollout servers run with draftadapt attached
# (``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls``)
WORKER_EXTENSION = "draftadapt.integrations.verl.worker.VerlDraftWorkerExtension"


class VerlWorkerCall:
    """The worker methods draftadapt calls by name on every worker of every rollout engine
    (:mod:`draftadapt.integrations.verl.rollout`), each spelled here once (defined on
    :class:`~draftadapt.integrations.verl.worker.VerlDraftWorkerExtension`); each returns a dict."""

    SWAP = "da_verl_swap"  # a draft package written on this node, swapped in (checked)
    INTEGRITY = "da_verl_integrity"  # is the live draft the one last swapped in
    STATUS = "da_verl_status"  # the draft version this worker serves
    TAP_POLICY = "da_verl_tap_policy"  # the fallback: where to write each policy verl's sync brings
