"""Spool writer and reader on real files: round trip, in-progress entries, malformed shards, cursor."""

import json
import logging
import os
import time

import pytest
import torch
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import save_file

from draftadapt.fileio import file_sha256
from draftadapt.spool import SpoolCursor, SpoolFormatError, SpoolReader, SpoolWriter, rollout_name


def batch(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 100, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(0, 100, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    return prompts, responses


# --------------------------------------------------------------------------- round trip

def test_round_trip_with_rewards_aux_and_extra(tmp_path):
    w = SpoolWriter(tmp_path, writer_id="rank0")
    prompts, responses = batch(0, n=4)
    total = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    aux = torch.randn(total, 8, dtype=torch.bfloat16)
    path = w.write_rollouts(5, 4, prompts, responses, rewards=[1, 0, 0.5, -1], aux_hidden=aux, extra={"task": "x"})
    man = json.loads(path.read_text())
    assert man["sha256"] == file_sha256(path.with_suffix(".safetensors"))
    assert (man["step"], man["policy_version"], man["num_sequences"], man["num_tokens"]) == (5, 4, 4, total)

    shard = SpoolReader(tmp_path).load(path.stem)
    assert (shard.step, shard.policy_version, len(shard), shard.num_tokens) == (5, 4, 4, total)
    assert shard.prompt_ids == prompts and shard.response_ids == responses
    assert shard.rewards == [1.0, 0.0, 0.5, -1.0]
    assert shard.extra == {"task": "x"}
    assert torch.equal(torch.cat(shard.aux_hidden), aux) and shard.aux_hidden[0].dtype == torch.bfloat16
    # each sequence owns its rows (a replay buffer can free them one by one)
    assert shard.aux_hidden[1].untyped_storage().nbytes() == shard.aux_hidden[1].nbytes
    assert [s.ids for s in shard.sequences()] == [p + r for p, r in zip(prompts, responses)]


def test_accepts_tensors_and_numpy_token_ids(tmp_path):
    import numpy as np

    w = SpoolWriter(tmp_path)
    path = w.write_rollouts(0, 0, [torch.tensor([1, 2]), np.array([3])], [np.array([4], dtype=np.int64), []])
    shard = SpoolReader(tmp_path).load(path.stem)
    assert shard.prompt_ids == [[1, 2], [3]] and shard.response_ids == [[4], []] and shard.rewards is None


def test_names_sort_by_step_then_policy_version_and_writers_never_collide(tmp_path):
    a, b = SpoolWriter(tmp_path, "rank0"), SpoolWriter(tmp_path, "rank0")  # same id, two processes
    assert a.writer != b.writer
    p, r = batch()
    written = [a.write_rollouts(10, 2, p, r), b.write_rollouts(9, 3, p, r), a.write_rollouts(9, 2, p, r),
               b.write_rollouts(9, 2, p, r), a.write_rollouts(100, 0, p, r)]
    refs = SpoolReader(tmp_path).shards()
    assert len({w.stem for w in written}) == 5 and len(refs) == 5
    assert [(x.step, x.policy_version) for x in refs] == [(9, 2), (9, 2), (9, 3), (10, 2), (100, 0)]
    assert [x.name for x in refs] == sorted(x.name for x in refs)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(step=-1), "step must be in"),
        (dict(policy_version=-3), "policy_version must be in"),
        (dict(policy_version=1.0), "policy_version must be an int"),
        (dict(prompt_ids=[], response_ids=[]), "empty batch"),
        (dict(response_ids=[[1]]), "prompt_ids has 2 sequences, response_ids has 1"),
        (dict(prompt_ids=[[], [1]]), r"prompt_ids\[0\] is empty"),
        (dict(prompt_ids=[[1], [-5]]), "token ids must be in"),
        (dict(prompt_ids=[[1], [0.5]]), "flat sequence of int token ids"),
        (dict(prompt_ids=[[1], [[1, 2]]]), "flat sequence of int token ids"),
        (dict(rewards=[1.0]), "rewards has 1 values for 2 sequences"),
        (dict(aux_hidden=torch.zeros(3, 4)), r"aux_hidden has shape \(3, 4\); expected \[4, D\]"),
        (dict(aux_hidden=torch.zeros(4, 4, dtype=torch.int64)), "aux_hidden dtype"),
        (dict(extra={"x": object()}), "JSON-serialisable"),
    ],
)
def test_writer_rejects_bad_input_with_a_clear_error(tmp_path, args, match):
    call = dict(step=0, policy_version=0, prompt_ids=[[1], [2]], response_ids=[[3], [4]])
    call.update(args)
    with pytest.raises(ValueError, match=match):
        SpoolWriter(tmp_path).write_rollouts(**call)
    assert SpoolReader(tmp_path).shards() == []


def test_bad_writer_id_and_write_after_finish(tmp_path):
    with pytest.raises(ValueError, match="writer_id"):
        SpoolWriter(tmp_path, writer_id="rank-0")
    w = SpoolWriter(tmp_path)
    r = SpoolReader(tmp_path)
    assert not r.finished()
    w.finish(last_step=3)
    assert r.finished() and json.loads((tmp_path / "FINISHED.json").read_text())["last_step"] == 3
    with pytest.raises(RuntimeError, match="finish"):
        w.write_rollouts(0, 0, [[1]], [[2]])


# --------------------------------------------------------------------------- in progress, malformed

def test_in_progress_shard_is_ignored_until_its_manifest_lands(tmp_path):
    w = SpoolWriter(tmp_path)
    path = w.write_rollouts(1, 0, [[1, 2]], [[3]])
    manifest = path.read_bytes()
    path.unlink()  # as if the writer were between the data file and the manifest
    (path.parent / f".{path.name}.abc.tmp").write_bytes(manifest[:10])  # its half-written temp manifest
    r = SpoolReader(tmp_path)
    assert r.shards() == [] and list(r.poll()) == [] and r.quarantined() == {}
    assert path.with_suffix(".safetensors").is_file()  # not touched
    path.write_bytes(manifest)
    assert [s.name for s in r.poll()] == [path.stem]


def _corruptions():
    def bad_json(man, data):
        man.write_text('{"format": "draftadapt-spool-rollouts", ')

    def bad_sha(man, data):
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))

    def truncated(man, data):
        data.write_bytes(data.read_bytes()[:-7])

    def unreadable(man, data):  # sha matches, but it is not safetensors
        data.write_bytes(b"not a safetensors file at all")
        _rehash(man, data)

    def missing_data(man, data):
        data.unlink()

    def inconsistent_arrays(man, data):  # prompt longer than its sequence, sha updated to match
        save_file({"tokens": torch.tensor([1, 2, 3], dtype=torch.int32), "offsets": torch.tensor([0, 3]),
                   "prompt_lens": torch.tensor([5], dtype=torch.int32)}, str(data))
        _rehash(man, data)

    def offsets_past_end(man, data):
        save_file({"tokens": torch.tensor([1, 2], dtype=torch.int32), "offsets": torch.tensor([0, 9]),
                   "prompt_lens": torch.tensor([1], dtype=torch.int32)}, str(data))
        _rehash(man, data)

    def counts_disagree(man, data):
        m = json.loads(man.read_text())
        m["num_tokens"] += 1
        man.write_text(json.dumps(m))

    def wrong_step(man, data):
        m = json.loads(man.read_text())
        m["step"] = 99
        man.write_text(json.dumps(m))

    def future_format(man, data):
        m = json.loads(man.read_text())
        m["format_version"] = 2
        man.write_text(json.dumps(m))

    def not_an_object(man, data):
        man.write_text("[1, 2]")

    return {
        "bad manifest JSON": (bad_json, "not valid JSON"),
        "bad sha": (bad_sha, "does not match the manifest"),
        "truncated": (truncated, "does not match the manifest"),
        "unreadable safetensors": (unreadable, "not readable safetensors"),
        "missing data": (missing_data, "is missing"),
        "inconsistent arrays": (inconsistent_arrays, "prompt_lens"),
        "offsets past end": (offsets_past_end, "offsets must start at 0 and end at len"),
        "counts disagree": (counts_disagree, "manifest says"),
        "wrong step": (wrong_step, "the name says"),
        "future format": (future_format, "format_version 2"),
        "not an object": (not_an_object, "JSON object"),
    }


def _rehash(man, data):
    m = json.loads(man.read_text())
    m["sha256"] = file_sha256(data)
    man.write_text(json.dumps(m))


def test_each_malformed_kind_is_quarantined_with_a_reason_and_good_shards_keep_flowing(tmp_path, caplog):
    w = SpoolWriter(tmp_path)
    kinds = _corruptions()
    good, bad = [], {}
    for i, (kind, (corrupt, _)) in enumerate(kinds.items()):
        good.append(w.write_rollouts(2 * i, 0, [[1, 2]], [[3]]).stem)
        path = w.write_rollouts(2 * i + 1, 0, [[4, 5]], [[6, 7]])
        corrupt(path, path.with_suffix(".safetensors"))
        bad[path.stem] = kind
    # a manifest whose name breaks the pattern, from a foreign writer
    (tmp_path / "rollouts" / "step7.json").write_text("{}")
    (tmp_path / "rollouts" / "step7.safetensors").write_bytes(b"x")

    r = SpoolReader(tmp_path)
    cursor = SpoolCursor()
    with caplog.at_level(logging.WARNING, logger="draftadapt.spool.reader"):
        got = []
        for shard in r.poll(cursor):  # must not raise
            got.append(shard.name)
            cursor.mark(shard)
    assert got == good
    reasons = r.quarantined()
    assert set(reasons) == set(bad) | {"step7"}
    for name, kind in bad.items():
        assert kinds[kind][1] in reasons[name], (kind, reasons[name])
        assert name in caplog.text
        assert not (tmp_path / "rollouts" / f"{name}.json").exists()
        assert not (tmp_path / "rollouts" / f"{name}.safetensors").exists()
        assert (tmp_path / "quarantine" / f"{name}.json").exists()
    assert "name does not match" in reasons["step7"]
    assert (tmp_path / "quarantine" / "step7.safetensors").exists()
    assert r.pending(cursor) == []
    # more good shards keep flowing afterwards
    later = w.write_rollouts(1000, 1, [[1]], [[2]]).stem
    assert [s.name for s in r.poll(cursor)] == [later]


def test_load_raises_a_named_error_for_a_bad_shard(tmp_path):
    path = SpoolWriter(tmp_path).write_rollouts(0, 0, [[1]], [[2]])
    path.with_suffix(".safetensors").write_bytes(b"junk")
    with pytest.raises(SpoolFormatError, match=path.stem):
        SpoolReader(tmp_path).load(path.stem)


def test_interrupted_quarantine_is_finished_on_the_next_poll(tmp_path):
    w = SpoolWriter(tmp_path)
    path = w.write_rollouts(0, 0, [[1]], [[2]])
    # killed after the reason and the manifest moved, before the data file did
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / f"{path.stem}.reason.txt").write_text("bad sha\n")
    os.replace(path, tmp_path / "quarantine" / path.name)
    r = SpoolReader(tmp_path)
    assert list(r.poll()) == []
    assert not path.with_suffix(".safetensors").exists()
    assert (tmp_path / "quarantine" / f"{path.stem}.safetensors").exists()


def test_foreign_writer_with_only_numpy_and_json(tmp_path):
    """The minimal example of docs/spool-format.md, kept in sync by hand."""
    import hashlib

    import numpy as np

    rdir = tmp_path / "rollouts"
    rdir.mkdir(parents=True)
    name = "r000000000007-p000000003-myrl_0-000000"
    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]
    seqs = [p + r for p, r in zip(prompts, responses)]
    tensors = {
        "tokens": np.array([t for s in seqs for t in s], dtype=np.int32),
        "offsets": np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
        "prompt_lens": np.array([len(p) for p in prompts], dtype=np.int32),
        "rewards": np.array([1.0, 0.0], dtype=np.float32),
    }
    tmp = rdir / f".{name}.safetensors.tmp"
    np_save_file(tensors, str(tmp))
    os.replace(tmp, rdir / f"{name}.safetensors")
    manifest = {
        "format": "draftadapt-spool-rollouts", "format_version": 1,
        "data_file": f"{name}.safetensors",
        "sha256": hashlib.sha256((rdir / f"{name}.safetensors").read_bytes()).hexdigest(),
        "step": 7, "policy_version": 3,
        "num_sequences": len(seqs), "num_tokens": int(tensors["offsets"][-1]),
    }
    tmp = rdir / f".{name}.json.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, rdir / f"{name}.json")
    (shard,) = list(SpoolReader(tmp_path).poll())
    assert shard.prompt_ids == prompts and shard.response_ids == responses and shard.rewards == [1.0, 0.0]


# --------------------------------------------------------------------------- cursor, prune

def test_cursor_delivers_a_late_shard_with_a_smaller_name_and_survives_a_restart(tmp_path):
    w = SpoolWriter(tmp_path)
    r = SpoolReader(tmp_path)
    state = tmp_path / "consumer" / "cursor.json"
    cursor = SpoolCursor.load(state)
    assert len(cursor) == 0
    a = w.write_rollouts(6, 1, [[1]], [[2]]).stem
    for s in r.poll(cursor):
        cursor.mark(s)
        cursor.save(state)
    b = w.write_rollouts(5, 0, [[1]], [[2]]).stem  # a slow rank finishes step 5 after step 6 was consumed
    cursor = SpoolCursor.load(state)  # restarted consumer
    assert a in cursor
    assert [s.name for s in r.poll(cursor)] == [b]


def test_poll_limit_and_corrupt_cursor_file(tmp_path):
    w = SpoolWriter(tmp_path)
    for step in range(5):
        w.write_rollouts(step, 0, [[1]], [[2]])
    assert len(list(SpoolReader(tmp_path).poll(limit=2))) == 2
    bad = tmp_path / "cursor.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not a spool cursor"):
        SpoolCursor.load(bad)


def test_reading_never_deletes_and_prune_only_takes_consumed_shards(tmp_path):
    w = SpoolWriter(tmp_path)
    names = [w.write_rollouts(step, step // 2, [[1]], [[2]]).stem for step in range(6)]
    r = SpoolReader(tmp_path)
    cursor = SpoolCursor()
    for s in r.poll(cursor, limit=4):
        cursor.mark(s)
    assert len(r.shards()) == 6  # nothing deleted on read
    removed = r.prune(cursor, before_policy_version=2)  # versions 0, 1 -> steps 0..3, all consumed
    assert removed == names[:4]
    assert [x.name for x in r.shards()] == names[4:]
    assert r.prune(cursor) == []  # 4 and 5 were never consumed: never pruned
    cursor.compact(x.name for x in r.shards())
    assert len(cursor) == 0
    assert [s.name for s in r.poll(cursor)] == names[4:]


def test_prune_removes_old_leftovers_of_killed_writers(tmp_path):
    w = SpoolWriter(tmp_path)
    keep = w.write_rollouts(0, 0, [[1]], [[2]])
    rdir = tmp_path / "rollouts"
    orphan = rdir / "r000000000001-p000000000-w_dead-000000.safetensors"  # data, manifest never written
    temp = rdir / ".r000000000001-p000000000-w_dead-000001.safetensors.ab.tmp"
    fresh = rdir / "r000000000002-p000000000-w_live-000000.safetensors"  # a writer still at work
    for f in (orphan, temp, fresh):
        f.write_bytes(b"partial")
    old = time.time() - 7200
    for f in (orphan, temp):
        os.utime(f, (old, old))
    SpoolReader(tmp_path).prune(SpoolCursor(), partial_older_than_s=3600)
    assert not orphan.exists() and not temp.exists()
    assert fresh.exists() and keep.exists() and keep.with_suffix(".safetensors").exists()


# --------------------------------------------------------------------------- policy checkpoints

def test_policy_checkpoints_from_state_dict_file_and_hf_dir(tmp_path):
    spool = tmp_path / "spool"
    w = SpoolWriter(spool)
    emb = torch.randn(4, 3)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}  # tied: share memory
    w.write_policy(0, sd, step=0)
    single = tmp_path / "one.safetensors"
    save_file({"w": torch.ones(2)}, str(single))
    w.write_policy(1, single)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.zeros(1)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(1)}, str(hf / "model-00002-of-00002.safetensors"))
    (hf / "model.safetensors.index.json").write_text("{}")
    (hf / "config.json").write_text('{"model_type": "llama"}')
    w.write_policy(2, str(hf))

    r = SpoolReader(spool)
    assert [p.version for p in r.policies()] == [0, 1, 2]
    p0 = r.policy(0)
    assert p0.step == 0 and torch.equal(p0.state_dict()["lm_head.weight"], emb)
    assert set(r.policy(1).state_dict()) == {"w"}
    latest = r.latest_policy()
    assert latest.version == 2 and (latest.path / "config.json").is_file()
    assert set(latest.state_dict()) == {"a", "b"} and len(latest.weight_files) == 2
    assert r.latest_policy(max_version=1).version == 1
    assert r.latest_policy(newer_than=2) is None
    old = [x.name for x in r.policies()[:2]]
    assert r.prune_policies(keep_last=1) == old
    assert [p.version for p in r.policies()] == [2]


def test_policy_bad_input_and_corrupt_checkpoint_is_quarantined(tmp_path):
    w = SpoolWriter(tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        w.write_policy(0, str(tmp_path / "rollouts"))
    with pytest.raises(ValueError, match="do not exist"):
        w.write_policy(0, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="policy version"):
        w.write_policy(-1, {"a": torch.zeros(1)})
    with pytest.raises(ValueError, match="empty state dict"):
        w.write_policy(0, {})
    w.write_policy(3, {"a": torch.zeros(1)})
    bad = w.write_policy(4, {"a": torch.ones(1000)})
    weights = tmp_path / "policy" / bad.stem / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    r = SpoolReader(tmp_path)
    assert r.latest_policy().version == 3  # the corrupt v4 is skipped ...
    assert "does not match its sha256" in r.quarantined()[bad.stem]  # ... and moved aside
    assert (tmp_path / "quarantine" / bad.stem / "model.safetensors").exists()
    assert [p.version for p in r.policies()] == [3]


def test_rollout_name_format_is_fixed_width():
    assert rollout_name(3, 2, "w_ab", 1) == "r000000000003-p000000002-w_ab-000001"


def test_an_unexpected_error_on_one_shard_does_not_stop_the_poll(tmp_path, monkeypatch):
    import draftadapt.spool.reader as reader_mod

    w = SpoolWriter(tmp_path)
    bad = w.write_rollouts(0, 0, [[1]], [[2]]).stem
    good = w.write_rollouts(1, 0, [[1, 2]], [[3]]).stem
    real = reader_mod.check_rollout_tensors

    def flaky(t, where):
        if where == bad:
            raise IndexError("a bug we did not foresee")
        return real(t, where)

    monkeypatch.setattr(reader_mod, "check_rollout_tensors", flaky)
    r = SpoolReader(tmp_path)
    assert [s.name for s in r.poll()] == [good]
    assert "IndexError: a bug we did not foresee" in r.quarantined()[bad]
