"""The spool reader: the sidecar's side of the spool (format in ``format.py`` and ``docs/spool-format.md``).

    reader = SpoolReader(spool_dir)
    cursor = SpoolCursor.load(state_dir / "cursor.json")        # empty on the first start
    while not reader.finished() or reader.pending(cursor):
        for shard in reader.poll(cursor):                         # malformed shards: quarantined, skipped
            buffer.add_shard(shard)
            cursor.mark(shard.name)
            cursor.save(state_dir / "cursor.json")               # or inside your own state file
        ...

Nothing is deleted on read: a consumer killed at any moment restarts from its saved cursor and
gets every shard it had not recorded, and can rebuild its replay buffer from the shards still in
the spool. Retention is the consumer's explicit call to :meth:`SpoolReader.prune`.

Exactly once: record a shard in the cursor in the same atomic write as what you did with it
(one state file holding both); then a kill between the two cannot replay or lose it.

A cursor is the set of shard names consumed, not a position: writers finish out of order
(several ranks, asynchronous RL), so a shard that completes late with a smaller name than one
already consumed is still delivered.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import load_file

from draftadapt.data.sequences import Sequence
from draftadapt.fileio import atomic_write_bytes, atomic_write_json, file_sha256, fsync_dir
from draftadapt.spool.format import (
    FINISHED_FILE,
    POLICY_DIR,
    POLICY_FORMAT,
    POLICY_NAME_RE,
    QUARANTINE_DIR,
    ROLLOUT_FORMAT,
    ROLLOUT_NAME_RE,
    ROLLOUTS_DIR,
    SpoolFormatError,
    check_manifest,
    check_rollout_tensors,
)
from draftadapt.tensors import load_safetensors

log = logging.getLogger(__name__)

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ShardRef:
    """A complete (manifest present) rollout shard, not yet read or verified."""

    name: str
    step: int
    policy_version: int


@dataclass
class RolloutShard:
    """One verified rollout shard, split per sequence. ``aux_hidden[i]``: [len_i, D], own memory."""

    name: str
    step: int
    policy_version: int
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float] | None
    aux_hidden: list[torch.Tensor] | None
    extra: dict[str, Any]
    manifest: dict[str, Any]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))

    def sequences(self) -> list[Sequence]:
        return [Sequence(p, r) for p, r in zip(self.prompt_ids, self.response_ids)]


@dataclass(frozen=True)
class PolicyRef:
    """A complete (manifest present) policy checkpoint, not yet verified."""

    name: str
    version: int


@dataclass(frozen=True)
class PolicyCheckpoint:
    """A verified policy checkpoint: a directory of HF-named safetensors (and maybe config.json)."""

    name: str
    version: int
    step: int | None
    path: Path
    weight_files: tuple[Path, ...]
    manifest: dict[str, Any]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return load_safetensors(self.weight_files)


class SpoolCursor:
    """The shard names a consumer has incorporated. Save it (atomically) after each shard."""

    def __init__(self, done: Iterable[str] = ()) -> None:
        self.done: set[str] = set(done)

    def __contains__(self, name: object) -> bool:
        return name in self.done

    def __len__(self) -> int:
        return len(self.done)

    def mark(self, shard: RolloutShard | ShardRef | str) -> None:
        self.done.add(shard if isinstance(shard, str) else shard.name)

    def compact(self, existing: Iterable[str]) -> None:
        """Forget names no longer in the spool (after :meth:`SpoolReader.prune`), so the cursor stays small."""
        self.done &= set(existing)

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": 1, "done": sorted(self.done)}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> SpoolCursor:
        if not isinstance(obj, dict) or not isinstance(obj.get("done"), list):
            raise ValueError(f"not a spool cursor: expected {{'done': [names]}}, got {str(obj)[:80]}")
        return cls(obj["done"])

    def save(self, path: str | Path) -> None:
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> SpoolCursor:
        """The cursor saved at ``path``, or an empty one if there is none yet."""
        path = Path(path)
        if not path.is_file():
            return cls()
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, ValueError) as exc:
            # Written atomically, so this is not a torn write: refuse rather than replay everything.
            raise ValueError(f"{path} is not a spool cursor ({exc}); restore it or delete it to reconsume the spool") from None


class SpoolReader:
    """Lists, verifies and loads what a :class:`~draftadapt.spool.writer.SpoolWriter` wrote.

    One consumer per spool (it moves malformed entries to ``quarantine/``). Never deletes
    anything unless asked (:meth:`prune`, :meth:`prune_policies`).
    """

    def __init__(self, spool_dir: str | Path) -> None:
        self.spool_dir = Path(spool_dir)
        self.rollouts_dir = self.spool_dir / ROLLOUTS_DIR
        self.policy_dir = self.spool_dir / POLICY_DIR
        self.quarantine_dir = self.spool_dir / QUARANTINE_DIR
        for d in (self.rollouts_dir, self.policy_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._stuck: set[str] = set()  # entries that could not be moved aside; not retried every poll
        self._policy_ok: dict[str, tuple] = {}  # name -> stat signature of the files last verified

    # ------------------------------------------------------------------ rollouts

    def _scan(self, directory: Path) -> tuple[set[str], set[str]]:
        """(names with a manifest, names of other visible files/dirs) in ``directory``; skips dot-names."""
        manifests, others = set(), set()
        with os.scandir(directory) as it:
            for e in it:
                if e.name.startswith("."):
                    continue
                if e.name.endswith(".json") and e.is_file():
                    manifests.add(e.name[: -len(".json")])
                else:
                    others.add(e.name)
        return manifests, others

    def shards(self) -> list[ShardRef]:
        """Complete rollout shards (manifest present), by (step, policy_version, name). Not verified yet."""
        names, _ = self._scan(self.rollouts_dir)
        refs = []
        for name in names:
            m = ROLLOUT_NAME_RE.match(name)
            if m:
                refs.append(ShardRef(name, int(m.group(1)), int(m.group(2))))
        return sorted(refs, key=lambda r: (r.step, r.policy_version, r.name))

    def pending(self, cursor: SpoolCursor | Iterable[str] | None = None) -> list[ShardRef]:
        """Complete shards not in ``cursor``, in (step, policy_version, name) order."""
        done = cursor.done if isinstance(cursor, SpoolCursor) else set(cursor or ())
        return [r for r in self.shards() if r.name not in done]

    def load(self, shard: ShardRef | str) -> RolloutShard:
        """Read and verify one shard. Raises :class:`SpoolFormatError` (says what is wrong) if it is malformed."""
        name = shard if isinstance(shard, str) else shard.name
        m = ROLLOUT_NAME_RE.match(name)
        if not m:
            raise SpoolFormatError(f"{name}: name does not match r{{step:012d}}-p{{policy_version:09d}}-{{writer}}-{{seq:06d}}")
        step, pv = int(m.group(1)), int(m.group(2))
        man = _read_manifest(self.rollouts_dir / f"{name}.json", ROLLOUT_FORMAT)
        if man["data_file"] != f"{name}.safetensors":
            raise SpoolFormatError(f"{name}: manifest names data file {man['data_file']!r}, expected {name}.safetensors")
        if (man["step"], man["policy_version"]) != (step, pv):
            raise SpoolFormatError(
                f"{name}: manifest says step {man['step']}, policy_version {man['policy_version']}; the name says {step}, {pv}"
            )
        data = self.rollouts_dir / f"{name}.safetensors"
        try:
            _check_sha(name, file_sha256(data), man["sha256"])
        except FileNotFoundError:
            raise SpoolFormatError(f"{name}: manifest present but {data.name} is missing") from None
        try:
            t = load_file(str(data))
        except Exception as exc:  # safetensors raises its own SafetensorError and others
            raise SpoolFormatError(f"{name}: {man['data_file']} is not readable safetensors ({exc})") from None
        n, total, dim = check_rollout_tensors(t, where=name)
        if (n, total) != (man["num_sequences"], man["num_tokens"]):
            raise SpoolFormatError(
                f"{name}: manifest says {man['num_sequences']} sequences / {man['num_tokens']} tokens, "
                f"the arrays hold {n} / {total}"
            )
        if man.get("aux_hidden_dim", dim) != dim:
            raise SpoolFormatError(f"{name}: manifest says aux_hidden_dim {man['aux_hidden_dim']}, the data has {dim}")
        tokens = t["tokens"].tolist()
        offsets = t["offsets"].tolist()
        plens = t["prompt_lens"].tolist()
        prompts, responses = [], []
        for i in range(n):
            seq = tokens[offsets[i] : offsets[i + 1]]
            prompts.append(seq[: plens[i]])
            responses.append(seq[plens[i] :])
        aux = None
        if "aux_hidden" in t:  # each sequence its own copy, so a replay buffer can free it alone
            aux = [t["aux_hidden"][offsets[i] : offsets[i + 1]].clone() for i in range(n)]
        extra = man.get("extra") or {}
        return RolloutShard(
            name=name,
            step=step,
            policy_version=pv,
            prompt_ids=prompts,
            response_ids=responses,
            rewards=t["rewards"].tolist() if "rewards" in t else None,
            aux_hidden=aux,
            extra=extra if isinstance(extra, dict) else {"value": extra},
            manifest=man,
        )

    def poll(self, cursor: SpoolCursor | Iterable[str] | None = None, limit: int | None = None) -> Iterator[RolloutShard]:
        """Yield verified pending shards in order; never raises for a bad shard.

        A malformed shard (bad manifest JSON, sha256 mismatch, unreadable safetensors, arrays
        that disagree) is moved to ``quarantine/`` with ``<name>.reason.txt`` and a logged
        warning; a read error that may pass (I/O) is logged and retried on the next poll.
        """
        self._move_strays()
        yielded = 0
        for ref in self.pending(cursor):
            if limit is not None and yielded >= limit:
                return
            if ref.name in self._stuck:
                continue
            try:
                shard = self.load(ref)
            except SpoolFormatError as exc:
                self.quarantine(ref.name, str(exc))
                continue
            except FileNotFoundError:
                continue  # pruned or quarantined by someone else meanwhile
            except OSError as exc:
                log.warning("spool: could not read %s (%s); will retry", ref.name, exc)
                continue
            except Exception as exc:  # last resort: whatever a shard holds must not stop the consumer
                log.exception("spool: unexpected error reading %s", ref.name)
                self.quarantine(ref.name, f"unexpected error while reading it: {type(exc).__name__}: {exc}")
                continue
            yielded += 1
            yield shard

    def _move_strays(self) -> None:
        """Quarantine manifests whose names break the format, and finish an interrupted quarantine."""
        names, others = self._scan(self.rollouts_dir)
        for name in sorted(names - self._stuck):
            if not ROLLOUT_NAME_RE.match(name):
                self.quarantine(name, f"{name}.json: name does not match r{{step:012d}}-p{{policy_version:09d}}-{{writer}}-{{seq:06d}}")
        if self.quarantine_dir.is_dir():
            for other in others:
                stem = other.removesuffix(".safetensors")
                if stem not in names and (self.quarantine_dir / f"{stem}.reason.txt").is_file():
                    _move(self.rollouts_dir / other, self.quarantine_dir / other)

    def quarantine(self, name: str, reason: str, kind: str = ROLLOUTS_DIR) -> None:
        """Move entry ``name`` (manifest and data) to ``quarantine/`` with ``<name>.reason.txt``; log why."""
        src = self.spool_dir / kind
        log.warning("spool: quarantined %s/%s: %s", kind, name, reason)
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            # Reason first: if we are killed before the data moves, the next poll finishes the move.
            atomic_write_bytes(self.quarantine_dir / f"{name}.reason.txt", f"{time.ctime()}: {reason}\n".encode())
            _move(src / f"{name}.json", self.quarantine_dir / f"{name}.json")
            for data in (src / f"{name}.safetensors", src / name):
                _move(data, self.quarantine_dir / data.name)
            fsync_dir(src)
        except OSError as exc:
            log.error("spool: could not quarantine %s (%s); skipping it from now on", name, exc)
            self._stuck.add(name)

    def quarantined(self) -> dict[str, str]:
        """name -> reason of every quarantined entry."""
        if not self.quarantine_dir.is_dir():
            return {}
        return {
            p.name[: -len(".reason.txt")]: p.read_text().strip()
            for p in sorted(self.quarantine_dir.glob("*.reason.txt"))
        }

    # ------------------------------------------------------------------ policy checkpoints

    def policies(self) -> list[PolicyRef]:
        """Complete policy checkpoints (manifest present), by (version, name). Not verified yet."""
        names, _ = self._scan(self.policy_dir)
        refs = [PolicyRef(n, int(m.group(1))) for n in names if (m := POLICY_NAME_RE.match(n))]
        return sorted(refs, key=lambda r: (r.version, r.name))

    def load_policy(self, ref: PolicyRef | str) -> PolicyCheckpoint:
        """Verify a policy checkpoint (every file's sha256). Raises :class:`SpoolFormatError`."""
        name = ref if isinstance(ref, str) else ref.name
        m = POLICY_NAME_RE.match(name)
        if not m:
            raise SpoolFormatError(f"{name}: name does not match p{{version:09d}}-{{writer}}-{{seq:06d}}")
        man = _read_manifest(self.policy_dir / f"{name}.json", POLICY_FORMAT)
        if man.get("version") != int(m.group(1)):
            raise SpoolFormatError(f"{name}: manifest says version {man.get('version')}, the name {int(m.group(1))}")
        files = man.get("files")
        if not isinstance(files, dict) or not any(str(f).endswith(".safetensors") for f in files):
            raise SpoolFormatError(f"{name}: manifest 'files' must map file names to sha256, with at least one .safetensors")
        d = self.policy_dir / name
        sig = []
        for fname in files:
            p = d / fname
            if Path(fname).name != fname or not p.is_file():
                raise SpoolFormatError(f"{name}: {fname} is listed in the manifest but missing from {d}")
            st = p.stat()
            sig.append((fname, st.st_ino, st.st_size, st.st_mtime_ns))
        if self._policy_ok.get(name) != tuple(sig):  # hash each checkpoint once, not on every poll
            for fname, entry in files.items():
                want = entry.get("sha256") if isinstance(entry, dict) else entry
                if not isinstance(want, str) or file_sha256(d / fname) != want:
                    raise SpoolFormatError(f"{name}: {fname} does not match its sha256 in the manifest (truncated or changed)")
            self._policy_ok[name] = tuple(sig)
        weights = tuple(sorted(d / f for f in files if f.endswith(".safetensors")))
        return PolicyCheckpoint(name, man["version"], man.get("step"), d, weights, man)

    def latest_policy(self, max_version: int | None = None, newer_than: int | None = None) -> PolicyCheckpoint | None:
        """The newest valid checkpoint with ``newer_than < version <= max_version``; bad ones are quarantined."""
        for ref in reversed(self.policies()):
            if max_version is not None and ref.version > max_version:
                continue
            if newer_than is not None and ref.version <= newer_than:
                return None
            ckpt = self._try_policy(ref)
            if ckpt is not None:
                return ckpt
        return None

    def policy(self, version: int) -> PolicyCheckpoint | None:
        """The valid checkpoint of exactly ``version`` (the newest written, if several), or None."""
        for ref in reversed(self.policies()):
            if ref.version == version and (ckpt := self._try_policy(ref)) is not None:
                return ckpt
        return None

    def _try_policy(self, ref: PolicyRef) -> PolicyCheckpoint | None:
        if ref.name in self._stuck:
            return None
        try:
            return self.load_policy(ref)
        except SpoolFormatError as exc:
            self.quarantine(ref.name, str(exc), kind=POLICY_DIR)
        except OSError as exc:
            log.warning("spool: could not read policy %s (%s); will retry", ref.name, exc)
        return None

    # ------------------------------------------------------------------ end of run, retention

    def finished(self) -> bool:
        """True once the RL side called ``SpoolWriter.finish()``; drain ``pending()`` after seeing it."""
        return (self.spool_dir / FINISHED_FILE).is_file()

    def prune(
        self,
        cursor: SpoolCursor,
        before_policy_version: int | None = None,
        before_step: int | None = None,
        partial_older_than_s: float | None = None,
    ) -> list[str]:
        """Delete consumed shards (in ``cursor``) older than the given bounds; return their names.

        Never deletes a shard the cursor does not hold. ``partial_older_than_s``: also delete
        leftovers of killed writers (temp files, data without a manifest) older than that many
        seconds; make it longer than any write takes. Afterwards ``cursor.compact(...)`` keeps
        the cursor small.
        """
        removed = []
        for ref in self.shards():
            if ref.name not in cursor:
                continue
            if before_policy_version is not None and ref.policy_version >= before_policy_version:
                continue
            if before_step is not None and ref.step >= before_step:
                continue
            # Manifest first: the shard vanishes from listings at once, the data follows.
            (self.rollouts_dir / f"{ref.name}.json").unlink(missing_ok=True)
            (self.rollouts_dir / f"{ref.name}.safetensors").unlink(missing_ok=True)
            removed.append(ref.name)
        if partial_older_than_s is not None:
            self._remove_partials(partial_older_than_s)
        if removed:
            fsync_dir(self.rollouts_dir)
        return removed

    def prune_policies(self, keep_last: int = 1, before_version: int | None = None) -> list[str]:
        """Delete policy checkpoints except the newest ``keep_last`` (and those >= ``before_version``)."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the sidecar needs a policy), got {keep_last}")
        refs = self.policies()[:-keep_last]
        removed = []
        for ref in refs:
            if before_version is not None and ref.version >= before_version:
                continue
            (self.policy_dir / f"{ref.name}.json").unlink(missing_ok=True)
            shutil.rmtree(self.policy_dir / ref.name, ignore_errors=True)
            self._policy_ok.pop(ref.name, None)
            removed.append(ref.name)
        if removed:
            fsync_dir(self.policy_dir)
        return removed

    def _remove_partials(self, older_than_s: float) -> None:
        cutoff = time.time() - older_than_s
        for directory in (self.rollouts_dir, self.policy_dir):
            names, _ = self._scan(directory)
            for p in directory.iterdir():
                if not p.name.startswith(".") and p.name.endswith(".json"):
                    continue  # a manifest
                if p.name.removesuffix(".safetensors") in names:
                    continue  # the data of a complete entry
                try:
                    if p.stat().st_mtime > cutoff:
                        continue
                    log.info("spool: removing %s, left by an interrupted write", p)
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                except FileNotFoundError:
                    pass


def _read_manifest(path: Path, fmt: str) -> dict[str, Any]:
    try:
        man = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpoolFormatError(f"{path.name}: manifest is not valid JSON ({exc})") from None
    return check_manifest(man, fmt, where=path.name)


def _check_sha(name: str, got: str, want: Any) -> None:
    if not isinstance(want, str) or not _SHA_RE.match(want):
        raise SpoolFormatError(f"{name}: manifest sha256 {want!r} is not 64 lowercase hex digits")
    if got != want:
        raise SpoolFormatError(f"{name}: data sha256 {got[:12]}... does not match the manifest's {want[:12]}... (truncated or corrupt)")


def _move(src: Path, dst: Path) -> None:
    """os.replace that tolerates a missing source (already moved) and an existing directory target."""
    try:
        if src.is_dir() and dst.exists():
            shutil.rmtree(dst)
        os.replace(src, dst)
    except FileNotFoundError:
        pass
