"""A running engine's k table, changed in place where its scheduler lives: installed in every vLLM process.

vLLM 0.32's scheduler looks the draft length up in a dense batch-size table every step
(``Scheduler.dynamic_sd_lookup``, built at start-up from ``speculative_config.
num_speculative_tokens_per_batch_size``). Online k (docs/design.md, "Online k") rewrites that table
between generations. An in-process engine (draftadapt's own) holds its scheduler in the caller's
process; every other engine (vLLM's multiprocess engine, verl's rollout servers) holds it in an
engine-core process, which vLLM's utility calls reach only through ``EngineCore``'s own methods.
This module's ``vllm.general_plugins`` entry point gives ``EngineCore`` one more,
:data:`CORE_METHOD`, so ``call_utility(CORE_METHOD, rows, idle_drafter)`` sets the table there.

A table of zeros can also idle the drafter (no pass at all on a step that drafts nothing,
``WorkerCall.DRAFTER_IDLE``; docs/design.md, "Stepping aside"): that needs draftadapt's worker
extension in the engine (draftadapt's engine and verl's rollout with draftadapt attached load it).

Guarded by version (0.32.x, whose scheduler this writes into). ``DRAFTADAPT_DISABLE_K_TABLE=1``
turns it off (online k then works only in process).
"""

from __future__ import annotations

from typing import Any, Sequence

PATCHED_VERSIONS = ("0.32.",)
DISABLE_ENV = "DRAFTADAPT_DISABLE_K_TABLE"
CORE_METHOD = "draftadapt_set_k_schedule"


def normalize(schedule: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """``schedule`` as vLLM's rows: (batch_from, batch_to, k), ints (msgpack hands lists over)."""
    rows = [tuple(int(v) for v in r) for r in schedule]
    for r in rows:
        if len(r) != 3:
            raise ValueError(f"k table row {r}: give (batch_from, batch_to, k)")
    return rows


def apply(core, schedule: Sequence[Sequence[int]] | None, idle_drafter: bool, idle_call) -> dict[str, Any]:
    """Write ``schedule`` into ``core``'s scheduler (an ``EngineCore``) and, with ``idle_drafter``
    and a table of zeros, idle the drafter through ``idle_call(idle)`` (the workers'
    DRAFTER_IDLE, which returns their state; None for a model-free drafter, which has no pass to
    skip). ``schedule`` None reads the table and the drafter's state, changing nothing. Returns
    {"rows", "k_max", "max_num_seqs", "idle"}. A schedule vLLM refuses at start-up is refused
    here (ValueError) and the table stays as it was."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    scheduler, spec = core.scheduler, core.vllm_config.speculative_config
    if spec is None or getattr(scheduler, "dynamic_sd_lookup", None) is None:
        raise ValueError("this engine was started without a per-batch-size k table; start it with "
                         "speculative_config num_speculative_tokens_per_batch_size=[[1, MAX_NUM_SEQS, K]] "
                         "(and num_speculative_tokens = the largest k online k may choose)")
    max_num_seqs = int(scheduler.scheduler_config.max_num_seqs)
    k_max = int(spec.num_speculative_tokens)
    if schedule is None:
        rows = normalize(spec.num_speculative_tokens_per_batch_size)
        idle = bool(idle_call(None)["idle"]) if idle_call is not None else False
    else:
        rows = normalize(schedule)
        dense = build_dynamic_sd_schedule_lookup(rows, max_num_seqs, k_max)  # validates as at start-up
        scheduler.dynamic_sd_lookup[:] = dense
        spec.num_speculative_tokens_per_batch_size = rows
        idle = bool(idle_drafter) and not any(dense)
        if idle_call is not None:
            idle_call(idle)
    return {"rows": [list(r) for r in rows], "k_max": k_max, "max_num_seqs": max_num_seqs, "idle": idle}


def _core_method(self, schedule=None, idle_drafter=True, model_free=False):
    """``EngineCore.draftadapt_set_k_schedule``: :func:`apply` in the engine-core process."""
    from draftadapt.engine.worker_ext import WorkerCall

    def idle_call(idle: bool | None) -> dict:
        return self.model_executor.collective_rpc(WorkerCall.DRAFTER_IDLE, args=(idle,))[0]

    return apply(self, schedule, idle_drafter, None if model_free else idle_call)


def needed() -> bool:
    from draftadapt.engine.cpu_fix import plugin_wanted

    return plugin_wanted(DISABLE_ENV, PATCHED_VERSIONS, cpu_only=False)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (loaded in every vLLM process, more than once)."""
    from draftadapt.engine.cpu_fix import add_core_method

    add_core_method(CORE_METHOD, _core_method, DISABLE_ENV, PATCHED_VERSIONS)
