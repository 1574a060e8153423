"""Versioned draft store: how drafts are published, and how the engine side finds the newest one.

    store = DraftStore("runs/rl/drafts")
    version, path = store.publish(lambda d, v: export_eagle3(head, d, target), policy_version=7)
    ...
    # engine side (another process), between generate calls:
    new = DraftStore("runs/rl/drafts", readonly=True).latest(max_policy_version=engine.policy_version,
                                                              newer_than=engine.draft_version)
    if new is not None:
        engine.swap_draft(new.path)

Layout: ``OUT/v{version:06d}/`` holds ``config.json``, ``model.safetensors`` and the manifest
``draftadapt.json`` (``sha256`` of model.safetensors, ``version``, ``policy_version`` and
whatever the exporter wrote: method, format, target fingerprint...) and ``lineage``, the store's
own id (``OUT/STORE``, made at its first publish): version numbers compare only within one
lineage, so an engine refuses an older version of the lineage it serves but takes any version of
another store (docs/design.md, "Swap refusals"). ``OUT/LATEST`` (JSON) names the newest version
published; it is a hint for people and scripts, ``latest()`` reads the dirs.

Crash safety: a version is written into ``OUT/.tmp-v.../``, every file and the directory are
fsynced, then the directory is renamed to ``v{version:06d}`` (atomic), so a visible version dir
is always complete; a kill at any moment leaves at most a temp dir, removed by the next writer.
Versions strictly increase: the next one is above every version dir present and above LATEST,
and an ``flock`` on ``OUT/.lock`` serialises publishers, also across processes. ``latest()``
checks the sha256 before returning a version and skips one that fails.

Asynchronous RL: ``latest(max_policy_version=v)`` only returns drafts trained against policy
<= v, so an engine that still serves policy v never gets a draft trained on v + 1.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.fileio import atomic_write_json, file_sha256, fsync_dir, fsync_tree

log = logging.getLogger(__name__)

LATEST_FILE = "LATEST"
LOCK_FILE = ".lock"
VERSION_RE = re.compile(r"^v(\d{6,})$")
_TEMP_PREFIXES = (".tmp-v", ".trash-v")
STORE_FILE = "STORE"
RESERVED_META = ("version", "policy_version", "sha256", "lineage")


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


@dataclass(frozen=True)
class DraftVersion:
    """A complete, sha-verified published draft."""

    version: int
    policy_version: int
    path: Path  # the version directory: give it to RolloutEngine.swap_draft
    meta: dict[str, Any]  # its draftadapt.json

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE


class DraftStore:
    """Publishes drafts as numbered, complete, verified directories under ``out_dir``.

    ``readonly=True`` (the engine side): never creates, locks or removes anything.
    Otherwise the directory is created and leftovers of a killed publisher are removed, unless
    another process is publishing right now (it holds the lock; its temp dir is live).
    """

    def __init__(self, out_dir: str | Path, readonly: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.readonly = readonly
        self._verified: dict[int, tuple] = {}  # version -> stat signature of the files last verified
        self._bad: dict[int, tuple] = {}  # version -> signature that failed (logged once)
        if not readonly:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = self._lock(blocking=False)
            if fd is not None:
                try:
                    self._recover()
                finally:
                    os.close(fd)

    # ------------------------------------------------------------------ publish

    def publish(
        self,
        source: Callable[[Path, int], Any] | str | Path,
        policy_version: int,
        extra_meta: dict[str, Any] | None = None,
        version: int | None = None,
    ) -> tuple[int, Path]:
        """Write a new version; return ``(version, path)``.

        ``source``: a function ``write(dir, version)`` that writes the draft into ``dir`` (e.g.
        ``lambda d, v: export_eagle3(head, d, target)``), or a draft directory to copy. It must
        produce ``model.safetensors``; the manifest ``draftadapt.json`` is written (or completed,
        if the exporter wrote one) last, with ``sha256``, ``version``, ``policy_version``,
        ``published_unix`` and ``extra_meta``.

        ``version``: the number to publish under, reserved beforehand (:meth:`next_version`; a
        background writer's caller needs it before the write): refused when a version at or
        above it is there already (another publisher wrote to this store meanwhile). None: the
        next one.
        """
        if self.readonly:
            raise RuntimeError(f"{self.out_dir}: this DraftStore was opened readonly; open it without readonly to publish")
        if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        extra_meta = dict(extra_meta or {})
        clash = [k for k in RESERVED_META if k in extra_meta]
        if clash:
            raise ValueError(f"extra_meta may not set {clash}: the store writes them")
        if not callable(source) and not Path(source, WEIGHTS_FILE).is_file():
            raise ValueError(f"{source} has no {WEIGHTS_FILE}; publish a draft directory or a function that writes one")
        fd = self._lock(blocking=True)
        try:
            self._recover()
            next_version = self.next_version()
            if version is None:
                version = next_version
            elif version < next_version:
                raise ValueError(f"{self.out_dir}: version {version} was reserved but the store is at "
                                 f"{next_version - 1} already; another publisher wrote to it meanwhile "
                                 "(give each adapter its own output directory)")
            tmp = self.out_dir / f".tmp-{version_dir_name(version)}-{os.getpid()}-{secrets.token_hex(3)}"
            try:
                if callable(source):
                    tmp.mkdir()
                    source(tmp, version)
                else:
                    shutil.copytree(source, tmp)
                weights = tmp / WEIGHTS_FILE
                if not weights.is_file():
                    raise ValueError(f"the publish function wrote no {WEIGHTS_FILE} into the directory it was given")
                meta_path = tmp / META_FILE
                meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
                meta.update(extra_meta)
                meta.update(
                    version=version,
                    policy_version=policy_version,
                    lineage=self._lineage(),
                    sha256=file_sha256(weights),
                    published_unix=time.time(),
                )
                fsync_tree(tmp)
                atomic_write_json(meta_path, meta)  # last inside the dir
                fsync_dir(tmp)
                final = self.out_dir / version_dir_name(version)
                os.rename(tmp, final)  # the commit point: the version appears whole
                # just hashed: the first get() need not read it again (same inode, size, mtime)
                ms, ws = (final / META_FILE).stat(), (final / WEIGHTS_FILE).stat()
                self._verified[version] = (ms.st_ino, ms.st_mtime_ns, ws.st_ino, ws.st_size, ws.st_mtime_ns)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            fsync_dir(self.out_dir)
            self._write_latest(version, policy_version)
        finally:
            os.close(fd)
        return version, final

    # ------------------------------------------------------------------ read

    def latest(self, max_policy_version: int | None = None, newer_than: int | None = None) -> DraftVersion | None:
        """The newest complete, sha-valid version trained against policy <= ``max_policy_version``.

        ``newer_than``: the version the caller already serves; returns None unless a newer one
        qualifies (versions only grow on the engine side).
        """
        for version in reversed(self._dir_versions()):
            if newer_than is not None and version <= newer_than:
                return None
            if max_policy_version is not None:  # cheap check first: skip hashing what cannot qualify
                pv = _peek_policy_version(self.out_dir / version_dir_name(version))
                if pv is None or pv > max_policy_version:
                    continue
            dv = self.get(version)
            if dv is not None and (max_policy_version is None or dv.policy_version <= max_policy_version):
                return dv
        return None

    @property
    def lineage(self) -> str | None:
        """This store's id (``OUT/STORE``), or None before its first publish."""
        try:
            lineage = json.loads((self.out_dir / STORE_FILE).read_text())["lineage"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            return None
        return lineage if isinstance(lineage, str) and lineage else None

    def swap_newest_into(self, engine):
        """Engine side, between generate calls: swap this store's newest version the engine may
        serve into it, in place. Returns the engine's SwapResult, or None when there is nothing to do.

        Never a draft trained on a newer policy than ``engine.policy_version`` (asynchronous RL: the
        engine may still serve v-1 while the adapter trained against v), never the version of this
        store the engine serves or an older one. A draft from elsewhere (the engine's starting
        draft) does not count, whatever its version number: versions compare within a lineage.
        """
        lineage = self.lineage
        served = engine.served_version(lineage) if lineage is not None else None
        latest = self.latest(max_policy_version=engine.policy_version, newer_than=served)
        return None if latest is None else engine.swap_draft(latest.path)

    def versions(self) -> list[int]:
        """Complete, sha-valid versions, ascending."""
        return [v for v in self._dir_versions() if self.get(v) is not None]

    def get(self, version: int) -> DraftVersion | None:
        """Version ``version`` if its directory is complete and its weights match the manifest's sha256, else None."""
        path = self.out_dir / version_dir_name(version)
        try:
            meta_path, weights = path / META_FILE, path / WEIGHTS_FILE
            ms, ws = meta_path.stat(), weights.stat()
            sig = (ms.st_ino, ms.st_mtime_ns, ws.st_ino, ws.st_size, ws.st_mtime_ns)
            if self._bad.get(version) == sig:
                return None
            meta = json.loads(meta_path.read_text())
            problem = _meta_problem(meta, version)
            if problem is None and self._verified.get(version) != sig:
                # Hash once per file state: the engine polls this between generate calls.
                if file_sha256(weights) != meta["sha256"]:
                    problem = f"{weights} does not match the sha256 in its {META_FILE}"
            if problem is not None:
                log.warning("draft store: skipping %s: %s", path, problem)
                self._bad[version] = sig
                return None
            self._verified[version] = sig
            return DraftVersion(version, meta["policy_version"], path, meta)
        except FileNotFoundError:
            return None  # pruned meanwhile, or not a complete draft dir
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
            log.warning("draft store: skipping %s: %s", path, exc)
            return None

    # ------------------------------------------------------------------ retention

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the newest ``keep_last`` valid versions (older dirs, valid or not); return what went."""
        if self.readonly:
            raise RuntimeError(f"{self.out_dir}: opened readonly; cannot prune")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        fd = self._lock(blocking=True)
        try:
            valid = self.versions()
            if len(valid) <= keep_last:
                return []
            cutoff = valid[-keep_last]
            removed = []
            for v in self._dir_versions():
                if v >= cutoff:
                    break
                # Rename first so no reader ever sees a half-deleted version dir.
                trash = self.out_dir / f".trash-{version_dir_name(v)}-{secrets.token_hex(3)}"
                os.rename(self.out_dir / version_dir_name(v), trash)
                shutil.rmtree(trash, ignore_errors=True)
                self._verified.pop(v, None)
                removed.append(v)
            fsync_dir(self.out_dir)
            return removed
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ internals

    def _dir_versions(self) -> list[int]:
        if not self.out_dir.is_dir():
            return []
        found = []
        with os.scandir(self.out_dir) as it:
            for e in it:
                m = VERSION_RE.match(e.name)
                if m and e.is_dir():
                    found.append(int(m.group(1)))
        return sorted(found)

    def next_version(self) -> int:
        """The version the next publish gets: above every version dir present and above LATEST."""
        top = max(self._dir_versions(), default=0)
        return max(top, self._read_latest()) + 1

    def _lineage(self) -> str:
        """This store's id (under the lock): read from ``OUT/STORE``, made on first use."""
        lineage = self.lineage
        if lineage is None:
            lineage = secrets.token_hex(8)
            atomic_write_json(self.out_dir / STORE_FILE, {"lineage": lineage})
        return lineage

    def _read_latest(self) -> int:
        try:
            return int(json.loads((self.out_dir / LATEST_FILE).read_text())["version"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            return 0

    def _write_latest(self, version: int, policy_version: int) -> None:
        atomic_write_json(
            self.out_dir / LATEST_FILE,
            {"version": version, "policy_version": policy_version, "dir": version_dir_name(version)},
        )
        fsync_dir(self.out_dir)

    def _lock(self, blocking: bool) -> int | None:
        fd = os.open(self.out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _recover(self) -> None:
        """Under the lock: remove a killed publisher's temp dirs and bring LATEST up to date."""
        for p in self.out_dir.iterdir():
            is_temp = p.name.startswith(_TEMP_PREFIXES)
            is_latest_tmp = p.name.startswith(f".{LATEST_FILE}.") and p.name.endswith(".tmp")
            if is_temp or is_latest_tmp:
                log.info("draft store: removing %s, left by an interrupted publish", p)
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        # Killed between the rename and LATEST: the version is there and valid, LATEST lags.
        top = max(self._dir_versions(), default=0)
        if top > self._read_latest():
            dv = self.get(top)
            if dv is not None:
                self._write_latest(top, dv.policy_version)


def _peek_policy_version(path: Path) -> int | None:
    try:
        pv = json.loads((path / META_FILE).read_text()).get("policy_version")
    except (OSError, ValueError, AttributeError):
        return None
    return pv if isinstance(pv, int) else None


def _meta_problem(meta: Any, version: int) -> str | None:
    if not isinstance(meta, dict):
        return f"{META_FILE} is not a JSON object"
    if meta.get("version") != version:
        return f"{META_FILE} says version {meta.get('version')!r}, the directory is {version_dir_name(version)}"
    pv = meta.get("policy_version")
    if isinstance(pv, bool) or not isinstance(pv, int) or pv < 0:
        return f"{META_FILE} has no valid policy_version ({pv!r})"
    if not isinstance(meta.get("sha256"), str):
        return f"{META_FILE} has no sha256"
    return None


@dataclass(frozen=True)
class DraftPackage:
    """A published version's files as bytes: what crosses to an engine with no shared filesystem
    (a Ray object, put once for every engine). The engine writes it back into a version
    directory of its own and swaps that in, so every check of the swap (sha256, lineage, target,
    shapes, finite) runs against these very bytes."""

    version: int
    policy_version: int
    lineage: str | None
    files: dict[str, bytes]

    @classmethod
    def read(cls, dv: DraftVersion) -> "DraftPackage":
        files = {p.name: p.read_bytes() for p in sorted(dv.path.iterdir()) if p.is_file()}
        return cls(dv.version, dv.policy_version, dv.meta.get("lineage"), files)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())

    def write(self, root: str | Path) -> Path:
        """Into ``root/v{version:06d}/`` (complete or absent: written aside, then renamed);
        an existing copy is reused. Returns the directory."""
        final = Path(root) / version_dir_name(self.version)
        if final.is_dir():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(3)}"
        tmp.mkdir()
        for name, data in self.files.items():
            if "/" in name or name.startswith("."):
                shutil.rmtree(tmp)
                raise ValueError(f"draft package v{self.version} holds a file named {name!r}; not written")
            (tmp / name).write_bytes(data)
        os.replace(tmp, final)
        return final
