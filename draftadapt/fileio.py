"""Crash-safe file writes and checksums, shared by every on-disk format in the package.

The rule everywhere: write under a temp name in the same directory, fsync, rename. A reader sees
the old file or the new one, never half of one, and the rename survives a power loss once the
directory itself is fsynced (``fsync_dir``). Standard library only, so any module may import it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@functools.cache
def _umask() -> int:
    """The process's umask, read at the first atomic write (importing this module changes nothing
    in the process). Linux reports it in /proc without touching it; elsewhere os.umask can only
    read it by setting it, so it is set to a private mask for that instant (a file another thread
    creates then is private, never world-writable) and put straight back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


# Digests this process computed, by file identity (device, inode, size, mtime and ctime in ns):
# a file this process wrote and hashed (a draft it just published) is not hashed again when this
# process loads it. A rename keeps the identity; any write to the file changes it.
_DIGESTS: OrderedDict[tuple[int, ...], str] = OrderedDict()
_MAX_DIGESTS = 256


def _identity(path: str | Path) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    ident = _identity(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    digest = h.hexdigest()
    if _identity(path) == ident:  # unchanged while it was read: the digest is this file's
        _DIGESTS[ident] = digest
        _DIGESTS.move_to_end(ident)
        while len(_DIGESTS) > _MAX_DIGESTS:
            _DIGESTS.popitem(last=False)
    return digest


def known_sha256(path: str | Path) -> str | None:
    """The sha256 this process computed for exactly this file, if it did (else None)."""
    try:
        return _DIGESTS.get(_identity(path))
    except OSError:
        return None


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under ``root`` (before one rename publishes them all)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


@contextmanager
def atomic_path(path: str | Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temp path beside ``path``; once the block has written it, fsync it and rename it to
    ``path``. If the block raises, the temp file is removed and ``path`` is untouched.

    Temp names are ``.{name}.{random}.tmp`` (hidden; store and spool recovery sweep them).
    ``durable=False`` skips the fsync, for caches that a crash may lose but must not corrupt.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if durable:
            fsync_file(tmp)
        # mkstemp creates 0600; the RL run, the sidecar and the engine may be different users.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())
