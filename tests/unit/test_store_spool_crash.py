"""SIGKILL at random moments: publishers and the engine-side reader of the draft store, spool
writers and a spool consumer, each killed 20 times mid-run and restarted.

The children are real processes, forked from one helper process (``python -c ZYGOTE``) that
imported torch and draftadapt once: a fresh interpreter per restart would spend its seconds
importing torch, and the kill would land there instead of in the code under test. Each child
loops until killed; the test kills it after a random delay (most of a loop is spent inside a
publish or a shard write), checks every invariant on disk from this process, and starts the
next round, which reopens everything as a restarted process would.
"""

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftadapt.data.store import DraftStore
from draftadapt.spool import SpoolCursor, SpoolReader

ROUNDS = 20

ZYGOTE = r'''
import json, os, random, sys, time, traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftadapt.data.store import DraftStore
from draftadapt.fileio import atomic_write_json, file_sha256
from draftadapt.spool import SpoolCursor, SpoolReader, SpoolWriter

torch.set_num_threads(1)
ROOT = None  # the test's directory, set per fork


def fail(msg):
    with open(ROOT / "errors.log", "a") as f:
        f.write(f"pid {os.getpid()}: {msg}\n")


def publisher(seed):
    rnd = random.Random(seed)
    store = DraftStore(ROOT / "drafts")  # a restart: reopen (cleans what a killed publisher left)
    with open(ROOT / f"published-{seed}.log", "a") as log:
        while True:
            n = rnd.choice([1_000, 50_000, 400_000])

            def write(d, version):
                save_file({"w": torch.full((n,), float(version))}, str(d / "model.safetensors"))
                (d / "config.json").write_text(json.dumps({"n": n}))

            pv = rnd.randint(0, 20)
            version, _ = store.publish(write, policy_version=pv)
            log.write(f"{version} {pv}\n")
            log.flush()


def reader(seed):
    """The engine side: polls latest() while publishers run and die; versions must only grow."""
    out = ROOT / "drafts"
    cached, last, checks = DraftStore(out, readonly=True), 0, 0
    while True:
        store = cached if checks % 2 else DraftStore(out, readonly=True)
        dv = store.latest()
        if dv is not None:
            meta = json.loads((dv.path / "draftadapt.json").read_text())
            if meta["sha256"] != file_sha256(dv.weights) or meta["version"] != dv.version:
                fail(f"latest() returned {dv.path}, which does not match its manifest")
            if float(load_file(str(dv.weights))["w"][0]) != dv.version:
                fail(f"{dv.path} holds the weights of another version")
            if dv.version < last:
                fail(f"latest() went down from {last} to {dv.version}")
            last = dv.version
        checks += 1
        with open(ROOT / "reader-checks.log", "a") as f:
            f.write(f"{dv.version if dv else 0}\n")


def writer(seed):
    rnd = random.Random(seed)
    w = SpoolWriter(ROOT / "spool", writer_id=f"k{seed}")
    step = seed * 10_000
    with open(ROOT / "written.log", "a") as log:
        while True:
            n = rnd.randint(1, 8)
            prompts = [[rnd.randrange(1000) for _ in range(rnd.randint(1, 40))] for _ in range(n)]
            responses = [[rnd.randrange(1000) for _ in range(rnd.randint(0, 200))] for _ in range(n)]
            total = sum(len(p) + len(r) for p, r in zip(prompts, responses))
            aux = torch.randn(total, 128) if rnd.random() < 0.5 else None
            extra = {"token_sum": sum(map(sum, prompts)) + sum(map(sum, responses))}
            path = w.write_rollouts(step, step // 3, prompts, responses, rewards=[1.0] * n,
                                    aux_hidden=aux, extra=extra)
            log.write(path.stem + "\n")
            log.flush()
            step += 1


def consumer(seed):
    """Incorporates each shard exactly once: the cursor and what was done with the shard are
    saved in one atomic write of the consumer's own state file."""
    state_path = ROOT / "consumer" / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"cursor": {"done": []}, "consumed": []}
    cursor = SpoolCursor.from_dict(state["cursor"])
    reader = SpoolReader(ROOT / "spool")
    while True:
        got = 0
        for shard in reader.poll(cursor):
            got += 1
            if sum(map(sum, shard.prompt_ids)) + sum(map(sum, shard.response_ids)) != shard.extra["token_sum"]:
                fail(f"{shard.name}: tokens differ from what was written")
            if shard.aux_hidden is not None and [a.shape[0] for a in shard.aux_hidden] != [
                len(p) + len(r) for p, r in zip(shard.prompt_ids, shard.response_ids)
            ]:
                fail(f"{shard.name}: aux rows do not line up with the tokens")
            cursor.mark(shard)
            state["consumed"].append(shard.name)
            state["cursor"] = cursor.to_dict()
            atomic_write_json(state_path, state)
        if not got:
            time.sleep(0.005)


WORKERS = {"publisher": publisher, "reader": reader, "writer": writer, "consumer": consumer}


def run(kind, seed):
    try:
        WORKERS[kind](seed)
    except BaseException:
        fail(traceback.format_exc())
        os._exit(1)
    os._exit(0)


print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "fork":
        pid = os.fork()
        if pid == 0:
            ROOT = Path(args[2])
            run(args[0], int(args[1]))
        print(pid, flush=True)
    elif cmd == "reap":
        print(os.waitpid(int(args[0]), 0)[1], flush=True)
'''


class Zygote:
    """A helper process that forks the children on request and reaps them."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.root = log_dir  # where the children of the current test write; see at()
        self.err = open(log_dir / "zygote.err", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1,
        )
        assert self._ask(None, timeout=120) == "ready"

    def _ask(self, line, timeout=30.0):
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        out = self.proc.stdout.readline().strip() if ready else ""
        if not out:
            raise RuntimeError(f"helper process did not answer {line!r}: {(self.log_dir / 'zygote.err').read_text()[-2000:]}")
        return out

    def at(self, root: Path) -> "Zygote":
        self.root = root
        return self

    def fork(self, kind: str, seed: int) -> int:
        return int(self._ask(f"fork {kind} {seed} {self.root}"))

    def kill(self, pid: int) -> None:
        """SIGKILL the child and check that it was still running (not dead of an error)."""
        os.kill(pid, signal.SIGKILL)
        status = int(self._ask(f"reap {pid}"))
        errors = self.root / "errors.log"
        assert not errors.exists(), errors.read_text()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.err.close()


@pytest.fixture(scope="module")
def helper(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


@pytest.fixture
def zygote(helper, tmp_path):
    return helper.at(tmp_path)


VERSION_DIR = re.compile(r"^v(\d{6,})$")


def test_draft_store_survives_sigkill_of_publishers_and_readers(tmp_path, zygote):
    rnd = random.Random(1234)
    out = tmp_path / "drafts"
    visible_before: set[int] = set()
    policy_of: dict[int, int] = {}
    rounds_with_leftovers = 0
    for r in range(ROUNDS):
        # two publishers race in odd rounds (the lock serialises them), one in even rounds
        pubs = [zygote.fork("publisher", 2 * r + k) for k in range(1 + r % 2)]
        rdr = zygote.fork("reader", r)
        time.sleep(rnd.uniform(0.05, 0.5))
        for pid in pubs:
            zygote.kill(pid)
            time.sleep(rnd.uniform(0, 0.02))
        zygote.kill(rdr)

        names = os.listdir(out)
        rounds_with_leftovers += any(n.startswith(".tmp-") for n in names)
        visible = {int(m.group(1)) for n in names if (m := VERSION_DIR.match(n))}
        ro = DraftStore(out, readonly=True)
        # every visible version is complete and sha-valid, and holds its own weights
        for v in sorted(visible - visible_before):
            dv = ro.get(v)
            assert dv is not None, f"v{v} is visible but not complete: {os.listdir(out / f'v{v:06d}')}"
            assert float(load_file(str(dv.weights))["w"][0]) == v
            policy_of[v] = dv.policy_version
        assert visible_before <= visible, "a version disappeared"
        assert visible == set(range(1, max(visible, default=0) + 1)), "version numbers have a gap or a repeat"
        assert ro.versions() == sorted(visible)
        if visible:
            assert ro.latest().version == max(visible)
            for k in (0, 5, 10, 20):
                allowed = [v for v in visible if policy_of[v] <= k]
                got = ro.latest(max_policy_version=k)
                assert (got.version if got else None) == (max(allowed) if allowed else None)
        # what each killed publisher reported: strictly increasing, above everything before it
        for k in range(1 + r % 2):
            log = tmp_path / f"published-{2 * r + k}.log"
            logged = [tuple(map(int, ln.split())) for ln in log.read_text().splitlines()] if log.exists() else []
            versions = [v for v, _ in logged]
            assert versions == sorted(set(versions)), versions
            assert all(v > max(visible_before, default=0) and v in visible for v in versions)
            assert all(policy_of[v] == pv for v, pv in logged)
        visible_before = visible

    print(f"store: {ROUNDS} rounds, {len(visible_before)} versions, {rounds_with_leftovers} kills inside a publish")
    assert len(visible_before) > ROUNDS, "too few publishes to mean anything"
    assert rounds_with_leftovers > 0, "no kill landed inside a publish; the test did not test anything"
    reads = (tmp_path / "reader-checks.log").read_text().split()
    assert len(reads) > ROUNDS
    DraftStore(out)  # a restarted publisher cleans up after the last kill
    names = os.listdir(out)
    assert not [n for n in names if n.startswith(".tmp-")]
    assert json.loads((out / "LATEST").read_text())["version"] == max(visible_before)


def test_spool_survives_sigkill_of_writers_and_the_consumer(tmp_path, zygote):
    rnd = random.Random(4321)
    spool = tmp_path / "spool"
    complete_before: set[str] = set()
    rounds_with_partials = 0
    reader = SpoolReader(spool)
    for r in range(ROUNDS):
        pids = {"writer": zygote.fork("writer", r), "consumer": zygote.fork("consumer", r)}
        time.sleep(rnd.uniform(0.05, 0.5))
        order = list(pids)
        rnd.shuffle(order)
        for kind in order:
            zygote.kill(pids[kind])
            time.sleep(rnd.uniform(0, 0.05))

        rdir = spool / "rollouts"
        complete = {ref.name for ref in reader.shards()}
        files = os.listdir(rdir)
        rounds_with_partials += any(
            f.startswith(".") or (f.endswith(".safetensors") and f[: -len(".safetensors")] not in complete)
            for f in files
        )
        # every complete shard is whole (a kill never exposes a partial one) and none went away
        assert complete_before <= complete
        for name in sorted(complete - complete_before):
            reader.load(name)
        assert not (spool / "quarantine").exists(), reader.quarantined()
        # every shard a writer saw written is there
        written = (tmp_path / "written.log").read_text().split() if (tmp_path / "written.log").exists() else []
        assert set(written) <= complete
        # the consumer's state: nothing twice, nothing that is not a complete shard
        state_path = tmp_path / "consumer" / "state.json"
        if state_path.exists():
            state = json.loads(state_path.read_text())
            assert len(state["consumed"]) == len(set(state["consumed"])), "a shard was consumed twice"
            assert set(state["consumed"]) == set(state["cursor"]["done"])
            assert set(state["consumed"]) <= complete
        complete_before = complete

    # drain what the last consumer did not get to, as a restarted consumer would
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    cursor = SpoolCursor.from_dict(state["cursor"])
    drained = [s.name for s in SpoolReader(spool).poll(cursor)]
    consumed = state["consumed"] + drained
    assert len(consumed) == len(set(consumed)), "a shard was consumed twice"
    assert set(consumed) == complete_before, "a complete shard was lost"
    print(f"spool: {ROUNDS} rounds, {len(complete_before)} shards, {len(drained)} drained at the end, "
          f"{rounds_with_partials} rounds left a partial write")
    assert len(state["consumed"]) > 0 and len(complete_before) > ROUNDS
    assert rounds_with_partials > 0, "no kill landed inside a shard write; the test did not test anything"
