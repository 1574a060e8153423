"""verl's rollout servers as a :class:`~draftadapt.integrations.ray.DraftFleet`: every replica,
every server of a replica, every data-parallel engine of a server, every worker of an engine.

verl's server forwards ``collective_rpc`` to one engine's workers and drops what they return
(``vLLMHttpServer.collective_rpc``; verl's own comment on ``wake_up``: collective_rpc "only reaches
TP workers within a single shard"). draftadapt runs its calls in each server actor instead
(Ray's ``__ray_call__``, as verl itself reaches its workers in ``launch_servers``): there the
server's vLLM client calls the worker method on every engine it manages
(``call_utility_all_async``) and the results come back, one dict per worker. Each server is one
engine of a DraftFleet (:class:`VerlServer`), so a draft travels as the fleet's draft package:
put once in Ray's object store, written by each server into a directory of its own node, and
swapped in by each worker through the same checks (target, sha256, version, finite, shapes).
Nothing goes through a shared filesystem.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from draftadapt.integrations.verl import VerlWorkerCall
from draftadapt.metrics.acceptance import AcceptanceStats
from draftadapt.integrations.verl.handover import served

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 600.0  # a swap or read-back on every worker of one server


# ---------------------------------------------------------------------- in the server actor


def _utility(server, method: str, *args) -> list:
    """``EngineCore.method(*args)`` on every engine ``server``'s vLLM client manages; their
    results, one per engine. Runs in the server actor (``__ray_call__`` runs it off the actor's
    event loop, which the client's sockets belong to: the call is handed to that loop)."""
    engine = getattr(server, "engine", None)
    if engine is None:
        return []  # a server with no engine client of its own (a headless node of a replica)
    handler = getattr(engine, "output_handler", None)
    if handler is None:
        raise RuntimeError("verl's rollout server has not started its vLLM engine's output loop; "
                           "draftadapt calls its engines only after verl launched the server")
    client = engine.engine_core
    call_all = getattr(client, "call_utility_all_async", None)
    if call_all is not None:
        coro = call_all(method, *args)
    else:
        async def one_engine():
            return [await client.call_utility_async(method, *args)]
        coro = one_engine()
    return asyncio.run_coroutine_threadsafe(coro, handler.get_loop()).result(RPC_TIMEOUT_S)


def _rpc(server, method: str, *args) -> list[dict]:
    """``method`` on every worker of every engine ``server``'s vLLM client manages; their results."""
    return [w for workers in _utility(server, "collective_rpc", method, None, args, None) for w in workers]


def _name(server) -> str:
    return f"replica{getattr(server, 'replica_rank', 0)}/node{getattr(server, 'node_rank', 0)}"


def server_swap(server, package, rollback: bool = False) -> dict[str, Any]:
    """The draft package (resolved from Ray's object store) written into this node's directory
    and swapped into every worker; a refusal anywhere is reported (the others' result stands)."""
    t0 = time.perf_counter()
    root = Path(tempfile.gettempdir()) / "draftadapt-verl" / f"{_name(server).replace('/', '-')}-{os.getpid()}"
    try:
        path = package.write(root)
    except (OSError, ValueError) as exc:
        return {"engine": _name(server), "version": None, "refused": f"{root}: {exc}", "ms": 0.0, "workers": []}
    workers = _rpc(server, VerlWorkerCall.SWAP, str(path), package.version, package.lineage or "", rollback)
    refused = [f"r{w['replica']}w{w['rank']}: {w['refused']}" for w in workers if w.get("refused")]
    sums = {w.get("checksum") for w in workers if not w.get("refused")}
    versions = {w.get("version") for w in workers}
    return {"engine": _name(server), "version": versions.pop() if len(versions) == 1 else None,
            "checksum": sums.pop() if len(sums) == 1 else None, "refused": "; ".join(refused) or None,
            "ms": (time.perf_counter() - t0) * 1e3, "workers": workers}


def server_integrity(server) -> bool:
    """Every worker's live draft read back against what it swapped in (a lost one repaired)."""
    return all(w["intact"] for w in _rpc(server, VerlWorkerCall.INTEGRITY))


def server_status(server) -> dict[str, Any]:
    workers = _rpc(server, VerlWorkerCall.STATUS)
    versions = [w["version"] for w in workers if w["version"] is not None]
    return {"engine": _name(server), "pid": os.getpid(), "draft_version": min(versions) if versions else None,
            "policy_version": None, "workers": workers}


def server_spec_counters(server) -> dict:
    """This server's tally of finished requests' speculative counters since the last call."""
    from draftadapt.integrations.verl.cpu import take_spec_counters

    return take_spec_counters()


def server_tap_policy(server, path: str) -> list[dict]:
    return _rpc(server, VerlWorkerCall.TAP_POLICY, path)


def server_k_table(server, schedule, idle_drafter: bool) -> list[dict]:
    """Every engine's k table set in its engine-core process (``schedule`` None: read only);
    each engine's state (draftadapt/engine/k_table.py)."""
    from draftadapt.engine import k_table

    return _utility(server, k_table.CORE_METHOD, schedule, idle_drafter, False)


def server_engine_steps(server) -> list[list]:
    """Every engine's steps, timed in its engine core since the last call (its first call starts
    the clock): one list of ``[batch, drafted, prefill, seconds]`` per engine
    (draftadapt/engine/step_clock.py)."""
    from draftadapt.engine import step_clock

    return _utility(server, step_clock.CORE_METHOD)


# ---------------------------------------------------------------------- in the trainer


class _OnServer:
    """``.remote(*args)`` runs ``fn(server, *args)`` in the server actor (an actor method's shape,
    which is what DraftFleet calls)."""

    def __init__(self, server, fn):
        self.server, self.fn = server, fn

    def remote(self, *args, **kwargs):
        return self.server.__ray_call__.remote(self.fn, *args, **kwargs)


class VerlServer:
    """One of verl's rollout servers, answering the engine protocol DraftFleet calls
    (``swap``, ``check_integrity``, ``status``); the policy is verl's to load."""

    def __init__(self, server):
        self.handle = server
        self.swap = _OnServer(server, server_swap)
        self.check_integrity = _OnServer(server, server_integrity)
        self.status = _OnServer(server, server_status)
        self.tap_policy = _OnServer(server, server_tap_policy)
        self.spec_counters = _OnServer(server, server_spec_counters)
        self.k_table = _OnServer(server, server_k_table)
        self.engine_steps = _OnServer(server, server_engine_steps)


def counters_to_acceptance(tallies: list[dict], k: int | None = None) -> tuple[AcceptanceStats | None, dict[str, float]]:
    """Servers' tallies (``take_spec_counters``) summed: (per-position ``AcceptanceStats``, or
    None where nothing drafted or a per-position record is missing; verl-style metrics)."""
    from draftadapt.integrations.verl.cpu import add_per_position

    total: dict[str, Any] = {}
    for t in tallies:
        for key, v in t.items():
            if isinstance(v, list) or v is None:
                total[key] = add_per_position(total.get(key, []), v)
            else:
                total[key] = total.get(key, 0) + v
    if not total.get("verify_steps"):
        return None, {}
    metrics = {"accept/length": 1.0 + total["accepted"] / total["verify_steps"],
               "accept/length_per_request": total["length_sum"] / total["requests"],
               "accept/requests": float(total["requests"]), "accept/drafts": float(total["drafts"])}
    per, drafted = total.get("accepted_per_pos"), total.get("drafted_per_pos")
    if not per or not drafted:
        return None, metrics
    n = max(len(per), len(drafted), k or 0)
    pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
    return AcceptanceStats(n, int(total["verify_steps"]), pad(per), int(total["drafts"]), pad(drafted)), metrics


def engine_step_metrics(per_engine: list[list]) -> dict[str, float]:
    """What a step's generation cost inside the engines, from their step clocks (one list of
    ``[batch, drafted, prefill, seconds]`` per engine, ``server_engine_steps``), per engine on
    average: the seconds its engine core spent stepping (``engine/step_s``; against verl's
    ``timing_s/gen`` the rest is verl's agent loop, the servers' frontends and the transfers,
    none of which a draft shortens), of them in steps with prompt tokens (``engine/prefill_s``),
    its steps, and the share of them that verified a draft."""
    if not per_engine:
        return {}
    n = len(per_engine)
    steps = [s for engine in per_engine for s in engine]
    out = {"engine/step_s": sum(s[3] for s in steps) / n, "engine/prefill_s": sum(s[3] for s in steps if s[2]) / n,
           "engine/steps": len(steps) / n}
    if steps:
        out["engine/drafting_share"] = sum(1 for s in steps if s[1] > 0) / len(steps)
    return out


def _servers(replicas) -> list:
    return [s for r in replicas for s in r.servers]


class VerlEngines:
    """verl's rollout replicas as the step boundary's engine set: the policy is verl's to load (its
    checkpoint manager already did), the draft is draftadapt's, swapped into every worker of every
    server through a :class:`~draftadapt.integrations.ray.DraftFleet`. The replica list is read
    again at each boundary: a server verl added since joins and is caught up to the newest draft."""

    engine_set = True

    def __init__(self, checkpoint_manager):
        from draftadapt.integrations.ray import DraftFleet

        self.checkpoint_manager = checkpoint_manager
        self.fleet = DraftFleet.from_actors([])
        self._known: set = set()
        self._k: dict[str, Any] | None = None  # the engines' k table state, as k_table() last read it
        self.refresh()

    def refresh(self) -> None:
        """Servers verl started since the last boundary join the fleet (caught up on joining)."""
        for s in _servers(self.checkpoint_manager.replicas):
            key = s._actor_id.hex()
            if key not in self._known:
                self._known.add(key)
                self.fleet.join(VerlServer(s), f"server{len(self._known) - 1}")

    def update_policy(self, weights: Any, version: int) -> None:
        self.fleet.policy_version = version  # loaded by verl's own weight sync before the boundary
        self.refresh()

    def check_integrity(self, adapter) -> bool:
        return self.fleet.check_integrity(adapter)

    def swap(self, adapter) -> list:
        return self.fleet.swap(adapter)

    @property
    def refused(self) -> list[str]:
        return [r for s in self.fleet.swaps for r in s.refused.values()]

    def served(self) -> dict[str, Any]:
        """Every worker's served draft version and their skew (:func:`~draftadapt.integrations.verl.handover.served`)."""
        return served([w for st in self.fleet.status() for w in st["workers"]])

    def take_acceptance(self) -> tuple[Any, dict[str, float]]:
        """The speculative counters of every finished request since the last call, over every
        server, taken (reset there): (an ``AcceptanceStats`` per draft position, for online k;
        None when nothing drafted or a server kept no per-position record) and the metrics
        ``accept/length`` (tokens per verify step, draftadapt's figure),
        ``accept/length_per_request`` (verl's: the mean over requests of 1 + accepted / steps)."""
        import ray

        return counters_to_acceptance(ray.get([a.spec_counters.remote() for a in self.fleet.actors]))

    # ---- online k: the k table in every server's engine cores (draftadapt/engine/k_table.py)

    def k_table(self, schedule=None, idle_drafter: bool = True) -> dict[str, Any]:
        """Every server's engines set to ``schedule`` (None: read only); their common state
        {"rows", "k_max", "max_num_seqs", "idle"}. ValueError (from the engine core) where an
        engine was started without a per-batch-size table; RuntimeError where they disagree."""
        import ray

        states = [st for per in ray.get([a.k_table.remote(schedule, idle_drafter) for a in self.fleet.actors])
                  for st in per]
        if not states:
            raise RuntimeError("no rollout server answered: verl has not launched its servers yet")
        shapes = {(st["k_max"], st["max_num_seqs"]) for st in states}
        if len(shapes) > 1:
            raise RuntimeError(f"verl's rollout engines disagree on (k_max, max_num_seqs): {sorted(shapes)}; "
                               "online k keeps one table for all of them")
        first = states[0]
        self._k = {"rows": [tuple(r) for r in first["rows"]], "k_max": int(first["k_max"]),
                   "max_num_seqs": int(first["max_num_seqs"]), "idle": all(st["idle"] for st in states)}
        return dict(self._k)

    def _k_state(self) -> dict[str, Any]:
        if self._k is None:
            self.k_table()
        return self._k

    @property
    def k_schedule(self) -> list[tuple[int, int, int]]:
        return list(self._k_state()["rows"])

    @property
    def k(self) -> int:
        return self._k_state()["k_max"]

    @property
    def max_num_seqs(self) -> int:
        return self._k_state()["max_num_seqs"]

    @property
    def drafter_idle(self) -> bool:
        return self._k_state()["idle"]

    def set_k_schedule(self, schedule, idle_drafter: bool = True) -> None:
        self.k_table([tuple(int(v) for v in r) for r in schedule], idle_drafter)

    def generate(self, prompts, temperature: float = 1.0, max_tokens: int = 32, seed: int = 0, **_):
        """``prompts`` (token id lists) on the first server alone, all at once, as verl's agent
        loop sends them (its ``generate``): what online k's calibration times. A
        ``GenerateResult`` with that server's counters of these requests."""
        import uuid

        import ray

        from draftadapt.engine.rollout import EngineStep, GenerateResult, Rollout

        actor = self.fleet.actors[0]
        server = actor.handle
        ray.get(actor.spec_counters.remote())  # what finished before is not these requests'
        ray.get(actor.engine_steps.remote())  # nor the steps before (the first call starts the clock)
        t0 = time.perf_counter()
        refs = [server.generate.remote(prompt_ids=list(p), request_id=f"draftadapt-k-{uuid.uuid4().hex}",
                                       sampling_params={"temperature": float(temperature), "max_tokens": int(max_tokens),
                                                        "seed": int(seed) + i})
                for i, p in enumerate(prompts)]
        outs = ray.get(refs)
        seconds = time.perf_counter() - t0
        acceptance, _ = counters_to_acceptance([ray.get(actor.spec_counters.remote())], k=self.k)
        per_engine = ray.get(actor.engine_steps.remote())
        # the first engine's steps: the calibration's requests all went to it (tp = 1 on this server)
        steps = [EngineStep(int(b), int(d), bool(p), float(s)) for b, d, p, s in (per_engine[0] if per_engine else [])]
        rollouts = [Rollout(list(p), list(o.token_ids), "", None, o.stop_reason) for p, o in zip(prompts, outs)]
        return GenerateResult(rollouts, acceptance if acceptance is not None else AcceptanceStats(self.k), seconds, steps)

    def engine_steps(self) -> list[list]:
        """Every server's engines' steps since the last call, timed in their engine cores
        (``[batch, drafted, prefill, seconds]`` each; the first call starts the clocks)."""
        import ray

        return [steps for per in ray.get([a.engine_steps.remote() for a in self.fleet.actors]) for steps in per]

    def tap_policy(self, path: Path) -> None:
        """The fallback: replica 0's first worker writes each policy verl's sync brings to ``path``."""
        import ray

        ray.get([a.tap_policy.remote(str(path)) for a in self.fleet.actors])
