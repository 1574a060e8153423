"""Attach mode: ``draftadapt sidecar`` trains drafts from a spool directory, beside any RL run.

    draftadapt sidecar --spool SPOOL --out DRAFTS --target POLICY_DIR --draft DRAFT_DIR [key=value ...]

The RL side writes rollout shards and policy checkpoints with ``draftadapt.spool.SpoolWriter``
(format: docs/spool-format.md); the sidecar polls the spool, feeds a :class:`DraftAdapter`, and
publishes versioned drafts into ``DRAFTS/v000001, v000002, ...``. The engine side calls
:func:`pick_up_latest` between generate calls.

Crash safety (SIGKILL at any moment, then restart with the same command):
- no spooled rollout is lost: shards are never deleted on read, the cursor of consumed shards is
  saved atomically, and on restart the replay buffer is rebuilt from the consumed shards;
- no half-written draft is ever visible and versions only grow (``DraftStore``: temp dir, fsync,
  rename, then ``LATEST``);
- a malformed shard is moved to ``SPOOL/quarantine/`` with its reason and the loop goes on.

Never a crash loop: a shard the adapter refuses (token ids outside the vocabulary, too long,
hidden states of the wrong shape or non-finite), a shard whose round fails, and a policy
checkpoint that does not fit or is not finite are quarantined with the reason; a shard is marked
consumed only once its round ran. A restart trains on from the newest published draft and the
trainer state beside it (docs/design.md, "Checks at the door").
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftadapt.adapter import AdapterConfig, DraftAdapter
from draftadapt.boundary import SpoolPoll, StepBoundary
from draftadapt.config import ConfigError, load_config
from draftadapt.spool import SpoolCursor, SpoolReader
from draftadapt.spool.format import POLICY_DIR
from draftadapt.data.store import DraftStore
from draftadapt.fileio import atomic_write_json

log = logging.getLogger("draftadapt.sidecar")
STATE_DIR = ".sidecar"


@dataclass
class SidecarConfig:
    poll_s: float = 1.0  # seconds between spool polls when idle
    max_idle_s: float = 0.0  # > 0: exit after this long with nothing new (0: run until the spool is finished)
    exit_when_finished: bool = True  # stop once the RL side called SpoolWriter.finish() and all is consumed
    log: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard", "stdout"])  # metric sinks, under OUT/.sidecar
    adapter: AdapterConfig = field(default_factory=AdapterConfig)


class Sidecar:
    def __init__(self, spool: str | Path, out: str | Path, target: str | Path, draft: str | Path,
                 cfg: SidecarConfig | None = None):
        from draftadapt.metrics.logger import make_logger

        self.cfg = cfg or SidecarConfig()
        self.out = Path(out)
        self.state_dir = self.out / STATE_DIR
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / "state.json"
        self.reader = SpoolReader(spool)
        self.logger = make_logger(self.cfg.log, self.state_dir, stdout_keys=(
            "adapt/published", "accept/simulated_length", "train/loss", "draft/published_version"))
        self.adapter = DraftAdapter(target, draft, self.out, self.cfg.adapter, logger=self.logger)
        self.boundary = StepBoundary(self.adapter, None)  # the engines pick up what it publishes
        self.cursor = SpoolCursor()
        self._restore()

    # ------------------------------------------------------------------ state

    def _restore(self) -> None:
        """After a restart: the consumed shards go back into the replay buffer, the policy to its newest."""
        restarted = self.state_path.is_file()
        if restarted:
            state = json.loads(self.state_path.read_text())
            self.cursor = SpoolCursor.from_dict(state["cursor"])
        poll = self.boundary.resume(self._consumed() if restarted else (), self._checkpoints(),
                                    self._skip_consumed, self._refuse_policy)
        if restarted:
            log.info("sidecar: restored cursor of %d shards, %d re-read into the replay buffer",
                     len(self.cursor), len(poll.taken))
        self._log_policy(poll)

    def _save(self) -> None:
        atomic_write_json(self.state_path, {"cursor": self.cursor.to_dict(),
                                            "policy_version": self.adapter.policy_version})

    # ------------------------------------------------------------------ what the boundary reads, and refuses

    def _consumed(self):
        """The shards consumed before a restart, read again (one gone bad since is skipped)."""
        for ref in self.reader.shards():
            if ref.name in self.cursor:
                try:
                    yield self.reader.load(ref)
                except Exception as exc:  # noqa: BLE001 - a shard gone bad since: skip it, keep going
                    log.warning("sidecar: could not reload consumed shard %s: %s", ref.name, exc)

    def _checkpoints(self):
        """The newest policy checkpoint newer than the adapter's, asked again after each refusal."""
        while (ckpt := self.reader.latest_policy(newer_than=self.adapter.policy_version)) is not None:
            yield ckpt

    def _skip_consumed(self, shard, exc: ValueError) -> None:
        log.warning("sidecar: consumed shard %s is refused now (%s); skipped", shard.name, exc)

    def _refuse_shard(self, shard, exc: ValueError) -> None:
        self.reader.quarantine(shard.name, f"refused by the adapter: {exc}")

    def _refuse_policy(self, ckpt, exc: ValueError) -> None:
        """A policy checkpoint that does not fit is quarantined; the next newest is tried."""
        self.reader.quarantine(ckpt.name, f"refused by the adapter: {exc}", kind=POLICY_DIR)

    def _log_policy(self, poll: SpoolPoll) -> None:
        if poll.policy is not None:
            log.info("sidecar: policy now at version %d", poll.policy.version)

    # ------------------------------------------------------------------ loop

    def run_once(self) -> int:
        """Poll once: new policy, new shards, maybe train and publish (the boundary's order).
        Returns shards consumed."""
        poll = self.boundary.after_poll(self._checkpoints(), self.reader.poll(self.cursor),
                                        self._refuse_policy, self._refuse_shard)
        self._log_policy(poll)
        if not poll.taken:
            return 0
        if poll.error is not None:  # the round failed: its shards go, the loop stays
            log.error("sidecar: a round on %s failed", poll.taken, exc_info=poll.error)
            for name in poll.taken:
                self.adapter.forget(name)
                self.reader.quarantine(name, f"a round on it failed: {type(poll.error).__name__}: {poll.error}")
            return 0
        for name in poll.taken:  # consumed only now that their round ran
            self.cursor.mark(name)
        self._save()
        self.logger.log_dict({**poll.metrics, "spool/shards": float(len(poll.taken)),
                              "replay/seqs": float(len(self.adapter.replay))},
                             step=self.adapter.policy_version)
        return len(poll.taken)

    def run(self) -> int:
        idle_since = time.monotonic()
        while True:
            if self.run_once():
                idle_since = time.monotonic()
                continue
            if self.cfg.exit_when_finished and self.reader.finished() and not self.reader.pending(self.cursor):
                log.info("sidecar: the spool is finished and fully consumed; exiting")
                return 0
            if self.cfg.max_idle_s and time.monotonic() - idle_since > self.cfg.max_idle_s:
                log.info("sidecar: idle for %.0f s; exiting", self.cfg.max_idle_s)
                return 0
            time.sleep(self.cfg.poll_s)

    def close(self) -> None:
        self.logger.close()


def pick_up_latest(engine, out: str | Path):
    """Engine side, between generate calls: swap in the newest draft the sidecar published that
    the engine may serve (:meth:`DraftStore.swap_newest_into`, the same path the in-process
    adapter swaps through). Returns the SwapResult, or None when there is nothing newer."""
    return DraftStore(out, readonly=True).swap_newest_into(engine)


def sidecar_cli(spool: str, out: str, target: str, draft: str, config: str | None, overrides: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(SidecarConfig, config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, p in (("--spool", spool), ("--target", target), ("--draft", draft)):
        if not Path(p).exists():
            print(f"error: {name} {p} does not exist", file=sys.stderr)
            return 2
    # SIGTERM: stop between polls; state on disk is always consistent, so nothing to flush.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    car = Sidecar(spool, out, target, draft, cfg)
    try:
        return car.run()
    finally:
        car.close()
