"""Versioned draft store on real directories (the SIGKILL test is in test_store_spool_crash.py)."""

import json
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from draftadapt.data.store import DraftStore
from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.fileio import file_sha256


def writer(n=16, seed=0, meta=None):
    def write(d, version):
        save_file({"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))}, str(d / WEIGHTS_FILE))
        (d / "config.json").write_text("{}")
        if meta is not None:  # as export_eagle3 does: its own manifest, completed by the store
            (d / META_FILE).write_text(json.dumps(meta))
    return write


def test_publish_writes_a_complete_version_with_its_manifest(tmp_path):
    store = DraftStore(tmp_path)
    version, path = store.publish(writer(meta={"method": "eagle3", "format": "speculators"}), 3, {"note": "x"})
    assert (version, path) == (1, tmp_path / "v000001")
    meta = json.loads((path / META_FILE).read_text())
    assert meta["version"] == 1 and meta["policy_version"] == 3 and meta["note"] == "x"
    assert meta["method"] == "eagle3" and meta["sha256"] == file_sha256(path / WEIGHTS_FILE)
    assert json.loads((tmp_path / "LATEST").read_text()) == {"version": 1, "policy_version": 3, "dir": "v000001"}
    dv = store.latest()
    assert (dv.version, dv.policy_version, dv.path, dv.weights) == (1, 3, path, path / WEIGHTS_FILE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "STORE", "v000001"]
    # the store's lineage: the same in every version it publishes, another in another store
    lineage = json.loads((tmp_path / "STORE").read_text())["lineage"]
    assert meta["lineage"] == lineage and len(lineage) == 16
    _, path2 = store.publish(writer(), 4)
    assert json.loads((path2 / META_FILE).read_text())["lineage"] == lineage
    other = DraftStore(tmp_path / "other")
    _, path3 = other.publish(writer(), 0)
    assert json.loads((path3 / META_FILE).read_text())["lineage"] != lineage


def test_the_write_function_gets_the_version(tmp_path):
    seen = []
    store = DraftStore(tmp_path)
    for _ in range(3):
        store.publish(lambda d, v: (seen.append(v), writer()(d, v)), 0)
    assert seen == [1, 2, 3]


def test_versions_strictly_increase_across_reopen_and_never_reuse_a_number(tmp_path):
    got = [DraftStore(tmp_path).publish(writer(), 0)[0] for _ in range(3)]
    store = DraftStore(tmp_path)
    got.append(store.publish(writer(), 1)[0])
    assert got == [1, 2, 3, 4] and store.versions() == [1, 2, 3, 4]
    # the newest dir deleted by hand: LATEST still remembers 4, so 4 is not handed out again
    import shutil

    shutil.rmtree(tmp_path / "v000004")
    assert DraftStore(tmp_path).publish(writer(), 1)[0] == 5


def test_copy_a_source_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    writer(meta={"version": 77, "sha256": "stale"})(src, 0)
    (src / "tokenizer.json").write_text("{}")
    store = DraftStore(tmp_path / "out")
    version, path = store.publish(src, policy_version=2)
    meta = json.loads((path / META_FILE).read_text())
    assert meta["version"] == version == 1 and meta["sha256"] == file_sha256(path / WEIGHTS_FILE)
    assert (path / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="has no model.safetensors"):
        store.publish(tmp_path / "nothing", 2)


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(policy_version=-1), "policy_version must be an int >= 0"),
        (dict(policy_version=True), "policy_version must be an int >= 0"),
        (dict(extra_meta={"version": 9}), "extra_meta may not set"),
        (dict(source=lambda d, v: None), "wrote no model.safetensors"),
    ],
)
def test_publish_rejects_bad_input_and_leaves_nothing(tmp_path, call, match):
    args = dict(source=writer(), policy_version=0)
    args.update(call)
    store = DraftStore(tmp_path)
    with pytest.raises(ValueError, match=match):
        store.publish(**args)
    assert store.versions() == [] and store.latest() is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_a_failing_write_function_leaves_no_version_and_no_temp_dir(tmp_path):
    def boom(d, v):
        writer()(d, v)
        raise RuntimeError("export failed")

    store = DraftStore(tmp_path)
    with pytest.raises(RuntimeError, match="export failed"):
        store.publish(boom, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    assert store.publish(writer(), 0)[0] == 1


def test_latest_respects_the_policy_version_of_the_engine(tmp_path):
    store = DraftStore(tmp_path)
    for pv in (0, 1, 1, 2):  # async RL: the trainer moves ahead of the engine
        store.publish(writer(), pv)
    assert store.latest().version == 4
    assert store.latest(max_policy_version=1).version == 3
    assert store.latest(max_policy_version=0).version == 1
    assert store.latest(newer_than=3).version == 4
    assert store.latest(max_policy_version=1, newer_than=3) is None  # never go back
    assert store.latest(newer_than=4) is None


def test_a_version_that_fails_its_sha_check_is_never_returned(tmp_path, caplog):
    store = DraftStore(tmp_path)
    store.publish(writer(seed=1), 0)
    store.publish(writer(seed=2), 0)
    weights = tmp_path / "v000002" / WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    for s in (store, DraftStore(tmp_path, readonly=True)):  # cached and fresh
        assert s.latest().version == 1
        assert s.versions() == [1] and s.get(2) is None
    assert "v000002" in caplog.text
    # a bad manifest, a missing weights file and a manifest naming another version: all skipped
    store.publish(writer(), 0)
    (tmp_path / "v000003" / META_FILE).write_text("{")
    store.publish(writer(), 0)
    (tmp_path / "v000004" / WEIGHTS_FILE).unlink()
    store.publish(writer(), 0)
    meta = json.loads((tmp_path / "v000005" / META_FILE).read_text())
    (tmp_path / "v000005" / META_FILE).write_text(json.dumps({**meta, "version": 9}))
    assert DraftStore(tmp_path, readonly=True).latest().version == 1
    assert store.publish(writer(), 0)[0] == 6  # numbers above broken dirs are never reused


def test_open_cleans_leftovers_of_a_killed_publisher_and_repairs_latest(tmp_path):
    store = DraftStore(tmp_path)
    store.publish(writer(), 0)
    store.publish(writer(), 5)
    # killed after renaming v2, before LATEST; and another publish killed before its rename
    (tmp_path / "LATEST").write_text(json.dumps({"version": 1, "policy_version": 0, "dir": "v000001"}))
    half = tmp_path / ".tmp-v000003-123-abc"
    half.mkdir()
    (half / WEIGHTS_FILE).write_bytes(b"half")
    (tmp_path / ".LATEST.xyz.tmp").write_text("{")
    (tmp_path / ".trash-v000001-ab").mkdir()
    ro = DraftStore(tmp_path, readonly=True)  # readers never touch anything
    assert half.exists() and ro.latest().version == 2
    DraftStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "STORE", "v000001", "v000002"]
    assert json.loads((tmp_path / "LATEST").read_text())["version"] == 2
    assert DraftStore(tmp_path).publish(writer(), 5)[0] == 3


def test_open_leaves_a_live_publishers_temp_dir_alone(tmp_path):
    store = DraftStore(tmp_path)
    started, release = threading.Event(), threading.Event()

    def slow(d, v):
        writer()(d, v)
        started.set()
        release.wait(10)

    t = threading.Thread(target=store.publish, args=(slow, 0))
    t.start()
    assert started.wait(10)
    (live,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    DraftStore(tmp_path)  # someone opens the store meanwhile: the lock is held, nothing is removed
    assert live.exists()
    assert DraftStore(tmp_path, readonly=True).latest() is None  # and nothing half-done is visible
    release.set()
    t.join()
    assert DraftStore(tmp_path).versions() == [1]


def test_concurrent_publishers_get_distinct_increasing_versions(tmp_path):
    results = []

    def run(k):
        store = DraftStore(tmp_path)
        for _ in range(5):
            results.append(store.publish(writer(seed=k), k)[0])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 16))
    assert DraftStore(tmp_path).versions() == list(range(1, 16))


def test_readonly_store_and_prune(tmp_path):
    ro = DraftStore(tmp_path / "none", readonly=True)
    assert ro.latest() is None and ro.versions() == [] and not (tmp_path / "none").exists()
    with pytest.raises(RuntimeError, match="readonly"):
        ro.publish(writer(), 0)
    store = DraftStore(tmp_path / "out")
    for pv in range(5):
        store.publish(writer(), pv)
    assert store.prune(keep_last=2) == [1, 2, 3]
    assert store.versions() == [4, 5]
    assert store.publish(writer(), 5)[0] == 6
    with pytest.raises(ValueError):
        store.prune(keep_last=0)


def test_engine_manifest_contract(tmp_path):
    """RolloutEngine.swap_draft reads version and sha256 from draftadapt.json of the version dir."""
    _, path = DraftStore(tmp_path).publish(writer(), 0)
    meta = json.loads((path / META_FILE).read_text())
    assert isinstance(meta["version"], int) and meta["sha256"] == file_sha256(path / WEIGHTS_FILE)
    assert os.path.isfile(path / "config.json")
