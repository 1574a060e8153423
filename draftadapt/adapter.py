"""DraftAdapter: the library API an RL loop calls to keep its draft aligned with the policy.

    adapter = DraftAdapter(policy_dir, draft_dir, out_dir, AdapterConfig())
    for step in rl_steps:
        result = engine.generate(prompts, ...)                   # rollouts from the live draft
        ... policy update ...
        engine.update_policy(weights, version=v)                 # the RL run's own weight sync
        adapter.check_integrity(engine)                          # the draft survived the sync
        adapter.observe(result.rollouts, policy_version=v - 1,   # what the policy sampled,
                        handover=ho)                             # + its states (HandOver, optional)
        adapter.update_policy(weights, version=v)                # the adapter's own HF copy
        if adapter.step()["adapt/published"]:                    # train -> validate -> publish
            adapter.swap(engine)                                 # in place, milliseconds

observe -> train (TTT unroll, forward KL to the policy) -> validate on held-out rollouts of the
newest policy version -> publish (atomic, versioned) -> swap (never a draft trained on a newer
policy than the engine serves).

With a hand-over (``adapter.handover(policy)``, see ``capture.hidden.HandOver``) the targets are
the aux states and log-probs of the RL trainer's own forward over the rollouts, i.e. of the policy
that sampled them, and the adapter runs no policy forward at all; without one it captures them
from its own copy of the current policy (docs/design.md, "Hand-over").
"""

from __future__ import annotations

import logging
import math
import random
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import torch

from draftadapt.capture.hidden import CapturedBatch, HandOver, TargetCapture
from draftadapt.config import ConfigError
from draftadapt.data.replay import ReplayBuffer, ReplayItem
from draftadapt.data.sequences import Sequence as TokenSeq
from draftadapt.data.sequences import collate
from draftadapt.data.store import DraftStore
from draftadapt.drafts.formats import (
    DraftFormatError,
    check_draft_for_target,
    detect_format,
    identity_mismatch,
    model_dtype,
    read_hf_config,
    target_fingerprint,
)
from draftadapt.fileio import atomic_path
from draftadapt.tensors import all_finite
from draftadapt.train.trainer import DraftTrainer, TrainConfig, score_draft

log = logging.getLogger("draftadapt.adapter")
# beside the published versions: the trainer state of the newest one (optimizer moments, step)
RESUME_FILE = ".trainer/resume.pt"


@dataclass
class ScheduleConfig:
    every_n_steps: int = 1  # train after every N observed RL steps; 0 = only when drift triggers
    # Also train when the acceptance (measured in the engine, or simulated on the newest
    # rollouts) fell by this fraction since the last publish; 0 disables the trigger.
    drift_fraction: float = 0.05
    train_steps: int = 12  # optimizer steps per adaptation round
    min_sequences: int = 16  # do not train on fewer buffered sequences than this
    # Catch-up: while the policy runs away from the draft, one round of train_steps is not enough.
    # After each block of train_steps the candidate is scored on the held-out rollouts; another
    # block follows while the last one raised that score by at least catchup_gain (a fraction),
    # up to max_train_steps in the round. 0 = off (one block a round).
    max_train_steps: int = 0
    catchup_gain: float = 0.02

    def validate(self) -> None:
        if self.every_n_steps < 0 or self.train_steps < 1 or not 0 <= self.drift_fraction < 1:
            raise ConfigError(
                "schedule: every_n_steps >= 0, train_steps >= 1 and 0 <= drift_fraction < 1 "
                f"(got {self.every_n_steps}, {self.train_steps}, {self.drift_fraction})"
            )
        if self.max_train_steps and (self.max_train_steps < self.train_steps or self.catchup_gain <= 0):
            raise ConfigError(
                "schedule: max_train_steps is 0 (no catch-up) or >= train_steps, with catchup_gain > 0 "
                f"(got max_train_steps={self.max_train_steps}, train_steps={self.train_steps}, "
                f"catchup_gain={self.catchup_gain})"
            )


@dataclass
class ValidateConfig:
    # A candidate is published unless its simulated acceptance length on held-out rollouts of the
    # newest policy is below the live draft's by more than this fraction.
    margin: float = 0.01
    heldout_fraction: float = 0.25  # of the newest version's rollouts, never trained on
    max_heldout: int = 64  # sequences

    def validate(self) -> None:
        if not 0 <= self.margin < 1 or not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"validation: margin in [0,1) and heldout_fraction in (0,1); got {self.margin}, {self.heldout_fraction}")


@dataclass
class AdapterConfig:
    method: str = "eagle3"  # eagle3 | draft_model (must match the draft directory)
    k: int = 3  # speculative tokens the engine drafts (for the simulated acceptance)
    temperature: float = 1.0  # the engine's sampling temperature (the target distribution to match)
    replay_max_tokens: int = 200_000  # bound of the replay buffer in tokens
    replay_max_bytes: int = 512 << 20  # and in bytes (handed-over hidden states count)
    recency_decay: float = 0.5  # sampling weight of a sequence = decay ** (newest version - its version)
    # Regroup one training round's draws by length (same sequences, same number of steps): each
    # batch pads to its own longest sequence instead of to the longest of a random mix.
    group_by_length: bool = True
    # What the draft learns to match for rollouts handed over with their states: "sampling" = the
    # policy that sampled them (the hand-over's tensors as they are; no policy forward), "current"
    # = the adapter's current policy copy (recaptured, one forward per batch). Rollouts observed
    # without a hand-over are always captured against the current policy.
    targets: str = "sampling"
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    validation: ValidateConfig = field(default_factory=ValidateConfig)  # the gate before a publish
    # old key -> new key: a config.yaml saved before a rename fails naming the new key
    RENAMED: ClassVar[dict[str, str]] = {"validate_cfg": "validation"}
    # Online fine-tuning of an already trained draft: a gentler, constant rate than pretraining.
    # train.batch_size is the sequences per capture / optimizer step and train.seed seeds the
    # replay draws too: one setting each (``k`` is what the engine drafts, for scoring; the
    # training depth is train.ttt_steps).
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=3e-4, warmup_steps=0, schedule="constant"))

    def validate(self) -> None:
        if self.method not in ("eagle3", "draft_model"):
            raise ConfigError(f"adapter.method {self.method!r}: use eagle3 or draft_model")
        if self.targets not in ("sampling", "current"):
            raise ConfigError(f"adapter.targets {self.targets!r}: use 'sampling' or 'current'")
        if self.k < 1 or self.temperature <= 0:
            raise ConfigError(f"adapter.k >= 1 and adapter.temperature > 0 (got {self.k}, {self.temperature})")
        self.schedule.validate()  # also when built in code, not only through load_config
        self.validation.validate()
        self.train.validate()


def group_by_length(batches: list[list[ReplayItem]], rng: random.Random) -> list[list[ReplayItem]]:
    """The same items in the same batch sizes, regrouped shortest to longest, in a shuffled
    (deterministic) batch order so no run of steps sees only long or only short sequences."""
    pool = sorted((it for b in batches for it in b), key=lambda it: len(it.token_ids))
    out, lo = [], 0
    for b in batches:
        out.append(pool[lo: lo + len(b)])
        lo += len(b)
    order = rng.sample(range(len(out)), len(out))
    return [out[i] for i in order]


def _as_token_seqs(rollouts: Iterable[Any]) -> list[TokenSeq]:
    """Rollouts as (prompt ids, response ids), in order: engine Rollouts, spool records, pairs or dicts."""
    out = []
    for r in rollouts:
        if hasattr(r, "prompt_token_ids"):
            out.append(TokenSeq(list(r.prompt_token_ids), list(r.token_ids)))
        elif hasattr(r, "prompt_ids"):
            out.append(TokenSeq(list(r.prompt_ids), list(r.response_ids)))
        elif isinstance(r, dict):
            out.append(TokenSeq(list(r["prompt_ids"]), list(r["response_ids"])))
        else:
            p, c = r
            out.append(TokenSeq(list(p), list(c)))
    for s in out:
        if s.response_ids and not s.prompt_ids:
            raise ValueError("a rollout has no prompt tokens; pass the prompt ids the engine was given")
    return out


def _load_policy(path_or_dir: str | Path):
    from transformers import AutoModelForCausalLM

    # the model's own dtype (a bf16 policy stays bf16; captured states are widened for training)
    return AutoModelForCausalLM.from_pretrained(str(path_or_dir), dtype="auto")


def _load_draft(draft_dir: Path, target_dir: Path, method: str):
    from draftadapt.drafts.formats import load_eagle3
    from draftadapt.drafts.small_lm import load_small_lm

    fmt = detect_format(read_hf_config(draft_dir))
    if method == "eagle3":
        if fmt == "hf":
            raise ConfigError(f"{draft_dir} is a draft LM; set adapter.method=draft_model")
        return load_eagle3(draft_dir, target_dir), fmt
    if fmt != "hf":
        raise ConfigError(f"{draft_dir} is an Eagle-3 head; set adapter.method=eagle3")
    return load_small_lm(draft_dir), fmt


class DriftTrigger:
    """When a round is due: every N observed RL steps, or when acceptance fell by a fraction since
    the last publish (measured in the engine when reported, else simulated by the caller)."""

    def __init__(self, cfg: ScheduleConfig):
        self.cfg = cfg
        self.steps_since_train = 0
        self.reference: float | None = None  # acceptance at the last publish
        self.measured: float | None = None  # the engine's latest measurement of the live draft

    def observed(self) -> None:
        self.steps_since_train += 1

    def report(self, acceptance_length: float) -> None:
        first = self.measured is None
        self.measured = float(acceptance_length)
        if self.reference is None or first:
            # measured and simulated lengths are not comparable: the engine's first measurement
            # replaces a reference simulated before it
            self.reference = self.measured

    def due(self, buffered: int, simulate_live) -> tuple[bool, str]:
        """``simulate_live()``: the live draft's simulated acceptance, for runs with no engine."""
        s = self.cfg
        if buffered < s.min_sequences:
            return False, "too_few_sequences"
        if s.every_n_steps and self.steps_since_train >= s.every_n_steps:
            return True, "schedule"
        if s.drift_fraction:
            now = self.measured
            if now is None and (self.steps_since_train > 0 or self.reference is None):
                now = simulate_live()
            if self.reference is None:
                # no engine measurement and no publish yet: the live draft's score now is the reference
                self.reference = now
            elif now is not None and now < self.reference * (1 - s.drift_fraction):
                return True, "drift"
        return False, "not_due"

    def trained(self, published: bool, candidate: float) -> None:
        self.steps_since_train = 0
        if published:
            # drift is measured from here: the engine's next measurement of this draft, or
            # (without an engine) its simulated score
            self.reference = None if self.measured is not None else candidate


class DraftAdapter:
    """Observe rollouts, train the draft against the policy, validate, publish, swap."""

    def __init__(self, policy_dir: str | Path, draft_dir: str | Path, out_dir: str | Path,
                 cfg: AdapterConfig | None = None, logger=None, policy_version: int = 0):
        self.cfg = cfg or AdapterConfig()
        self.cfg.validate()
        self.policy_dir = Path(policy_dir)
        self.logger = logger
        # Building modules draws from torch's global RNG before their weights are loaded; the
        # host's RNG stream must not notice (docs/design.md, "TRL integration").
        with torch.random.fork_rng(devices=[]):
            # a draft built for another target is refused here, never relabelled by a publish
            check_draft_for_target(draft_dir, self.policy_dir)
            self.policy = _load_policy(self.policy_dir)
            draft, self.format = _load_draft(Path(draft_dir), self.policy_dir, self.cfg.method)
        self.policy.eval()
        self.policy_version = policy_version
        pc = self.policy.config.get_text_config()
        self.vocab_size = int(pc.vocab_size)
        self.max_positions = int(getattr(pc, "max_position_embeddings", 0) or 0)
        pad = self.policy.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)
        self.trainer = DraftTrainer(draft, self.cfg.method, self.cfg.train, pad_id=self.pad_id)
        aux = list(draft.cfg.aux_layer_ids) if self.cfg.method == "eagle3" else None
        vocab = None
        if self.cfg.method == "eagle3":
            from draftadapt.drafts.vocab import draft_to_target_ids

            vocab = draft_to_target_ids(draft.d2t)
        self.capture = TargetCapture(self.policy, aux, vocab, temperature=self.cfg.temperature)
        self.aux_width = len(aux or []) * int(pc.hidden_size)  # of handed-over aux states
        self.replay = ReplayBuffer(
            self.cfg.replay_max_tokens, self.cfg.replay_max_bytes, self.cfg.recency_decay,
            holdout_fraction=self.cfg.validation.heldout_fraction, max_heldout=self.cfg.validation.max_heldout,
        )
        self.store = DraftStore(out_dir)
        self._publish_dtype = model_dtype(self.policy_dir)  # published drafts follow the target's dtype
        self._resume_path = Path(out_dir) / RESUME_FILE
        self.rng = random.Random(self.cfg.train.seed)
        self.trigger = DriftTrigger(self.cfg.schedule)
        # engine -> (checksum read back after our swap, the draft dir it came from)
        self._swapped_in: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._round: Future | None = None  # a round started by start_step, not yet finished
        self._round_pool: ThreadPoolExecutor | None = None
        latest = self.store.latest()
        # what a restart continued from: "start" (a new run), "published" (the newest version's
        # weights, fresh optimizer) or "checkpoint" (its weights and the trainer state beside it)
        self.resumed_from = "start"
        if latest is None:
            # the starting draft is version 0 of this run: what the engine serves before any swap
            self._live = self._publish_module(self.trainer.export_draft(), policy_version)[1]
        else:
            self._live = self._resume(latest)

    # ------------------------------------------------------------------ restart

    def _resume(self, latest) -> Any:
        """After a restart over an existing output dir: train on from its newest published draft,
        with the trainer state saved beside it when that state belongs to that version."""
        differ = identity_mismatch(latest.meta.get("target") or {}, target_fingerprint(self.policy_dir))
        if differ:
            raise DraftFormatError(
                f"{self.store.out_dir} holds drafts built for another target ({', '.join(differ)} differ from "
                f"{self.policy_dir}); give this run its own output directory"
            )
        with torch.random.fork_rng(devices=[]):
            live = _load_draft(latest.path, self.policy_dir, self.cfg.method)[0].eval()
        self.trainer.reset_to(live)
        self.resumed_from = "published"
        try:
            state = torch.load(self._resume_path, weights_only=True)
        except FileNotFoundError:
            state = None
        except Exception as exc:  # noqa: BLE001 - a damaged state file costs the moments, not the run
            log.warning("adapter: %s is unreadable (%s); resuming version %d with a fresh optimizer",
                        self._resume_path, exc, latest.version)
            state = None
        if state is not None and state.get("draft_version") == latest.version:
            self.trainer.load_resume_state(state)
            if "weights" in state:  # the float32 weights a narrower published copy was rounded from
                with torch.no_grad():
                    self.trainer.draft.load_state_dict(state["weights"])
            self.resumed_from = "checkpoint"
        log.info("adapter: resumed from version %d (%s)", latest.version, self.resumed_from)
        return live

    def _save_resume(self, version: int) -> None:
        state = {"draft_version": version, **self.trainer.resume_state()}
        if self._publish_dtype != "float32":  # the published copy is rounded: keep what training holds
            state["weights"] = self.trainer.draft.state_dict()  # torch.save writes them out as they are now
        with atomic_path(self._resume_path) as tmp:
            torch.save(state, tmp)

    # ------------------------------------------------------------------ inputs

    def handover(self, policy) -> HandOver:
        """A :class:`HandOver` for the RL trainer's own forward over its rollouts (forward hooks on
        ``policy``'s aux layers; see its docstring): pass it to :meth:`observe` afterwards."""
        return HandOver(policy, self.capture.aux_layer_ids, self.capture.draft_to_target, self.cfg.temperature)

    def observe(self, rollouts: Iterable[Any], policy_version: int, handover: HandOver | None = None,
                hidden_states: Sequence[torch.Tensor] | None = None, source: str | None = None) -> int:
        """Add one RL step's rollouts, sampled from policy ``policy_version``; returns how many.

        ``handover``: the states the RL trainer's forward over these rollouts produced (one row
        per rollout, in order). With it the adapter runs no policy forward for them.
        ``hidden_states`` (the spool's form: one [len(prompt)+len(response), num_aux*H] tensor
        per rollout, aux states only): used while the adapter's policy is at that same version;
        the log-probs then still come from the adapter's own forward.
        ``source``: a name for these rollouts (e.g. the spool shard), for :meth:`forget`.

        Refused with ValueError naming the rollout, nothing added: token ids outside the policy's
        vocabulary, more tokens than its max positions, hidden states of the wrong shape or non-finite.
        """
        self._wait_round()
        seqs = _as_token_seqs(rollouts)
        given: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
        if handover is not None:
            given = list(handover.tensors(len(seqs)))
        elif hidden_states is not None:
            hidden_states = list(hidden_states)
            if len(hidden_states) != len(seqs):
                raise ValueError(f"observe: {len(hidden_states)} hidden-state tensors for {len(seqs)} rollouts")
            given = [{"aux_hidden": torch.as_tensor(h)} for h in hidden_states]
        # every rollout is checked before any enters the buffer: a bad one would fail every
        # later round (docs/design.md, "Checks at the door")
        for i, (s, extra) in enumerate(zip(seqs, given)):
            self._check_rollout(i, s, extra)
        if hidden_states is not None and handover is None:
            given = [{"aux_hidden": g["aux_hidden"].detach().to(torch.bfloat16).cpu()} for g in given]
        added = 0
        for i, (s, extra) in enumerate(zip(seqs, given)):
            if not s.response_ids:
                continue
            self.replay.add(s.prompt_ids, s.response_ids, policy_version, extra,
                            source=None if source is None else f"{source}#{i}")
            added += 1
        self.trigger.observed()
        return added

    def _check_rollout(self, i: int, s: TokenSeq, extra: dict[str, torch.Tensor] | None) -> None:
        ids = torch.as_tensor(s.prompt_ids + s.response_ids)
        if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise ValueError(f"observe: rollout {i} has token ids of dtype {ids.dtype}; pass integer ids")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.numel():
            raise ValueError(f"observe: rollout {i} has token ids {bad[:4].tolist()} outside the policy's vocabulary "
                             f"(0..{self.vocab_size - 1}); pass the ids the engine returned")
        if self.max_positions and len(ids) > self.max_positions:
            raise ValueError(f"observe: rollout {i} has {len(ids)} tokens, over the policy's max_position_embeddings "
                             f"{self.max_positions}; truncate it or drop it")
        width = self.aux_width
        for name, t in (extra or {}).items():
            if t.dim() != 2 or t.shape[0] != len(ids):
                raise ValueError(f"observe: {name} of rollout {i} has shape {tuple(t.shape)}; it needs one row per "
                                 f"token of prompt + response ({len(ids)})")
            if name == "aux_hidden" and t.shape[1] != width:
                raise ValueError(f"observe: aux_hidden of rollout {i} is {t.shape[1]} wide; this draft reads "
                                 f"aux layers {self.capture.aux_layer_ids} of the policy, {width} wide together")
            # log-probs may be -inf
            finite = all_finite(t) if name == "aux_hidden" else not bool(torch.isnan(t).any())
            if not finite:
                raise ValueError(f"observe: {name} of rollout {i} holds NaN or Inf; not added")

    def forget(self, source: str) -> int:
        """Drop the rollouts observed with ``source`` (e.g. a shard that made a round fail)."""
        return self.replay.remove(lambda it: it.source is not None and it.source.rsplit("#", 1)[0] == source)

    def update_policy(self, weights_or_path: str | Path | dict[str, torch.Tensor], version: int) -> None:
        """Load the policy's new weights into the adapter's own HF copy (a dir, a file or a state dict)."""
        self._wait_round()
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the adapter's {self.policy_version}")
        if isinstance(weights_or_path, dict):
            sd = weights_or_path
        else:
            p = Path(weights_or_path)
            from safetensors.torch import load_file

            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
            if not files:
                raise FileNotFoundError(f"no *.safetensors policy weights in {p}")
            sd = {}
            for f in files:
                sd.update(load_file(str(f)))
        self._check_policy_weights(sd)
        self.policy.load_state_dict(sd, strict=False)
        self.policy_version = version

    def _check_policy_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Names, shapes, dtypes and finiteness, all before anything is loaded: a refused update
        leaves the adapter's policy as it was."""
        ref = self.policy.state_dict()
        missing = [k for k in ref if k not in sd and "rotary" not in k]
        unexpected = [k for k in sd if k not in ref]
        wrong = [f"{k} {tuple(v.shape)} (needs {tuple(ref[k].shape)})" for k, v in sd.items()
                 if k in ref and tuple(v.shape) != tuple(ref[k].shape)]
        if missing or unexpected or wrong:
            raise ValueError(
                f"policy weights do not fit the adapter's copy of {self.policy_dir}: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}, wrong shape {wrong[:4]}; pass the HF state dict of the same architecture"
            )
        not_float = [k for k, v in sd.items() if ref[k].is_floating_point() and not v.is_floating_point()]
        if not_float:
            raise ValueError(f"policy weights {not_float[:4]} are not floating point; pass the model's own tensors")
        bad = [k for k, v in sd.items() if not all_finite(v)]
        if bad:
            raise ValueError(f"policy weights {bad[:4]} hold NaN or Inf; not loaded, the adapter keeps version "
                             f"{self.policy_version}")

    def report_measured(self, acceptance_length: float) -> None:
        """The acceptance length the engine measured for the live draft (feeds the drift trigger).

        The first measurement after a publish is the reference a later drop is measured against."""
        self.trigger.report(acceptance_length)

    # ------------------------------------------------------------------ capture

    def _handed_over(self, it: ReplayItem) -> bool:
        return self.cfg.targets == "sampling" and "target_logp" in it.tensors

    def _captured(self, items: list[ReplayItem]) -> CapturedBatch:
        """One training or scoring batch: the handed-over targets as they are, or captured against
        the adapter's current policy copy (aux states handed over without log-probs replace the
        recomputed ones where that same policy version produced them)."""
        batch = collate([it.sequence() for it in items], self.pad_id)
        if all(self._handed_over(it) for it in items):
            return CapturedBatch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                 _pad_rows([it.tensors["target_logp"] for it in items], batch["input_ids"].shape[1]),
                                 _pad_rows([it.tensors.get("aux_hidden") for it in items], batch["input_ids"].shape[1]))
        logp, aux = self.capture(batch["input_ids"], batch["attention_mask"])
        if aux is not None:
            for r, it in enumerate(items):
                h = it.tensors.get("aux_hidden")
                if h is not None and it.policy_version == self.policy_version:
                    aux[r, : h.shape[0]] = h.to(aux.dtype)
        return CapturedBatch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], logp, aux)

    def _batches(self, items: list[ReplayItem], size: int) -> list[CapturedBatch]:
        return [self._captured(items[i: i + size]) for i in range(0, len(items), size)]

    def score(self, module, batches: list[CapturedBatch]) -> float:
        """Simulated acceptance length (vLLM's greedy drafting, k tokens) of a draft module (bare,
        or the trainer's wrapped one) on captured batches."""
        visited, _ = score_draft(module, batches, self.cfg.k)
        return visited.length

    # ------------------------------------------------------------------ the loop

    def _train_block(self, train: list[ReplayItem], n: int) -> dict[str, float]:
        """``n`` optimizer steps on batches drawn from ``train`` (recent versions weighted up)."""
        bs = self.cfg.train.batch_size
        picks = [self.replay.sample(n_seqs=bs, rng=self.rng, items=train) for _ in range(n)]
        if self.cfg.group_by_length:
            picks = group_by_length(picks, self.rng)
        return self.trainer.train_steps((self._captured(p) for p in picks), n=n)

    def _score_candidate(self, held: list[CapturedBatch]) -> float:
        """The trainer's draft as it stands, scored in place (no export copy)."""
        model = self.trainer.model
        model.eval()
        try:
            return self.score(model, held)
        finally:
            model.train()

    # ------------------------------------------------------------------ background rounds

    def start_step(self, force: bool = False) -> None:
        """Run :meth:`step` in a background thread while the RL loop goes on (the next rollouts,
        the next update); :meth:`finish_step` returns its metrics. Every other adapter call first
        waits for the round, so the replay buffer, the trainer and the store are never used by two
        threads at once. On a 2-core CPU the round competes with generation for the cores
        (docs/design.md, "Background rounds")."""
        if self._round is not None:
            raise RuntimeError("a background adapter round is still open: call finish_step() before starting another")
        if self._round_pool is None:
            self._round_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftadapt-round")
        self._round = self._round_pool.submit(self._step, force)

    def finish_step(self) -> dict[str, float]:
        """Wait for the round :meth:`start_step` began and return its metrics ({} when none is
        open); an error raised in the round is raised here."""
        round_, self._round = self._round, None
        return {} if round_ is None else round_.result()

    def _wait_round(self) -> None:
        if self._round is not None:
            wait([self._round])

    def close(self) -> None:
        """Finish an open background round and stop its thread (nothing else to release)."""
        try:
            self.finish_step()
        finally:
            if self._round_pool is not None:
                self._round_pool.shutdown(wait=True)
                self._round_pool = None

    def step(self, force: bool = False) -> dict[str, float]:
        """Train if the schedule says so, validate, and publish a better draft. Returns metrics."""
        self._wait_round()
        return self._step(force)

    def _step(self, force: bool) -> dict[str, float]:
        due, why = self.trigger.due(len(self.replay), lambda: self.score(self.live_draft(), self._batches(
            self.replay.heldout(), self.cfg.train.batch_size)))
        metrics: dict[str, float] = {"adapt/trained": 0.0, "adapt/published": 0.0, "adapt/rejected": 0.0}
        if not (due or force and len(self.replay) > 0):
            metrics["adapt/skipped"] = 1.0
            return metrics
        t0 = time.perf_counter()
        heldout, train = self.replay.split_recent()
        # The buffer holds out whole prompts of the newest version (GRPO groups sample a prompt
        # several times), but the max_heldout cap can cut a group and an older version may hold
        # the same prompt; a held-out rollout whose prompt is trained on would flatter the
        # candidate, so those rollouts sit this round out.
        held_prompts = {it.prompt_key for it in heldout}
        train = [it for it in train if it.prompt_key not in held_prompts]
        if not heldout or not train:
            metrics["adapt/skipped"] = 1.0
            return metrics
        # Both drafts are scored on the same held-out rollouts, captured once: a score remembered
        # from an older policy is not comparable (when the policy moves fast every score falls,
        # and a stale live score would reject every candidate).
        held = self._batches(heldout, self.cfg.train.batch_size)
        live = self.score(self.live_draft(), held)
        self.refresh_shared_embeddings()
        sched = self.cfg.schedule
        budget = max(sched.max_train_steps, sched.train_steps)
        done, before = 0, live
        while True:
            train_metrics = self._train_block(train, sched.train_steps)
            done += sched.train_steps
            candidate = self._score_candidate(held)
            # another block only while the last one still paid off (the draft is behind the policy)
            if done + sched.train_steps > budget or candidate < before * (1 + sched.catchup_gain):
                break
            before = candidate
        metrics.update({k: v for k, v in train_metrics.items() if k.startswith("train/")})
        if not math.isfinite(train_metrics.get("train/loss", 0.0)) or not self.trainer.weights_finite():
            # a non-finite round would poison every later one: back to the live draft, fresh moments
            self.trainer.reset_to(self.live_draft())
            log.warning("adapter: the round's loss or weights went non-finite; the trainer is back at the live draft")
            metrics.update({"adapt/trained": 1.0, "adapt/rolled_back": 1.0, "adapt/rejected": 1.0,
                            "train/loss": float("nan")})
            self.trigger.trained(False, live)
            metrics["stage/adapt_s"] = time.perf_counter() - t0
            if self.logger is not None:
                self.logger.log_dict({k: v for k, v in metrics.items() if math.isfinite(v)}, step=self.policy_version)
            return metrics
        metrics.update({
            "adapt/train_steps": float(done),
            "adapt/trained": 1.0,
            "adapt/trigger_drift": float(why == "drift"),
            "accept/simulated_length": candidate,
            "accept/simulated_live": live,
            "adapt/heldout_seqs": float(len(heldout)),
        })
        published = candidate >= live * (1 - self.cfg.validation.margin)
        if published:
            # tagged with the newest policy its targets came from: the sampling policy of the
            # newest rollouts when they were handed over, else the adapter's current copy
            target_version = self.policy_version
            if all(self._handed_over(it) for it in train + heldout):
                target_version = max(it.policy_version for it in train + heldout)
            version = self._publish(target_version)
            metrics["adapt/published"] = 1.0
            metrics["draft/published_version"] = float(version)
        else:
            metrics["adapt/rejected"] = 1.0
        self.trigger.trained(published, candidate)
        metrics["stage/adapt_s"] = time.perf_counter() - t0
        if self.logger is not None:
            self.logger.log_dict(metrics, step=self.policy_version)
        return metrics

    def refresh_shared_embeddings(self, head=None) -> None:
        """A head that shares the target's embed_tokens sees the policy's current ones (as in vLLM)."""
        head = self.trainer.draft if head is None else head
        if self.cfg.method == "eagle3" and head.cfg.share_embeddings:
            with torch.no_grad():
                head.embed_tokens.weight.copy_(self.policy.get_input_embeddings().weight)

    def live_draft(self):
        """The newest published draft as the engine serves it (shared modules from the current
        policy). Kept in memory from its publish; callers must not modify it."""
        self.refresh_shared_embeddings(self._live)
        return self._live

    def _publish_module(self, module, policy_version: int) -> tuple[int, Any]:
        """Write ``module`` as the next version; returns (version, module in eval mode), now the live draft."""
        from draftadapt.drafts.init import export_draft

        fmt = self.format if self.format in ("speculators", "eagle") else "speculators"

        def write(tmp: Path, version: int) -> None:
            export_draft(module, self.cfg.method, tmp, self.policy_dir, fmt=fmt, num_speculative_tokens=self.cfg.k,
                         meta={"policy_version": int(policy_version), "version": version})

        version, _ = self.store.publish(write, policy_version=int(policy_version))
        return version, module.eval()

    def publish(self, policy_version: int | None = None) -> int:
        """Write the trainer's current draft as a new version (atomic), tagged with the policy
        version it was trained against (default: the adapter's current one)."""
        self._wait_round()
        return self._publish(policy_version)

    def _publish(self, policy_version: int | None) -> int:
        pv = self.policy_version if policy_version is None else policy_version
        version, self._live = self._publish_module(self.trainer.export_draft(), pv)
        self._save_resume(version)
        return version

    # ------------------------------------------------------------------ engine side

    def swap(self, engine) -> Any:
        """Put the newest published draft the engine may serve into it, in place
        (:meth:`DraftStore.swap_newest_into`: never one trained on a newer policy than the engine
        serves, never an older version than it served). Returns the SwapResult or None."""
        self._wait_round()
        res = self.store.swap_newest_into(engine)
        if res is None:
            return None
        self._swapped_in[engine] = (res.checksum, engine.draft_dir)
        if self.logger is not None:
            self.logger.log_dict({"swap/ms": res.ms, "draft/version": float(res.version)}, step=self.policy_version)
        return res

    def check_integrity(self, engine) -> bool:
        """After a policy update: is the live draft still the one last swapped in? Repair if not.

        Other systems lost their drafts silently on weight sync or sleep/wake (docs/design.md,
        "Failures other systems shipped"). Returns True when the draft was intact.
        """
        self._wait_round()
        # what this adapter put in (the engine's own record may be what went wrong)
        expected, path = self._swapped_in.get(engine, (engine.live_checksum, engine.draft_dir))
        state = engine.draft_state()
        if expected is None or state["checksum"] == expected:
            return True
        res = engine.swap_draft(path)
        self._swapped_in[engine] = (res.checksum, path)
        if self.logger is not None:
            self.logger.log_dict({"draft/integrity_repairs": 1.0}, step=self.policy_version)
        return False

    @property
    def live_version(self) -> int | None:
        latest = self.store.latest()
        return None if latest is None else latest.version


def _pad_rows(rows: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Per-sequence [n_i, D] tensors -> [B, width, D] float32, zero past each row's end."""
    if rows[0] is None:
        return None
    out = torch.zeros((len(rows), width, rows[0].shape[-1]), dtype=torch.float32)
    for r, t in enumerate(rows):
        out[r, : t.shape[0]] = t
    return out
