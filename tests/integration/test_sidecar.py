"""The sidecar as a real process: SIGKILLed at random moments and restarted, it loses no spooled
rollout, never exposes a half-written draft, only grows versions, and sets malformed shards aside."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from draftadapt.data.store import DraftStore
from draftadapt.fileio import file_sha256
from draftadapt.draft_init import init_draft
from draftadapt.spool import SpoolCursor, SpoolReader, SpoolWriter
from draftadapt.toy.model import build_model

from .conftest import TINY, start_sidecar, tiny_target, write_shard

pytestmark = pytest.mark.integration


def check_store(out: Path, seen: list[int]) -> list[int]:
    """Every visible version is complete and sha-valid; nothing visible ever disappears or shrinks."""
    store = DraftStore(out, readonly=True)
    versions = store.versions()
    for v in versions:
        dv = store.get(v)
        assert dv is not None, f"version {v} is visible but incomplete"
        assert file_sha256(dv.weights) == dv.meta["sha256"]
        assert dv.meta["version"] == v
    assert set(seen) <= set(versions), (seen, versions)
    assert versions == sorted(set(versions))
    return versions


def test_sigkill_loses_nothing_and_quarantines_bad_shards(tmp_path):
    rng = random.Random(0)
    target = tiny_target(tmp_path / "target")
    draft = init_draft(target, "eagle3", tmp_path / "draft0", draft_vocab=32)
    spool, out = tmp_path / "spool", tmp_path / "drafts"
    writer = SpoolWriter(spool, writer_id="rl")
    good: list[str] = []
    step = 0

    def produce(n):
        nonlocal step
        for _ in range(n):
            good.append(write_shard(writer, step, rng).stem)  # the manifest's stem is the shard name
            step += 1

    produce(3)
    # a malformed shard: its tensors do not match the manifest's sha256
    bad = write_shard(writer, 99, rng)
    data_file = bad.with_suffix(".safetensors")
    data = bytearray(data_file.read_bytes())
    data[-8:] = b"\xff" * 8
    data_file.write_bytes(bytes(data))
    bad_name = bad.stem

    # the policy moves on: the sidecar must pick up the checkpoint
    moved = {k: v + 0.01 for k, v in build_model(TINY, seed=0)
             .state_dict().items()}
    writer.write_policy(1, moved)

    log = open(tmp_path / "sidecar.log", "w")
    seen: list[int] = []
    kills = 0
    kill_rng = random.Random(1)
    for round_ in range(4):
        proc = start_sidecar(spool, out, target, draft, log)
        time.sleep(kill_rng.uniform(4.0, 12.0))
        produce(2)
        time.sleep(kill_rng.uniform(0.5, 3.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
        seen = check_store(out, seen)
    assert kills >= 3

    writer.finish()
    proc = start_sidecar(spool, out, target, draft, log)
    rc = proc.wait(timeout=600)
    log.close()
    assert rc == 0, (tmp_path / "sidecar.log").read_text()[-3000:]
    versions = check_store(out, seen)

    state = json.loads((out / ".sidecar" / "state.json").read_text())
    cursor = SpoolCursor.from_dict(state["cursor"])
    consumed = {name for name in good if name in cursor}
    assert consumed == set(good), f"lost shards: {sorted(set(good) - consumed)}"
    assert state["policy_version"] == 1
    reader = SpoolReader(spool)
    reasons = reader.quarantined()
    assert bad_name in reasons and "sha256" in reasons[bad_name], reasons
    assert versions and versions[0] == 1 and len(versions) >= 2  # the start draft + trained versions
    # the newest draft is one vLLM accepts for this target (checked without an engine start)
    from draftadapt.drafts.formats import check_draft_for_target

    check_draft_for_target(DraftStore(out, readonly=True).latest().path, target)
