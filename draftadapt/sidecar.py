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
        self.cursor = SpoolCursor()
        self._restore()

    # ------------------------------------------------------------------ state

    def _restore(self) -> None:
        """After a restart: the consumed shards go back into the replay buffer, the policy to its newest."""
        if self.state_path.is_file():
            state = json.loads(self.state_path.read_text())
            self.cursor = SpoolCursor.from_dict(state["cursor"])
            rebuilt = 0
            for ref in self.reader.shards():
                if ref.name in self.cursor:
                    try:
                        shard = self.reader.load(ref)
                    except Exception as exc:  # noqa: BLE001 - a shard gone bad since: skip it, keep going
                        log.warning("sidecar: could not reload consumed shard %s: %s", ref.name, exc)
                        continue
                    try:
                        self._observe(shard)
                    except ValueError as exc:
                        log.warning("sidecar: consumed shard %s is refused now (%s); skipped", ref.name, exc)
                        continue
                    rebuilt += 1
            log.info("sidecar: restored cursor of %d shards, %d re-read into the replay buffer", len(self.cursor), rebuilt)
        self._sync_policy()

    def _save(self) -> None:
        atomic_write_json(self.state_path, {"cursor": self.cursor.to_dict(),
                                            "policy_version": self.adapter.policy_version})

    def _observe(self, shard) -> None:
        self.adapter.observe(
            [(p, r) for p, r in zip(shard.prompt_ids, shard.response_ids)],
            policy_version=shard.policy_version,
            hidden_states=shard.aux_hidden,
            source=shard.name,
        )

    def _sync_policy(self) -> bool:
        """Load the newest policy checkpoint that fits; one that does not is quarantined."""
        while True:
            ckpt = self.reader.latest_policy(newer_than=self.adapter.policy_version)
            if ckpt is None:
                return False
            try:
                self.adapter.update_policy(ckpt.state_dict(), ckpt.version)
            except ValueError as exc:
                self.reader.quarantine(ckpt.name, f"refused by the adapter: {exc}", kind=POLICY_DIR)
                continue
            log.info("sidecar: policy now at version %d", ckpt.version)
            return True

    # ------------------------------------------------------------------ loop

    def run_once(self) -> int:
        """Poll once: new policy, new shards, maybe train and publish. Returns shards consumed."""
        self._sync_policy()
        taken: list[str] = []
        for shard in self.reader.poll(self.cursor):
            try:
                self._observe(shard)
            except ValueError as exc:
                self.reader.quarantine(shard.name, f"refused by the adapter: {exc}")
                continue
            taken.append(shard.name)
        if not taken:
            return 0
        try:
            metrics = self.adapter.step()
        except Exception as exc:  # noqa: BLE001 - whatever a round raises, its shards go, the loop stays
            log.exception("sidecar: a round on %s failed", taken)
            for name in taken:
                self.adapter.forget(name)
                self.reader.quarantine(name, f"a round on it failed: {type(exc).__name__}: {exc}")
            return 0
        for name in taken:  # consumed only now that their round ran
            self.cursor.mark(name)
        self._save()
        self.logger.log_dict({**metrics, "spool/shards": float(len(taken)),
                              "replay/seqs": float(len(self.adapter.replay))},
                             step=self.adapter.policy_version)
        return len(taken)

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
