"""draftadapt on a Ray cluster: a fleet of rollout engines kept on the newest validated draft, and
the adapter in an actor of its own. This is how verl, OpenRLHF, NeMo-RL, SkyRL and slime hold
their rollout engines (several vLLM replicas as Ray actors), so it is how draftadapt meets them.

    import ray
    from draftadapt.boundary import StepBoundary
    from draftadapt.integrations.ray import DraftFleet, RemoteAdapter

    ray.init()
    fleet = DraftFleet(policy_dir, draft_dir, engines=2, engine_kwargs={"threads": 1})
    adapter = RemoteAdapter(policy_dir, draft_dir, out_dir="runs/drafts")      # its own actor
    boundary = StepBoundary(adapter, fleet)
    for step in range(steps):
        gen = fleet.generate(prompts, temperature=1.0, max_tokens=512, seed=step)  # split over engines
        boundary.report(gen.acceptance)
        with adapter.handover(policy) as ho:                                       # hooks, this process
            weights = rl_update(policy, gen.rollouts, ho)
        boundary.after_update(gen.rollouts, sampled_version=step, weights=weights, version=step + 1, handover=ho)
    fleet.close(); adapter.close()

What crosses between actors goes through Ray's object store, put once and read by every engine:
the policy's weights after each update, and each published draft as its files' bytes
(:class:`~draftadapt.data.store.DraftPackage`), so no shared filesystem is needed. Each engine
writes the package into a directory of its own and swaps it in through the same checks as
anywhere else (sha256, lineage, target fingerprint, shapes, finite): an engine that refuses keeps
its draft and is reported, never killed.

Failures (docs/design.md, "Ray fleet"):
- an engine actor that dies is restarted by Ray (``max_restarts``); the fleet notices at its next
  call, loads the current policy and the newest draft into the new incarnation, and re-runs what
  the dead one was doing (a generation shard with the same seeds): no step is lost;
- an engine added with :meth:`DraftFleet.add_engine` comes up the same way;
- the adapter actor that dies is restarted by Ray and its calls retried (``max_task_retries``);
  a new :class:`~draftadapt.adapter.DraftAdapter` resumes from its store's newest draft and the
  trainer state beside it (its replay buffer starts empty).

Your own engine actors join through :meth:`DraftFleet.from_actors` if they answer the protocol
of :class:`EngineServer`: ``generate``, ``update_policy``, ``swap``, ``check_integrity``,
``status``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from draftadapt.metrics.acceptance import AcceptanceStats

log = logging.getLogger(__name__)


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the extra is installed by scripts/setup.sh
        raise ImportError("draftadapt.integrations.ray needs Ray: pip install 'draftadapt[ray]'") from exc
    return ray


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError

    return (RayActorError,)


# ---------------------------------------------------------------------- engine side


class EngineServer:
    """The body of one engine actor: a :class:`~draftadapt.engine.rollout.RolloutEngine` in the
    actor's process, drafts received as packages and written under ``cache_dir`` before a swap.

    target, draft: as RolloutEngine (``draft`` must be readable where the actor runs; later drafts
    come as packages); engine_kwargs: more RolloutEngine arguments (``in_process`` is forced on:
    vLLM's engine core and worker run in the actor itself); name: the engine's name in reports.
    """

    def __init__(self, target: str, draft: str | None, engine_kwargs: dict[str, Any] | None = None,
                 name: str = "engine", cache_dir: str | None = None):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # each replica its own small KV cache
        from draftadapt.engine.rollout import RolloutEngine

        self.name = name
        self.engine = RolloutEngine(target, draft, **{**(engine_kwargs or {}), "in_process": True})
        # a fresh directory per incarnation: a restarted actor never trusts what a dead one wrote
        root = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "draftadapt-fleet"
        root.mkdir(parents=True, exist_ok=True)
        self.cache = Path(tempfile.mkdtemp(prefix=f"{name}-{os.getpid()}-", dir=root))
        self.started = time.time()
        self.refusals = 0
        self._live: tuple[str, Path] | None = None  # (checksum read back after our swap, its dir)

    def generate(self, prompts: Sequence[Any], **kwargs):
        return self.engine.generate(prompts, **kwargs)

    def update_policy(self, weights, version: int) -> dict[str, Any]:
        return self.engine.update_policy(weights, version=version)

    def swap(self, package, rollback: bool = False) -> dict[str, Any]:
        """Write the package into this engine's cache and swap it in. A refusal (any check of
        ``RolloutEngine.swap_draft``) keeps the previous draft serving and is returned, not raised."""
        from draftadapt.engine.rollout import DraftSwapError

        t0 = time.perf_counter()
        try:
            path = package.write(self.cache)
            res = self.engine.swap_draft(path, rollback=rollback)
        except (DraftSwapError, ValueError, OSError) as exc:
            self.refusals += 1
            return {"engine": self.name, "version": self.engine.draft_version, "refused": str(exc),
                    "ms": (time.perf_counter() - t0) * 1e3}
        self._live = (res.checksum, path)
        return {"engine": self.name, "version": res.version, "checksum": res.checksum, "refused": None,
                "ms": res.ms, "write_ms": (time.perf_counter() - t0) * 1e3 - res.ms}

    def swap_path(self, path: str, rollback: bool = False) -> dict[str, Any]:
        """Swap a draft directory readable here (e.g. the run's starting draft) in."""
        res = self.engine.swap_draft(path, rollback=rollback)
        self._live = (res.checksum, Path(path))
        return {"engine": self.name, "version": res.version, "checksum": res.checksum, "ms": res.ms}

    def check_integrity(self) -> bool:
        """Is the draft still the one last swapped in (a policy sync or a sleep may lose it)?
        Swaps it in again if not; True when it was intact."""
        if self._live is None:
            return True
        expected, path = self._live
        if self.engine.draft_state()["checksum"] == expected:
            return True
        res = self.engine.swap_draft(path, rollback=True)
        self._live = (res.checksum, path)
        return False

    def status(self) -> dict[str, Any]:
        e = self.engine
        return {"engine": self.name, "pid": os.getpid(), "started": self.started,
                "policy_version": e.policy_version, "draft_version": e.draft_version,
                "draft_dir": None if e.draft_dir is None else str(e.draft_dir), "refusals": self.refusals}

    def call(self, name: str, *args, **kwargs):
        """Any other RolloutEngine method or attribute (``set_k_schedule``, ``draft_state``, ...)."""
        value = getattr(self.engine, name)
        return value(*args, **kwargs) if callable(value) else value

    def close(self) -> None:
        import shutil

        self.engine.close()
        shutil.rmtree(self.cache, ignore_errors=True)  # this incarnation's copies of the drafts


@dataclass
class FleetSwap:
    """One draft version broadcast to the fleet: which engines took it, which refused (and why),
    the broadcast's wall time (object-store put + every engine's write and swap, in parallel)."""

    version: int
    policy_version: int
    nbytes: int
    broadcast_ms: float
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return self.broadcast_ms

    @property
    def refused(self) -> dict[str, str]:
        return {n: r["refused"] for n, r in self.engines.items() if r.get("refused")}

    @property
    def checksum(self) -> str | None:
        sums = {r.get("checksum") for r in self.engines.values() if not r.get("refused")}
        return sums.pop() if len(sums) == 1 else None


class DraftFleet:
    """N engine actors serving one policy version and one draft version (see the module
    docstring). An :class:`~draftadapt.boundary.EngineSet`: give it to ``StepBoundary``.

    target, draft: the policy the engines start from and the draft they serve first (paths each
    actor can read); engines: how many engine actors to start; engine_kwargs: RolloutEngine
    arguments for each (method, num_speculative_tokens, threads, max_num_seqs, seed, ...);
    actor_options: Ray actor options (``num_cpus`` defaults to 0, so engines never wait for a
    CPU slot; ``max_restarts`` to -1: Ray brings a dead engine back and the fleet catches it up).
    """

    engine_set = True  # StepBoundary takes it as it is

    def __init__(self, target: str | Path, draft: str | Path | None, engines: int = 2,
                 engine_kwargs: dict[str, Any] | None = None, actor_options: dict[str, Any] | None = None,
                 cache_dir: str | Path | None = None, _actors: Sequence[Any] | None = None):
        ray = _ray()
        if _actors is None and engines < 1:
            raise ValueError(f"engines={engines}: a fleet needs at least one engine actor")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init(...) (or connect to your cluster) first")
        self.target, self.draft = str(target), None if draft is None else str(draft)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.actor_options = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0, **(actor_options or {})}
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.policy_version = 0
        self._policy_ref = None  # the newest policy weights, in the object store (for catch-up)
        self._package_ref = None  # the newest draft package the fleet serves
        self.served: dict[str, int | None] = {}  # lineage -> version the fleet serves (adapter's store)
        self.swaps: list[FleetSwap] = []
        self.restarts = 0
        self.names: list[str] = []
        self.actors: list[Any] = []
        if _actors is not None:
            for i, a in enumerate(_actors):
                self.actors.append(a)
                self.names.append(f"engine{i}")
        else:
            for _ in range(engines):
                self.add_engine()

    @classmethod
    def from_actors(cls, actors: Sequence[Any]) -> "DraftFleet":
        """A fleet over engine actors you started (any class answering EngineServer's methods)."""
        fleet = cls.__new__(cls)
        cls.__init__(fleet, "", None, engines=0, _actors=actors)
        return fleet

    # ------------------------------------------------------------------ membership

    def add_engine(self) -> str:
        """Start one more engine actor; it serves the current policy and draft before it returns."""
        ray = _ray()
        name = f"engine{len(self.actors)}"
        cls = ray.remote(EngineServer).options(**self.actor_options, name=None)
        return self.join(cls.remote(self.target, self.draft, self.engine_kwargs, name, self.cache_dir), name)

    def join(self, actor, name: str | None = None) -> str:
        """An engine actor started elsewhere (answering EngineServer's protocol) joins the fleet:
        it serves the fleet's policy and newest draft before this returns."""
        name = name or f"engine{len(self.actors)}"
        self.actors.append(actor)
        self.names.append(name)
        _ray().get(actor.status.remote())  # started (or its error raised here)
        self._catch_up(len(self.actors) - 1)
        return name

    def _catch_up(self, i: int) -> None:
        """Engine ``i`` (new, or restarted by Ray) onto the fleet's policy and draft versions."""
        ray = _ray()
        a = self.actors[i]
        st = ray.get(a.status.remote())
        if self._policy_ref is not None and st["policy_version"] != self.policy_version:
            ray.get(a.update_policy.remote(self._policy_ref, self.policy_version))
        if self._package_ref is not None:
            r = ray.get(a.swap.remote(self._package_ref))
            if r["refused"]:
                log.warning("fleet: %s refused the fleet's draft on catch-up: %s", self.names[i], r["refused"])

    def _wait_alive(self, i: int, timeout_s: float = 600.0) -> None:
        ray = _ray()
        t0 = time.monotonic()
        while True:
            try:
                ray.get(self.actors[i].status.remote(), timeout=60)
                return
            except _actor_errors() + (ray.exceptions.GetTimeoutError,):
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"fleet: {self.names[i]} did not come back within {timeout_s:.0f} s; "
                                       "see the Ray dashboard / logs for why it keeps dying") from None
                time.sleep(1.0)

    def _on_all(self, method: str, *args, **kwargs) -> list[Any]:
        """Call ``method`` on every engine at once; an engine that died is waited for (Ray restarts
        it), caught up to the fleet's policy and draft, and asked again."""
        ray = _ray()
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        out = []
        for i, ref in enumerate(refs):
            out.append(self._get_or_recover(i, ref, lambda a: getattr(a, method).remote(*args, **kwargs)))
        return out

    def _get_or_recover(self, i: int, ref, again):
        ray = _ray()
        for attempt in range(3):
            try:
                return ray.get(ref)
            except _actor_errors() as exc:
                self.restarts += 1
                log.warning("fleet: %s died (%s); waiting for its restart, catching it up, trying again",
                            self.names[i], type(exc).__name__)
                self._wait_alive(i)
                self._catch_up(i)
                ref = again(self.actors[i])
        return ray.get(ref)

    # ------------------------------------------------------------------ the RL step

    def generate(self, prompts: Sequence[Any], seed: int | None = None, **kwargs):
        """The batch split into contiguous shards, one per engine, generated at once. Request i
        keeps seed ``seed + i`` whichever engine runs it, so the batch samples as one engine
        would. Returns one GenerateResult: rollouts in prompt order, acceptance counters summed,
        seconds of the slowest shard (``per_engine_seconds`` beside it)."""
        from draftadapt.engine.rollout import GenerateResult

        n, m = len(prompts), len(self.actors)
        bounds = [(n * j // m, n * (j + 1) // m) for j in range(m)]

        def launch(actor, lo, hi):
            return actor.generate.remote(list(prompts[lo:hi]), seed=None if seed is None else seed + lo, **kwargs)

        refs = [launch(a, lo, hi) for a, (lo, hi) in zip(self.actors, bounds)]
        results = [self._get_or_recover(j, ref, lambda a, lo=lo, hi=hi: launch(a, lo, hi))
                   for j, (ref, (lo, hi)) in enumerate(zip(refs, bounds))]
        acceptance = AcceptanceStats()
        for r in results:
            if r.acceptance.drafts or r.acceptance.k:
                acceptance = acceptance + r.acceptance
        res = GenerateResult([x for r in results for x in r.rollouts], acceptance, max(r.seconds for r in results))
        self.per_engine_seconds = [r.seconds for r in results]
        return res

    def update_policy(self, weights, version: int) -> None:
        """The policy's weights into the object store once; every engine loads them in place."""
        self._policy_ref = _put_once(weights)
        self.policy_version = version
        self._on_all("update_policy", self._policy_ref, version)

    def check_integrity(self, adapter=None) -> bool:
        """Every engine reads its draft back against what it swapped in; a lost one is repaired."""
        return all(self._on_all("check_integrity"))

    def swap(self, adapter) -> list[FleetSwap]:
        """The newest draft ``adapter`` published that the fleet's policy version may serve, into
        the object store once and swapped into every engine. [] when there is nothing newer."""
        ray = _ray()
        lineage = next(iter(self.served), None)
        package = adapter.newest_package(self.policy_version, newer_than=self.served.get(lineage))
        if package is None:
            return []
        t0 = time.perf_counter()
        ref = ray.put(package)
        results = self._on_all("swap", ref)
        swap = FleetSwap(package.version, package.policy_version, package.nbytes, (time.perf_counter() - t0) * 1e3,
                         {r["engine"]: r for r in results})
        self.swaps.append(swap)
        if not swap.refused:
            self._package_ref = ref
            self.served = {package.lineage: package.version}
        else:
            log.warning("fleet: draft v%d refused by %s; they keep their draft", package.version, swap.refused)
            if len(swap.refused) == len(results):
                # refused everywhere: not retried every step (the adapter's next publish is)
                self.served = {package.lineage: package.version}
        return [swap]

    def swap_path(self, path: str | Path, rollback: bool = False) -> list[dict[str, Any]]:
        """A draft directory every engine can read, swapped into each (e.g. the starting draft)."""
        return self._on_all("swap_path", str(path), rollback)

    # the calls of a single RolloutEngine the toy demo's measurements make, on every engine
    def swap_draft(self, path: str | Path, rollback: bool = False) -> FleetSwap:
        t0 = time.perf_counter()
        results = self.swap_path(path, rollback)
        return FleetSwap(results[0]["version"], self.policy_version, 0, (time.perf_counter() - t0) * 1e3,
                         {r["engine"]: {**r, "refused": None} for r in results})

    @property
    def draft_dir(self) -> Path | None:
        """The draft directory the first engine serves from (each engine has its own copy)."""
        d = self.status()[0]["draft_dir"]
        return None if d is None else Path(d)

    @property
    def draft_version(self) -> int | None:
        """The draft version the fleet serves (the first engine's; ``versions()`` has each)."""
        return self.status()[0]["draft_version"]

    # ------------------------------------------------------------------ reports

    def status(self) -> list[dict[str, Any]]:
        """Each engine's served policy and draft versions (and its pid: a restart shows here)."""
        return self._on_all("status")

    def versions(self) -> dict[str, Any]:
        """Per engine served draft version, the version skew (newest - oldest) and the policy versions."""
        st = self.status()
        drafts = [s["draft_version"] for s in st]
        known = [d for d in drafts if d is not None]
        return {"draft_version": {s["engine"]: s["draft_version"] for s in st},
                "policy_version": {s["engine"]: s["policy_version"] for s in st},
                "skew": (max(known) - min(known)) if known else 0}

    def call(self, name: str, *args, **kwargs) -> list[Any]:
        """A RolloutEngine method on every engine (``set_k_schedule``, ``draft_state``, ...)."""
        return self._on_all("call", name, *args, **kwargs)

    def close(self) -> None:
        ray = _ray()
        for a in self.actors:
            try:
                ray.get(a.close.remote(), timeout=120)
            except Exception:  # noqa: BLE001 - closing: a dead engine has nothing left to close
                pass
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.cache_dir is not None and Path(self.cache_dir).is_dir() and not any(Path(self.cache_dir).iterdir()):
            Path(self.cache_dir).rmdir()  # each engine removed its own copies; nothing of ours is left


class LocalCluster:
    """A Ray cluster on this machine for one run (the demo's engines=N); ``close`` stops it and
    removes its files if this object started it. Ray's session files go under a short temporary
    directory (its sockets' paths must stay under the 107 bytes AF_UNIX allows, which a run's own
    output directory can exceed); its workers' logs stay out of ours."""

    def __init__(self, num_cpus: int | None = None):
        ray = _ray()
        self.started = not ray.is_initialized()
        self.temp_dir = None
        if self.started:
            self.temp_dir = tempfile.mkdtemp(prefix="da-ray-")
            ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _temp_dir=self.temp_dir)

    def close(self) -> None:
        if self.started:
            import shutil

            _ray().shutdown()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.started = False


def local_cluster(num_cpus: int | None = None) -> LocalCluster:
    """Join the Ray cluster this process is connected to, or start one on this machine."""
    return LocalCluster(num_cpus)


_last_put: tuple[int, Any, Any] | None = None  # (id of the object, its ref, the object kept alive)


def _put_once(obj):
    """ray.put, once per object: the fleet and the adapter actor given the same weights dict in
    one step share one copy in the object store."""
    global _last_put
    if _last_put is not None and _last_put[0] == id(obj) and _last_put[2] is obj:
        return _last_put[1]
    ref = _ray().put(obj)
    _last_put = (id(obj), ref, obj)
    return ref


# ---------------------------------------------------------------------- adapter side


class AdapterServer:
    """The body of the adapter actor: a :class:`~draftadapt.adapter.DraftAdapter`. Constructed
    again by Ray after a crash, it resumes from its store (``resumed_from``)."""

    def __init__(self, policy_dir: str, draft_dir: str, out_dir: str, cfg=None, threads: int | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        from draftadapt.adapter import DraftAdapter

        self.adapter = DraftAdapter(policy_dir, draft_dir, out_dir, cfg)
        self.pid = os.getpid()

    def handover_settings(self) -> dict[str, Any]:
        c = self.adapter.capture
        return {"aux_layer_ids": c.aux_layer_ids, "draft_to_target": c.draft_to_target,
                "temperature": c.temperature, "store": self.adapter.cfg.handover_store}

    def observe(self, rollouts, policy_version: int, handover=None, **kwargs) -> int:
        return self.adapter.observe(rollouts, policy_version=policy_version, handover=handover, **kwargs)

    def update_policy(self, weights, version: int) -> None:
        # a restarted adapter starts at version 0: any newer version is loaded
        self.adapter.update_policy(weights, version)

    def status(self) -> dict[str, Any]:
        a = self.adapter
        return {"pid": self.pid, "resumed_from": a.resumed_from, "live_version": a.live_version,
                "policy_version": a.policy_version, "buffered": len(a.replay)}

    def call(self, name: str, *args, **kwargs):
        value = getattr(self.adapter, name)
        return value(*args, **kwargs) if callable(value) else value

    def not_counted(self, begin: bool) -> None:
        """Open (begin) or close the adapter's not_counted() span, one call each across Ray."""
        if begin:
            self._not_counted = self.adapter.not_counted()
            self._not_counted.__enter__()
        elif getattr(self, "_not_counted", None) is not None:
            span, self._not_counted = self._not_counted, None
            span.__exit__(None, None, None)


class RemoteAdapter:
    """A DraftAdapter in a Ray actor of its own, called as if it were here (every method blocks
    for its result). ``handover(policy)`` hooks your policy in this process; observe sends the
    rows it took. ``actor_options``: Ray's (``max_restarts``/``max_task_retries`` -1 by default:
    a dead adapter comes back, resumes from its newest draft, and the call is retried)."""

    def __init__(self, policy_dir: str | Path, draft_dir: str | Path, out_dir: str | Path, cfg=None,
                 actor_options: dict[str, Any] | None = None, threads: int | None = None):
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init(...) (or connect to your cluster) first")
        from draftadapt.adapter import AdapterConfig
        from draftadapt.data.store import DraftStore

        self.cfg = (cfg or AdapterConfig()).with_run_defaults()  # as the DraftAdapter in the actor
        self.out_dir = Path(out_dir)
        options = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1, **(actor_options or {})}
        self.actor = ray.remote(AdapterServer).options(**options).remote(
            str(policy_dir), str(draft_dir), str(out_dir), self.cfg, threads)
        self._handover_settings = ray.get(self.actor.handover_settings.remote())
        # the drafts it publishes, read where this process sees its out_dir (same node or shared FS)
        self._store = DraftStore(out_dir, readonly=True)

    @property
    def store(self):
        """The adapter's draft store, read here, with every version it published written (as
        DraftAdapter.store: its background writes are waited for)."""
        self.wait_published()
        return self._store

    def wait_published(self, max_policy_version: int | None = None) -> None:
        self._call("wait_published", max_policy_version)

    def _call(self, name: str, *args, **kwargs):
        return _ray().get(self.actor.call.remote(name, *args, **kwargs))

    def handover(self, policy, subset=None):
        from draftadapt.capture.hidden import HandOver

        s = self._handover_settings
        return HandOver(policy, s["aux_layer_ids"], s["draft_to_target"], s["temperature"], store=s["store"],
                        subset=subset)

    def observe(self, rollouts, policy_version: int, handover=None, **kwargs) -> int:
        ho = None if handover is None else handover.detach()
        return _ray().get(self.actor.observe.remote(list(rollouts), policy_version, ho, **kwargs))

    def update_policy(self, weights, version: int) -> None:
        _ray().get(self.actor.update_policy.remote(_put_once(weights) if isinstance(weights, dict) else weights,
                                                   version))

    def report_measured(self, acceptance_length: float, first_rate: float | None = None,
                        positions: int | None = None) -> None:
        self._call("report_measured", acceptance_length, first_rate, positions)

    @contextlib.contextmanager
    def not_counted(self):
        """As DraftAdapter.not_counted: the span is off the actor's cost clock."""
        _ray().get(self.actor.not_counted.remote(True))
        try:
            yield
        finally:
            _ray().get(self.actor.not_counted.remote(False))

    def run_round(self, force: bool = False) -> dict[str, float]:
        return self._call("run_round", force)

    def start_round(self, force: bool = False) -> None:
        self._call("start_round", force)

    def finish_round(self) -> dict[str, float]:
        return self._call("finish_round")

    def newest_package(self, max_policy_version: int, newer_than: int | None = None):
        return self._call("newest_package", max_policy_version, newer_than)

    def simulated_length(self, version: int) -> float | None:
        return self._call("simulated_length", version)

    def swap(self, engine):
        raise TypeError("a RemoteAdapter swaps through a DraftFleet (StepBoundary(adapter, fleet)), "
                        "not into an engine of this process")

    def status(self) -> dict[str, Any]:
        return _ray().get(self.actor.status.remote())

    def close(self) -> None:
        ray = _ray()
        try:
            self._call("close")
        finally:
            ray.kill(self.actor, no_restart=True)
