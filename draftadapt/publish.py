"""What leaves the adapter: published draft versions, and the swaps that put them into engines.

:class:`Publisher` writes the trainer's draft as the next version of a :class:`DraftStore` (atomic,
versioned), keeps it in memory as the live draft, and keeps the trainer state beside it so a
restart over the same directory trains on from it (docs/design.md, "Checks at the door"). A
round's publish copies the draft and the trainer state and hands the write and the hash to a
writer thread, beside the next round (docs/design.md, "Publishing beside the next round").
:class:`EngineSwaps` is the engine side: the newest version an engine may serve swapped in, and
the check after a policy sync that it is still the one serving.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftadapt.data.store import DraftStore, DraftVersion
from draftadapt.drafts.formats import check_identity, model_dtype, target_fingerprint
from draftadapt.fileio import atomic_path
from draftadapt.threads import JobThreads
from draftadapt.train.methods import DraftMethod
from draftadapt.train.trainer import DraftTrainer

log = logging.getLogger("draftadapt.adapter")
# beside the published versions: the trainer state of the newest one (optimizer moments, step)
RESUME_FILE = ".trainer/resume.pt"


def host_copy(obj: Any) -> Any:
    """``obj`` (tensors in dicts, lists and tuples, as a state dict holds them) with every tensor
    copied into host memory: what a writer thread may read while the trainer's next steps update
    the originals in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


@dataclass
class PendingWrite:
    """One version handed to the writer thread: ``written`` resolves when its directory is in the
    store (what a swap of it waits for), ``done`` when the trainer state beside it is saved too."""

    version: int
    policy_version: int
    written: Future = field(default_factory=Future)
    done: Future | None = None


class Publisher:
    """Publishes the trainer's draft for ``policy_dir`` into ``store``; ``live`` is the newest
    published draft (eval mode), as the engine serves it apart from modules shared with the policy.

    ``background``: :meth:`publish` returns once the draft and the trainer state are copied; a
    writer thread (one per write, ended with it: threads.py says why) writes, hashes and renames
    the version into place, then saves the trainer state, while the caller goes on. :meth:`wait`
    is where a caller that reads the store waits for a version, and where a failed write raises.
    False: every publish is written before it returns.
    """

    def __init__(self, store: DraftStore, trainer: DraftTrainer, method: DraftMethod, fmt: str,
                 policy_dir: Path, k: int, background: bool = True):
        self.store = store
        self.trainer = trainer
        self.method = method
        self.format = fmt  # the layout the starting draft came in; every version keeps it
        self.policy_dir = policy_dir
        self.k = k
        self.dtype = model_dtype(policy_dir)  # published drafts follow the target's dtype
        self.resume_path = store.out_dir / RESUME_FILE
        self.live: nn.Module | None = None
        self.live_version: int | None = None  # the store's version of ``live``
        # ZeRO-3 gathers the draft on every rank inside export: the writes stay in the caller's order
        self.background = background and not trainer.is_deepspeed
        self.copy_s = 0.0  # the last publish's time on its caller's path (the copies)
        self.write_s = 0.0  # the last completed background write's time (export, hash, rename, state)
        self._pending: dict[int, PendingWrite] = {}
        self._lock = threading.Lock()  # _pending: a background round publishes, the loop's thread waits
        self._writer: JobThreads | None = None
        self._reserved = 0  # the highest version number handed to the writer

    def write(self, module: nn.Module, policy_version: int, live: nn.Module | None = None) -> int:
        """``module`` as the next version, written before this returns, tagged with the policy
        version it was trained against; it (or ``live``, the same weights on the trainer's device)
        becomes the live draft. Returns the version."""
        self.wait()
        version, _ = self.store.publish(self._exporter(module, policy_version), policy_version=int(policy_version))
        self.live = self._on_trainer_device(module) if live is None else live.eval()
        self.live_version = version
        return version

    def _exporter(self, module: nn.Module, policy_version: int):
        def write(tmp: Path, version: int) -> None:
            self.method.export(module, tmp, self.policy_dir, fmt=self.format, num_speculative_tokens=self.k,
                               meta={"policy_version": int(policy_version), "version": version})
        return write

    def write_trainer(self, policy_version: int) -> int:
        """The trainer's current draft as the next version (:meth:`write`); on a GPU the live
        draft is a copy made on the device, not the exported host copy moved back."""
        on_host = self.trainer.device.type == "cpu"
        return self.write(self.trainer.export_draft(), policy_version, live=None if on_host else self.trainer.live_copy())

    def _on_trainer_device(self, module: nn.Module) -> nn.Module:
        """The live draft is scored against every round's candidate: on a GPU trainer it stays on
        the GPU (scoring an 8B-sized head on the host would take minutes; docs/design.md, "On a GPU")."""
        return module.eval().to(self.trainer.device)

    def publish(self, policy_version: int) -> int:
        """The trainer's current draft as the next version, with the trainer state beside it.
        Returns the version; in the background (``background``) it is in the store once
        :meth:`wait` says so. At most one write is in flight: a publish first waits for the one
        before it (a round per RL step leaves it a whole step)."""
        self.wait()
        t0 = time.perf_counter()
        draft = self.trainer.export_draft()  # host memory: the writer's own copy
        # the writer exports its copy while the live draft is scored and its shared modules refreshed
        on_host = self.trainer.device.type == "cpu"
        live = self._on_trainer_device(draft) if on_host and not self.background else self.trainer.live_copy()
        state = host_copy(self.trainer.resume_state())
        if self.dtype != "float32":  # the published copy is rounded: keep what training holds
            state["weights"] = draft.state_dict()  # the export reads them, nothing writes them
        version = max(self.store.next_version(), self._reserved + 1)
        self._reserved = version
        job = PendingWrite(version, int(policy_version))
        self.live, self.live_version = live, version
        self.copy_s = time.perf_counter() - t0
        if not self.background:
            self._write(job, draft, state)
            return version
        if self._writer is None:
            self._writer = JobThreads("draftadapt-publish")  # a thread per write: threads.py says why
        with self._lock:
            self._pending[version] = job
            job.done = self._writer.submit(self._write, job, draft, state)
        return version

    def _write(self, job: PendingWrite, draft: nn.Module, state: dict[str, Any]) -> None:
        """The writer's part: the version (exported, hashed, renamed into place: visible whole or
        not at all: data/store.py, "Crash safety"), then the trainer state beside it."""
        t0 = time.perf_counter()
        try:
            self.store.publish(self._exporter(draft, job.policy_version), policy_version=job.policy_version,
                               version=job.version)
        except BaseException as exc:
            job.written.set_exception(exc)
            log.error("adapter: writing draft version %d failed: %s", job.version, exc)
            raise
        job.written.set_result(job.version)
        try:
            with atomic_path(self.resume_path) as tmp:
                torch.save({"draft_version": job.version, **state}, tmp)
        except BaseException as exc:
            log.error("adapter: saving the trainer state of version %d failed: %s", job.version, exc)
            raise
        self.write_s = time.perf_counter() - t0

    def wait(self, max_policy_version: int | None = None) -> None:
        """Until the versions published so far are in the store, with their trainer state (None),
        or until the newest of them an engine at ``max_policy_version`` may serve is (a swap waits
        only for the version it swaps). A background write that failed raises here, once."""
        with self._lock:
            pending = sorted(self._pending.values(), key=lambda w: w.version)
        if max_policy_version is None:
            for job in pending:
                job.done.exception()  # waits; what it raised is raised below
        else:
            eligible = [job for job in pending if job.policy_version <= max_policy_version]
            if eligible and eligible[-1].written.exception() is not None:
                eligible[-1].done.exception()  # failed: collected below, raised now
        with self._lock:
            finished = sorted((j for j in self._pending.values() if j.done.done()), key=lambda w: w.version)
            failed = next((j for j in finished if j.done.exception() is not None), None)
            for job in finished:  # up to the first that failed: a later failure raises at the next wait
                if failed is not None and job.version > failed.version:
                    break
                del self._pending[job.version]
        if failed is not None:
            exc = failed.done.exception()
            raise RuntimeError(f"writing draft version {failed.version} (policy {failed.policy_version}) to "
                               f"{self.store.out_dir} failed: {exc}") from exc

    def close(self) -> None:
        """Wait for the writes in flight (raising a failed one's error) and stop the writer."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def resume(self, latest: DraftVersion, load) -> str:
        """After a restart over an existing output dir: the trainer trains on from its newest
        published draft (``load(path)`` reads it), with the trainer state saved beside it when that
        state belongs to that version. Returns what it continued from: "published" (the
        version's weights, fresh optimizer) or "checkpoint" (its weights and trainer state)."""
        check_identity(latest.meta.get("target"), target_fingerprint(self.policy_dir),
                       f"{self.store.out_dir} holds drafts built",
                       f"give this run (policy {self.policy_dir}) its own output directory")
        with torch.random.fork_rng(devices=[]):
            self.live = self._on_trainer_device(load(latest.path))
        self.live_version = latest.version
        self.trainer.reset_to(self.live)
        resumed_from = "published"
        try:
            state = torch.load(self.resume_path, weights_only=True)
        except FileNotFoundError:
            state = None
        except Exception as exc:  # noqa: BLE001 - a damaged state file costs the moments, not the run
            log.warning("adapter: %s is unreadable (%s); resuming version %d with a fresh optimizer",
                        self.resume_path, exc, latest.version)
            state = None
        if state is not None and state.get("draft_version") == latest.version:
            self.trainer.load_resume_state(state)
            if "weights" in state:  # the float32 weights a narrower published copy was rounded from
                with torch.no_grad():
                    self.trainer.draft.load_state_dict(state["weights"])
            resumed_from = "checkpoint"
        log.info("adapter: resumed from version %d (%s)", latest.version, resumed_from)
        return resumed_from


class EngineSwaps:
    """Engine side of one store: swaps in, and what each engine was given, to check it later."""

    def __init__(self, store: DraftStore):
        self.store = store
        # engine -> (checksum read back after our swap, the draft dir it came from)
        self._swapped_in: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def swap(self, engine) -> Any:
        """The newest version the engine may serve, in place (:meth:`DraftStore.swap_newest_into`).
        Returns the SwapResult or None."""
        return self._record(engine, self.store.swap_newest_into(engine))

    def reload(self, engine) -> Any:
        """The newest version the engine may serve, swapped in again even when it serves that
        version already (a draft noticed lost: ``DraftAdapter._lost_draft``). The SwapResult, or
        None when the store holds none it may serve."""
        latest = self.store.latest(max_policy_version=engine.policy_version)
        return None if latest is None else self._record(engine, engine.swap_draft(latest.path))

    def _record(self, engine, res) -> Any:
        """What a swap put into ``engine`` (its checksum read back, the dir), for :meth:`intact`."""
        if res is not None:
            self._swapped_in[engine] = (res.checksum, engine.draft_dir)
        return res

    def intact(self, engine) -> bool:
        """Is the engine's draft still the one last swapped in? Swaps it in again if not.

        Other systems lost their drafts silently on weight sync or sleep/wake (docs/design.md,
        "Failures other systems shipped")."""
        # what this adapter put in (the engine's own record may be what went wrong)
        expected, path = self._swapped_in.get(engine, (engine.live_checksum, engine.draft_dir))
        state = engine.draft_state()
        if expected is None or state["checksum"] == expected:
            return True
        self._record(engine, engine.swap_draft(path))
        return False
