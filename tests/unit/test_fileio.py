"""Atomic writes leave files with the modes a plain write would give them."""

from __future__ import annotations

import os
import stat

from draftadapt import fileio


def test_atomic_write_follows_the_umask_read_at_first_use(tmp_path):
    # mkstemp creates 0600; the rename must not leave a file the engine's user cannot read
    before = os.umask(0o027)
    fileio._umask.cache_clear()
    try:
        fileio.atomic_write_bytes(tmp_path / "a.bin", b"x")
        assert fileio._umask() == 0o027
    finally:
        os.umask(before)
        fileio._umask.cache_clear()
    assert stat.S_IMODE((tmp_path / "a.bin").stat().st_mode) == 0o640
    assert not list(tmp_path.glob(".*.tmp"))
