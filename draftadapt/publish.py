"""What leaves the adapter: published draft versions, and the swaps that put them into engines.

:class:`Publisher` writes the trainer's draft as the next version of a :class:`DraftStore` (atomic,
versioned), keeps it in memory as the live draft, and keeps the trainer state beside it so a
restart over the same directory trains on from it (docs/design.md, "Checks at the door").
:class:`EngineSwaps` is the engine side: the newest version an engine may serve swapped in, and
the check after a policy sync that it is still the one serving.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftadapt.data.store import DraftStore, DraftVersion
from draftadapt.drafts.formats import check_identity, model_dtype, target_fingerprint
from draftadapt.fileio import atomic_path
from draftadapt.train.methods import DraftMethod
from draftadapt.train.trainer import DraftTrainer

log = logging.getLogger("draftadapt.adapter")
# beside the published versions: the trainer state of the newest one (optimizer moments, step)
RESUME_FILE = ".trainer/resume.pt"


class Publisher:
    """Publishes the trainer's draft for ``policy_dir`` into ``store``; ``live`` is the newest
    published draft (eval mode), as the engine serves it apart from modules shared with the policy."""

    def __init__(self, store: DraftStore, trainer: DraftTrainer, method: DraftMethod, fmt: str,
                 policy_dir: Path, k: int):
        self.store = store
        self.trainer = trainer
        self.method = method
        self.format = fmt  # the layout the starting draft came in; every version keeps it
        self.policy_dir = policy_dir
        self.k = k
        self.dtype = model_dtype(policy_dir)  # published drafts follow the target's dtype
        self.resume_path = store.out_dir / RESUME_FILE
        self.live: nn.Module | None = None

    def write(self, module: nn.Module, policy_version: int, live: nn.Module | None = None) -> int:
        """``module`` as the next version, tagged with the policy version it was trained against;
        it (or ``live``, the same weights on the trainer's device) becomes the live draft.
        Returns the version."""
        def write(tmp: Path, version: int) -> None:
            self.method.export(module, tmp, self.policy_dir, fmt=self.format, num_speculative_tokens=self.k,
                               meta={"policy_version": int(policy_version), "version": version})

        version, _ = self.store.publish(write, policy_version=int(policy_version))
        self.live = self._on_trainer_device(module) if live is None else live.eval()
        return version

    def write_trainer(self, policy_version: int) -> int:
        """The trainer's current draft as the next version (:meth:`write`); on a GPU the live
        draft is a copy made on the device, not the exported host copy moved back."""
        on_host = self.trainer.device.type == "cpu"
        return self.write(self.trainer.export_draft(), policy_version, live=None if on_host else self.trainer.live_copy())

    def _on_trainer_device(self, module: nn.Module) -> nn.Module:
        """The live draft is scored against every round's candidate: on a GPU trainer it stays on
        the GPU (scoring an 8B-sized head on the host would take minutes; docs/design.md, "On a GPU")."""
        return module.eval().to(self.trainer.device)

    def publish(self, policy_version: int) -> int:
        """The trainer's current draft as the next version, with the trainer state beside it."""
        version = self.write_trainer(policy_version)
        self._save_resume(version)
        return version

    def _save_resume(self, version: int) -> None:
        state = {"draft_version": version, **self.trainer.resume_state()}
        if self.dtype != "float32":  # the published copy is rounded: keep what training holds
            state["weights"] = self.trainer.draft.state_dict()  # torch.save writes them out as they are now
        with atomic_path(self.resume_path) as tmp:
            torch.save(state, tmp)

    def resume(self, latest: DraftVersion, load) -> str:
        """After a restart over an existing output dir: the trainer trains on from its newest
        published draft (``load(path)`` reads it), with the trainer state saved beside it when that
        state belongs to that version. Returns what it continued from: "published" (the
        version's weights, fresh optimizer) or "checkpoint" (its weights and trainer state)."""
        check_identity(latest.meta.get("target"), target_fingerprint(self.policy_dir),
                       f"{self.store.out_dir} holds drafts built",
                       f"give this run (policy {self.policy_dir}) its own output directory")
        with torch.random.fork_rng(devices=[]):
            self.live = self._on_trainer_device(load(latest.path))
        self.trainer.reset_to(self.live)
        resumed_from = "published"
        try:
            state = torch.load(self.resume_path, weights_only=True)
        except FileNotFoundError:
            state = None
        except Exception as exc:  # noqa: BLE001 - a damaged state file costs the moments, not the run
            log.warning("adapter: %s is unreadable (%s); resuming version %d with a fresh optimizer",
                        self.resume_path, exc, latest.version)
            state = None
        if state is not None and state.get("draft_version") == latest.version:
            self.trainer.load_resume_state(state)
            if "weights" in state:  # the float32 weights a narrower published copy was rounded from
                with torch.no_grad():
                    self.trainer.draft.load_state_dict(state["weights"])
            resumed_from = "checkpoint"
        log.info("adapter: resumed from version %d (%s)", latest.version, resumed_from)
        return resumed_from


class EngineSwaps:
    """Engine side of one store: swaps in, and what each engine was given, to check it later."""

    def __init__(self, store: DraftStore):
        self.store = store
        # engine -> (checksum read back after our swap, the draft dir it came from)
        self._swapped_in: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def swap(self, engine) -> Any:
        """The newest version the engine may serve, in place (:meth:`DraftStore.swap_newest_into`).
        Returns the SwapResult or None."""
        res = self.store.swap_newest_into(engine)
        if res is not None:
            self._swapped_in[engine] = (res.checksum, engine.draft_dir)
        return res

    def intact(self, engine) -> bool:
        """Is the engine's draft still the one last swapped in? Swaps it in again if not.

        Other systems lost their drafts silently on weight sync or sleep/wake (docs/design.md,
        "Failures other systems shipped")."""
        # what this adapter put in (the engine's own record may be what went wrong)
        expected, path = self._swapped_in.get(engine, (engine.live_checksum, engine.draft_dir))
        state = engine.draft_state()
        if expected is None or state["checksum"] == expected:
            return True
        res = engine.swap_draft(path)
        self._swapped_in[engine] = (res.checksum, path)
        return False
