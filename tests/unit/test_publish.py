"""A round's publish written beside the next round (AdapterConfig.publish_background; docs/design.md,
"Publishing beside the next round"): the round returns once the draft and the trainer state are
copied, a swap waits only for the version it swaps, a failed write raises at the next wait, a
writer killed before the manifest leaves the previous version the newest, close() waits.

The adapter, the store and the writer are the real ones on the toy target; the writer is held at
a gate (its real export, then a wait) so the tests can look while it is under way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from draftadapt.data.store import DraftStore
from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py

REPO = Path(__file__).resolve().parents[2]


def make_adapter(toy_target, tmp_path, name="run", **cfg):
    from draftadapt.adapter import AdapterConfig, DraftAdapter
    from draftadapt.draft_init import init_draft

    draft0 = tmp_path / "draft0"
    if not draft0.exists():
        init_draft(toy_target, "eagle3", draft0, seed=0)
    return DraftAdapter(toy_target, draft0, tmp_path / name, AdapterConfig(method="eagle3", **cfg))


def hold_writes(publisher, fail: Exception | None = None):
    """The writer exports for real, then waits at the gate (or raises ``fail``). Returns (started, gate)."""
    started, gate = threading.Event(), threading.Event()
    real = publisher._exporter

    def exporter(module, policy_version):
        write = real(module, policy_version)

        def held(tmp, version):
            write(tmp, version)
            started.set()
            assert gate.wait(60), "the test never opened the gate"
            if fail is not None:
                raise fail
        return held

    publisher._exporter = exporter
    return started, gate


def train_a_little(adapter):
    """Move the trainer's draft off the published one: a version with other weights."""
    with torch.no_grad():
        for p in adapter.trainer.draft.parameters():
            if p.requires_grad:
                p.add_(0.01)


class EngineStandIn:
    """What DraftStore.swap_newest_into asks of an engine (the swap into a real engine runs in
    tests/integration): the policy it serves, the version it serves, and the swap itself."""

    def __init__(self, policy_version: int):
        self.policy_version = policy_version
        self.draft_dir: Path | None = None
        self.swapped: list[int] = []

    def served_version(self, lineage):
        return self.swapped[-1] if self.swapped else None

    def swap_draft(self, path: Path):
        meta = json.loads((Path(path) / META_FILE).read_text())
        self.swapped.append(meta["version"])
        self.draft_dir = Path(path)
        return SimpleNamespace(version=meta["version"], checksum=meta["sha256"], ms=0.0)


def in_thread(fn):
    """Run ``fn`` in a thread; returns (thread, box) where box holds its result or error."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_a_swap_waits_for_the_version_it_swaps_and_only_for_it(toy_target, tmp_path):
    adapter = make_adapter(toy_target, tmp_path)
    assert adapter.store.latest().version == 1  # the starting draft, written before the constructor returns
    train_a_little(adapter)
    started, gate = hold_writes(adapter.publisher)
    t0 = time.perf_counter()
    version = adapter.publisher.publish(policy_version=3)
    assert version == 2 and time.perf_counter() - t0 < 5
    assert started.wait(60)
    assert not (tmp_path / "run" / "v000002").exists()

    # an engine still at policy 2 may not serve version 2: its swap does not wait for it
    behind = EngineStandIn(policy_version=2)
    res = adapter.swap(behind)
    assert res.version == 1 and behind.swapped == [1]

    # an engine at policy 3 swaps version 2: it waits until the version is in the store
    current = EngineStandIn(policy_version=3)
    t, box = in_thread(lambda: adapter.swap(current))
    t.join(1.0)
    assert t.is_alive() and current.swapped == []
    gate.set()
    t.join(60)
    assert "error" not in box, box.get("error")
    assert box["result"].version == 2 and current.swapped == [2]
    latest = DraftStore(tmp_path / "run", readonly=True).latest()  # sha256 checked against its manifest
    assert latest.version == 2 and latest.policy_version == 3
    adapter.close()


def test_the_background_write_is_the_synchronous_one(toy_target, tmp_path):
    """The same trainer state published both ways: the same weights and the same trainer state file."""
    written = {}
    for background in (True, False):
        adapter = make_adapter(toy_target, tmp_path, name=f"bg{background}", publish_background=background)
        train_a_little(adapter)
        version = adapter.publisher.publish(policy_version=1)
        train_a_little(adapter)  # the next round's steps, while the writer may still be at it
        adapter.wait_published()
        out = tmp_path / f"bg{background}"
        written[background] = (load_file(str(out / f"v{version:06d}" / WEIGHTS_FILE)),
                               torch.load(out / ".trainer" / "resume.pt", weights_only=True))
        adapter.close()
    (w_bg, s_bg), (w_sync, s_sync) = written[True], written[False]
    assert w_bg.keys() == w_sync.keys()
    for name in w_bg:
        torch.testing.assert_close(w_bg[name], w_sync[name], atol=0, rtol=0)
    assert s_bg["draft_version"] == s_sync["draft_version"] == 2 and s_bg["step"] == s_sync["step"]
    assert s_bg.keys() == s_sync.keys()


def test_a_failed_write_raises_at_the_next_wait_once_and_the_previous_version_stays(toy_target, tmp_path, caplog):
    adapter = make_adapter(toy_target, tmp_path)
    train_a_little(adapter)
    started, gate = hold_writes(adapter.publisher, fail=OSError(28, "No space left on device"))
    version = adapter.publisher.publish(policy_version=1)  # returns: the write fails later
    gate.set()
    with pytest.raises(RuntimeError, match=f"writing draft version {version} .*No space left on device"):
        adapter.wait_published()
    assert "writing draft version 2 failed" in caplog.text  # also logged where it happened
    adapter.wait_published()  # raised once
    assert adapter.store.latest().version == 1
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "run").iterdir())  # no half-written version
    # the next publish goes on, above the failed version's number
    adapter.publisher._exporter = type(adapter.publisher)._exporter.__get__(adapter.publisher)
    assert adapter.publish(policy_version=1) == 3 and adapter.store.latest().version == 3
    adapter.close()


def test_a_swap_raises_a_failed_write_of_the_version_it_waits_for(toy_target, tmp_path):
    adapter = make_adapter(toy_target, tmp_path)
    started, gate = hold_writes(adapter.publisher, fail=OSError(5, "Input/output error"))
    adapter.publisher.publish(policy_version=0)
    gate.set()
    with pytest.raises(RuntimeError, match="Input/output error"):
        adapter.swap(EngineStandIn(policy_version=0))
    adapter.close()


def waits_for_the_write(adapter, call):
    """Publish with the writer held at its gate and run ``call`` in a thread: it is still waiting
    a second later and returns once the gate opens. Returns (the version, what ``call`` returned)."""
    train_a_little(adapter)
    started, gate = hold_writes(adapter.publisher)
    version = adapter.publisher.publish(policy_version=1)
    assert started.wait(60)
    t, box = in_thread(call)
    t.join(1.0)
    assert t.is_alive(), "it returned before the write it should wait for"
    gate.set()
    t.join(60)
    assert "error" not in box, box.get("error")
    return version, box.get("result")


def test_close_waits_for_the_write_in_flight(toy_target, tmp_path):
    adapter = make_adapter(toy_target, tmp_path)
    version, _ = waits_for_the_write(adapter, adapter.close)
    assert DraftStore(tmp_path / "run", readonly=True).latest().version == version
    state = torch.load(tmp_path / "run" / ".trainer" / "resume.pt", weights_only=True)
    assert state["draft_version"] == version


def test_reading_the_store_through_the_adapter_waits_for_what_it_published(toy_target, tmp_path):
    adapter = make_adapter(toy_target, tmp_path)
    version, latest = waits_for_the_write(adapter, lambda: adapter.store.latest().version)
    assert latest == version and adapter.live_version == version
    adapter.close()


CRASH_CHILD = r"""
import sys, time
from draftadapt.adapter import AdapterConfig, DraftAdapter
target, draft, out = sys.argv[1:4]
adapter = DraftAdapter(target, draft, out, AdapterConfig(method="eagle3"))
real = adapter.publisher._exporter
def exporter(module, policy_version):
    write = real(module, policy_version)
    def stalled(tmp, version):
        write(tmp, version)  # the weights are on disk; the hash, the manifest and the rename are not
        print("exported", version, flush=True)
        time.sleep(600)
    return stalled
adapter.publisher._exporter = exporter
adapter.publisher.publish(policy_version=1)
print("returned", flush=True)
adapter.wait_published()
"""


def test_a_writer_killed_before_the_manifest_leaves_the_previous_version_newest(toy_target, tmp_path):
    from draftadapt.draft_init import init_draft

    draft0 = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(toy_target), str(draft0), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line.strip())
            if "exported 2" in seen and "returned" in seen:
                break
        assert "exported 2" in seen and "returned" in seen, (seen, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    left = [p.name for p in out.iterdir() if p.name.startswith(".tmp-v000002")]
    assert left and (out / left[0] / WEIGHTS_FILE).is_file()  # it died mid-write
    assert not (out / "v000002").exists()
    assert DraftStore(out, readonly=True).latest().version == 1
    store = DraftStore(out)  # a writer opening the store removes the dead one's temp dir
    assert not any(p.name.startswith(".tmp-") for p in out.iterdir()) and store.latest().version == 1
    again = make_adapter(toy_target, tmp_path)
    assert again.resumed_from == "published" and again.live_version == 1
    again.close()
