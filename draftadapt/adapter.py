"""DraftAdapter: the library API an RL loop calls to keep its draft aligned with the policy.

    adapter = DraftAdapter(policy_dir, draft_dir, out_dir, AdapterConfig())
    boundary = StepBoundary(adapter, engine)                     # draftadapt/boundary.py
    for step in rl_steps:
        result = engine.generate(prompts, ...)                   # rollouts from the live draft
        ... policy update (with adapter.handover(policy) as ho) ...
        boundary.after_update(result.rollouts, sampled_version=v - 1, weights=weights, version=v, handover=ho)

The boundary makes the calls below in their one order (the engine's policy sync, the draft's
integrity, observe, update_policy, run_round, swap); call them yourself only where no boundary
fits.

observe -> train (TTT unroll, forward KL to the policy) -> validate on held-out rollouts of the
newest policy version -> publish (atomic, versioned) -> swap (never a draft trained on a newer
policy than the engine serves).

With a hand-over (``adapter.handover(policy)``, see ``capture.hidden.HandOver``) the targets are
the aux states and log-probs of the RL trainer's own forward over the rollouts, i.e. of the policy
that sampled them, and the adapter runs no policy forward at all; without one it captures them
from its own copy of the current policy (docs/design.md, "Hand-over").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import random
import time
import weakref
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import torch

from draftadapt.capture.hidden import CapturedBatch, HandOver
from draftadapt.capture.policy import PolicyCopy, Targets
from draftadapt.config import ConfigError
from draftadapt.data.replay import MAX_PRIORITY, ReplayBuffer, ReplayItem
from draftadapt.data.sequences import as_sequences
from draftadapt.data.store import DraftStore
from draftadapt.drafts.formats import check_draft_for_target, detect_format, read_hf_config
from draftadapt.drafts.serving import METHODS, check_serves
from draftadapt.publish import EngineSwaps, Publisher
from draftadapt.threads import JobThreads
from draftadapt.train.methods import DraftMethod, method_for
from draftadapt.train.trainer import DraftTrainer, TrainConfig, score_draft

log = logging.getLogger("draftadapt.adapter")


@dataclass
class ScheduleConfig:
    every_n_steps: int = 1  # train after every N observed RL steps; 0 = only when drift triggers
    # Also train when the acceptance (measured in the engine, or simulated on the newest
    # rollouts) fell by this fraction since the last round; 0 disables the trigger.
    drift_fraction: float = 0.05
    train_steps: int = 12  # optimizer steps per adaptation round
    min_sequences: int = 16  # do not train on fewer buffered sequences than this
    # Catch-up: a round's most optimizer steps, in blocks of train_steps, for while the policy runs
    # away from the draft and one block is not enough. After each block the candidate is scored
    # on the held-out rollouts; another block follows while the last one raised that score by at
    # least catchup_gain (a fraction), up to max_train_steps in the round. 0 = off (one block a round).
    max_train_steps: int = 0
    catchup_gain: float = 0.02  # catch-up: the rise in held-out score (a fraction) a block must bring for another to follow
    # Chase: a round whose candidate beat the live draft by at least this fraction (on the same
    # held-out rollouts of the newest policy) found the draft behind a moving policy; the next
    # round is then due at the very next RL step instead of after every_n_steps. 0 = off.
    chase_gain: float = 0.0
    # Cost cap: a due round waits while the adapter's own calls (observe, update_policy, run_round,
    # swap, check_integrity) plus the last round's duration would exceed this share of the wall
    # time since its first call; the round stays due and runs once the run has earned the time.
    # Chase and drift rounds then take the time the schedule would have spent later. 0 = off.
    max_share: float = 0.0
    # Under max_share, the rounds a drift or a chase calls for may run this many rounds' time
    # ahead of the budget (the burst is when following pays); the schedule's rounds wait until
    # the run has paid the advance back.
    burst_rounds: int = 0
    # Partial rounds: under max_share, a due round whose whole cost does not fit runs the
    # optimizer steps that do (at least one, at most train_steps; the budget counts the round's
    # capture and scoring too, from the last round's measured times), drawing the sequences the
    # served draft fails on most (prioritized replay: newest, untrained-on sequences first)
    # instead of waiting until the draft is stale (docs/design.md, "Rounds the budget affords").
    partial_rounds: bool = True
    # The served draft's age bound, in policy versions: once the served draft was last trained or
    # validated against the policy this many versions ago, a due round runs even where not one
    # step fits the budget (the steps that fit, at least one). 0 = no bound.
    max_draft_age: int = 4

    def validate(self) -> None:
        if self.every_n_steps < 0 or self.train_steps < 1 or not 0 <= self.drift_fraction < 1:
            raise ConfigError(
                "schedule: every_n_steps >= 0, train_steps >= 1 and 0 <= drift_fraction < 1 "
                f"(got {self.every_n_steps}, {self.train_steps}, {self.drift_fraction})"
            )
        if self.burst_rounds < 0 or self.max_draft_age < 0:
            raise ConfigError(f"schedule: burst_rounds >= 0 and max_draft_age >= 0, 0 = no bound "
                              f"(got {self.burst_rounds}, {self.max_draft_age})")
        if not 0 <= self.max_share < 1:
            raise ConfigError(f"schedule: max_share is a fraction of the run's time in [0, 1), 0 = off (got {self.max_share})")
        if self.chase_gain < 0:
            raise ConfigError(f"schedule: chase_gain is a fraction >= 0, 0 = off (got {self.chase_gain})")
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
    # Keep the better draft: at every round call the served draft and the frozen first draft are
    # scored on the same held-out rollouts of the newest policy; when the served one is below the
    # frozen one by more than guard_margin (a fraction), the frozen draft is published and
    # swapped back in (docs/design.md, "Keep the better draft").
    guard: bool = True
    guard_margin: float = 0.03  # how far (a fraction) the served draft may fall below the frozen one before it goes back
    # Notice a lost draft: when the engine accepts fewer first draft tokens than this fraction of
    # what the draft it should serve simulates on the same step's rollouts, the draft is taken as
    # lost in the engine (weights lost, zeroed or never loaded) and the newest version is swapped
    # in again at the boundary (docs/design.md, "Notice a lost draft"). 0: no check.
    lost_below: float = 0.5

    def validate(self) -> None:
        if not 0 <= self.margin < 1 or not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"validation: margin in [0,1) and heldout_fraction in (0,1); got {self.margin}, {self.heldout_fraction}")
        if not 0 <= self.guard_margin < 1:
            raise ConfigError(f"validation: guard_margin is a fraction in [0, 1) (got {self.guard_margin})")
        if not 0 <= self.lost_below < 1:
            raise ConfigError(f"validation: lost_below is a fraction in [0, 1), 0 turns the check off (got {self.lost_below})")


# The run's facts, when nothing passes them: what DraftAdapter serves, scores and matches.
RUN_DEFAULTS = {"method": "eagle3", "k": 3, "temperature": 1.0}
# Below this simulated first-token acceptance a draft proposes too little for a collapse in the
# engine's counters to be told from noise: the lost-draft check waits (an untrained head: ~0.02).
LOST_MIN_FIRST_RATE = 0.1


@dataclass
class AdapterConfig:
    # The run's facts. The run the adapter is attached to passes them in (the demo its method, k
    # and grpo.temperature; SpeculativeRollouts its method, k and the trainer's temperature) and
    # refuses a different value set here (config.pass_down): leave them unset there. Unset where
    # DraftAdapter is made directly: RUN_DEFAULTS (eagle3, k=3, T=1).
    method: str | None = None  # eagle3 | draft_model | mtp, as the draft directory; unset: the run's, else eagle3
    k: int | None = None  # speculative tokens the engine drafts (for the simulated acceptance); unset: the run's, else 3
    temperature: float | None = None  # the engine's sampling temperature (what the draft matches); unset: the run's, else 1
    replay_max_tokens: int = 200_000  # bound of the replay buffer in tokens
    replay_max_bytes: int = 512 << 20  # and in bytes (handed-over hidden states count)
    recency_decay: float = 0.5  # sampling weight of a sequence = decay ** (newest version - its version)
    # Prioritized replay: the weight is also multiplied by (the draft's loss on the sequence the
    # last time it was trained on) ** priority; sequences not trained on yet count as the hardest
    # seen. While a new behaviour takes over the policy, its rollouts are the ones the draft is
    # worst at, and they are drawn several times their share before they dominate the buffer
    # (no importance correction: the bias towards them is the point). 0 = off (docs/design.md,
    # "Prioritized replay").
    priority: float = 0.0
    # Regroup one training round's draws by length (same sequences, same number of steps): each
    # batch pads to its own longest sequence instead of to the longest of a random mix. Not with
    # priority > 0 (its batches are drawn one step at a time).
    group_by_length: bool = True
    # Pack each training batch's sequences end to end, several to a row, for an Eagle-3 head or
    # MTP layers: the same loss over fewer padded positions (a prioritized batch mixes short and
    # long sequences; docs/design.md, "Packed batches"). A draft LM trains on padded rows.
    pack: bool = True
    # What the draft learns to match for rollouts handed over with their states: "sampling" = the
    # policy that sampled them (the hand-over's tensors as they are; no policy forward), "current"
    # = the adapter's current policy copy (recaptured, one forward per batch). Rollouts observed
    # without a hand-over are always captured against the current policy.
    targets: str = "sampling"
    # What a hand-over keeps per token (capture.hidden.HANDOVER_STORES): "logp", the log-probs over
    # the draft vocabulary; "hidden", the output head's input, the log-probs recomputed from the
    # head when a batch is built (16x less host memory and copying at 8B widths; docs/design.md,
    # "On a GPU").
    handover_store: str = "logp"
    # A round's publish copies the draft and the trainer state and returns; one writer thread
    # writes, hashes and renames the version into place beside what the run does next. A swap
    # waits only for the version it swaps; reading the store through the adapter waits for every
    # version it published (docs/design.md, "Publishing beside the next round"). False: the round
    # writes the version before it returns.
    publish_background: bool = True
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
        if self.method is not None and self.method not in METHODS:
            raise ConfigError(f"adapter.method {self.method!r}: use one of {', '.join(METHODS)}")
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise ConfigError(f"adapter.priority is an exponent in [0, {MAX_PRIORITY}], 0 = off (got {self.priority})")
        if self.targets not in ("sampling", "current"):
            raise ConfigError(f"adapter.targets {self.targets!r}: use 'sampling' or 'current'")
        if self.handover_store not in ("logp", "hidden"):
            raise ConfigError(f"adapter.handover_store {self.handover_store!r}: use 'logp' (log-probs over the draft "
                              "vocabulary) or 'hidden' (the output head's input, 16x less at 8B widths)")
        if (self.k is not None and self.k < 1) or (self.temperature is not None and self.temperature <= 0):
            raise ConfigError(f"adapter.k >= 1 and adapter.temperature > 0 (got {self.k}, {self.temperature})")
        self.schedule.validate()  # also when built in code, not only through load_config
        self.validation.validate()
        self.train.validate()

    def with_run_defaults(self) -> AdapterConfig:
        """This config with each run fact nothing passed in at its RUN_DEFAULTS value."""
        unset = {name: value for name, value in RUN_DEFAULTS.items() if getattr(self, name) is None}
        return replace(self, **unset)


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


def _load_draft(draft_dir: Path, target_dir: Path, method: DraftMethod):
    fmt = detect_format(read_hf_config(draft_dir))
    check_serves(method, draft_dir, fmt, "set adapter.method={method}", error=ConfigError)
    return method.load(draft_dir, target_dir), fmt


class DriftTrigger:
    """When a round is due: every N observed RL steps; the step after a round that gained
    chase_gain; or when acceptance fell by a fraction since the last round (measured in the engine
    when reported, else simulated by the caller)."""

    def __init__(self, cfg: ScheduleConfig):
        self.cfg = cfg
        self.steps_since_train = 0
        self.reference: float | None = None  # acceptance a fall is measured from
        self.measured: float | None = None  # the engine's latest measurement of the live draft
        self.positions: int | None = None  # the draft positions it counts (None: not said)
        self.chasing = False  # the last round gained chase_gain or more: the next is due a step later

    def observed(self) -> None:
        self.steps_since_train += 1

    def report(self, acceptance_length: float, positions: int | None = None) -> None:
        # measured and simulated lengths are not comparable: the engine's first measurement
        # replaces a reference simulated before it; nor are lengths over different positions
        first = self.measured is None or positions != self.positions
        self.measured, self.positions = float(acceptance_length), positions
        if self.reference is None or first:
            self.reference = self.measured
        else:
            # a fall is measured from the best the engine saw since the last round
            self.reference = max(self.reference, self.measured)

    def due(self, buffered: int, simulate_live) -> tuple[bool, str]:
        """``simulate_live()``: the live draft's simulated acceptance, for runs with no engine."""
        s = self.cfg
        if buffered < s.min_sequences:
            return False, "too_few_sequences"
        if self.chasing and self.steps_since_train >= 1:
            return True, "chase"
        # A chase and a fall the engine measured are checked before the schedule, since they make
        # the round urgent (schedule.burst_rounds): a round both a fall and the schedule called
        # for was deferred by the cost cap as a scheduled one while the served draft fell (toy,
        # seed 173, steps 7-8: deferred twice, the step's fixed-k acceptance 0.80 of step 1's).
        # Without an engine's measurement the schedule goes first and nothing is simulated.
        if (s.drift_fraction and self.measured is not None and self.reference is not None
                and self.measured < self.reference * (1 - s.drift_fraction)):
            return True, "drift"
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

    def trained(self, published: bool, candidate: float, live: float | None = None) -> None:
        """A round ended; ``candidate`` and ``live``: the two drafts' scores on its held-out set."""
        self.steps_since_train = 0
        s = self.cfg
        # the policy is running away from the draft: the next round at the next step
        self.chasing = bool(published and s.chase_gain and live and candidate >= live * (1 + s.chase_gain))
        if self.measured is not None:
            # drift is measured from the engine's last measurement before the round (the old
            # draft's, on the policy the round trained towards): a new draft that measures lower
            # fell behind a policy that moved on, and the step right after a publish counts
            self.reference = self.measured
        elif published:
            # without an engine: the published candidate's simulated score
            self.reference = candidate


def _timed(method):
    """Count a DraftAdapter call's time in its CostMeter."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.cost.timed():
            return method(self, *args, **kwargs)
    return wrapper


class CostMeter:
    """The adapter's share of the run's wall time: what its own calls took, over the time since
    the first of them (schedule.max_share; docs/design.md, "Following the drift")."""

    def __init__(self, max_share: float):
        self.max_share = max_share
        self.start: float | None = None
        self.spent = 0.0
        # the last round's duration up to its first block scored (its catch-up blocks ask for
        # their own time): what the next round is expected to take at least
        self.round_s: float | None = None
        # the last round's seconds an optimizer step, and the rest of it (capture, scoring,
        # publish): what a partial round's steps are sized from (affordable_steps)
        self.step_s: float | None = None
        self.fixed_s = 0.0
        self.excluded_s = 0.0  # wall time the run says is not its own (not_counted)
        self.credited_s = 0.0  # the run's time this process did not see (credit)
        self._depth = 0

    @contextlib.contextmanager
    def timed(self):
        t0 = time.perf_counter()
        if self.start is None:
            self.start = t0
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:  # a timed call inside another counts once
                self.spent += time.perf_counter() - t0

    @contextlib.contextmanager
    def excluded(self):
        """Wall time that is neither the run's nor the adapter's (adapter calls inside included)."""
        t0 = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self.start is not None:
                self.excluded_s += time.perf_counter() - max(t0, self.start)

    def credit(self, seconds: float) -> None:
        """Count ``seconds`` of the run's time that passed outside this process's clock (a replay
        emulating the RL step it has not got: scripts/replay_adapter.py --rl-step-s)."""
        self.credited_s += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.excluded_s + self.credited_s

    def share(self) -> float | None:
        if self.start is None:
            return None
        return self.spent / max(self.elapsed(), 1e-9)

    def allows_round(self, advance_rounds: int = 0) -> bool:
        """Would the next round fit the budget, ``advance_rounds`` rounds' time ahead allowed?"""
        if self.round_s is None:
            return True
        return self.allows(self.round_s, advance_rounds * self.round_s)

    def affordable_steps(self, advance_s: float = 0.0) -> int:
        """The optimizer steps a round could take now within the budget, its fixed part counted
        (0 before a round was measured). The most seconds x that fit: spent + x <= max_share *
        (elapsed + x) + advance_s."""
        if not self.max_share or self.start is None or not self.step_s:
            return 0
        room = (self.max_share * self.elapsed() + advance_s - self.spent) / (1 - self.max_share)
        return max(0, int((room - self.fixed_s) // self.step_s))

    def allows(self, cost_s: float, advance_s: float = 0.0, running_s: float = 0.0) -> bool:
        """Would ``cost_s`` more seconds fit the budget, ``advance_s`` ahead of it allowed?
        ``running_s``: what the call in progress has spent so far (not in ``spent`` yet)."""
        if not self.max_share or self.start is None:
            return True
        budget = self.max_share * (self.elapsed() + cost_s) + advance_s
        return self.spent + running_s + cost_s <= budget


class ValidationGate:
    """Scores drafts on held-out rollouts of the newest policy; a candidate passes unless its
    simulated acceptance length is below the live draft's by more than the margin."""

    def __init__(self, cfg: ValidateConfig, k: int):
        self.cfg = cfg
        self.k = k

    def score(self, draft, batches: list[CapturedBatch]) -> float:
        """Simulated acceptance length (vLLM's greedy drafting, k tokens) of a bare draft."""
        visited, _ = score_draft(draft, batches, self.k)
        return visited.length

    def passes(self, candidate: float, live: float) -> bool:
        return candidate >= live * (1 - self.cfg.margin)


class DraftAdapter:
    """Observe rollouts, train the draft against the policy, validate, publish, swap.

    The facade over its parts, each in its own place: the policy copy and the targets it gives
    (``capture/policy.py``), the replay buffer, the trainer, the drift trigger and the validation
    gate (above), the publisher and the engine swaps (``publish.py``). The round itself
    (:meth:`run_round`) reads top to bottom here."""

    def __init__(self, policy_dir: str | Path, draft_dir: str | Path, out_dir: str | Path,
                 cfg: AdapterConfig | None = None, logger=None, policy_version: int = 0):
        self.cfg = (cfg or AdapterConfig()).with_run_defaults()
        self.cfg.validate()
        self.method = method_for(self.cfg.method)
        self.policy_dir = Path(policy_dir)
        self.logger = logger
        # Building modules draws from torch's global RNG before their weights are loaded; the
        # host's RNG stream must not notice (docs/design.md, "TRL integration").
        with torch.random.fork_rng(devices=[]):
            # a draft built for another target is refused here, never relabelled by a publish
            check_draft_for_target(draft_dir, self.policy_dir)
            model = PolicyCopy.load_model(self.policy_dir)
            draft, fmt = _load_draft(Path(draft_dir), self.policy_dir, self.method)
        self._policy = PolicyCopy(model, self.policy_dir, policy_version)
        # the first draft as it was, for the guard (frozen: never trained; shared modules follow the policy)
        self._frozen = copy.deepcopy(draft).eval() if self.cfg.validation.guard else None
        self._serving_frozen = True  # version 0 of a new run is the first draft itself
        self.trainer = DraftTrainer(draft, self.method, self.cfg.train, pad_id=self.pad_id)
        self.capture = self.method.target_capture(self.policy, draft, self.cfg.temperature)
        self.targets = Targets(self._policy, self.capture, self.cfg.targets, self.cfg.handover_store)
        self.replay = ReplayBuffer(
            self.cfg.replay_max_tokens, self.cfg.replay_max_bytes, self.cfg.recency_decay,
            holdout_fraction=self.cfg.validation.heldout_fraction, max_heldout=self.cfg.validation.max_heldout,
        )
        self._store = DraftStore(out_dir)
        self.publisher = Publisher(self._store, self.trainer, self.method, fmt, self.policy_dir, self.cfg.k,
                                   background=self.cfg.publish_background)
        self.rng = random.Random(self.cfg.train.seed)
        self.trigger = DriftTrigger(self.cfg.schedule)
        self.cost = CostMeter(self.cfg.schedule.max_share)
        self.gate = ValidationGate(self.cfg.validation, self.cfg.k)
        self.swaps = EngineSwaps(self._store)
        self._simulated: dict[int, float] = {}  # published version -> its simulated acceptance length
        # the lost-draft check (_lost_draft): the version the engines were last given, the engine's
        # first-token acceptance rate with the version it measured, the engines still to reload
        self._engine_version: int | None = None
        self._validated_at = policy_version  # the policy version the served draft was last trained or scored against
        self._measured_first: tuple[float, int | None] | None = None
        # (held-out uids, live version, their batches, the live draft's score): the guard's, for the round after it
        self._scored: tuple[list[int], int | None, list[CapturedBatch], float] | None = None
        self._reload_pending = False
        self._reloaded: weakref.WeakSet = weakref.WeakSet()
        self._round: Future | None = None  # a round started by start_round, not yet finished
        self._round_pool: JobThreads | None = None
        latest = self._store.latest()
        # what a restart continued from: "start" (a new run), "published" (the newest version's
        # weights, fresh optimizer) or "checkpoint" (its weights and the trainer state beside it)
        self.resumed_from = "start"
        if latest is None:
            # the starting draft is version 0 of this run: what the engine serves before any swap
            self._engine_version = self.publisher.write_trainer(policy_version)
        else:
            self.resumed_from = self.publisher.resume(
                latest, lambda path: _load_draft(path, self.policy_dir, self.method)[0])
            self._serving_frozen = latest.version == 0

    # ------------------------------------------------------------------ the policy copy

    @property
    def policy(self):
        """The adapter's HF copy of the policy."""
        return self._policy.model

    @property
    def policy_version(self) -> int:
        return self._policy.version

    @property
    def policy_forwards(self) -> int:
        """Forwards of the adapter's own policy copy so far (targets and scoring not handed over)."""
        return self.capture.forwards

    @property
    def pad_id(self) -> int:
        return self._policy.pad_id

    @_timed
    def update_policy(self, weights_or_path: str | Path | dict[str, torch.Tensor] | None, version: int) -> None:
        """Load the policy's new weights into the adapter's own HF copy (a dir, a file or a state
        dict); refused with ValueError, the copy unchanged, unless they fit it and are finite.
        None: only the version moves on (a trainer that hands over every target and what the draft
        shares, verl's actor; the copy is then never forwarded)."""
        self._wait_round()
        self._policy.update(weights_or_path, version)

    # ------------------------------------------------------------------ inputs

    def handover(self, policy, subset: Sequence[int] | None = None) -> HandOver:
        """A :class:`HandOver` for the RL trainer's own forward over its rollouts (forward hooks on
        ``policy``'s aux layers; see its docstring): pass it to :meth:`observe` afterwards.
        ``subset``: the indices of the step's rollouts to keep (the rest are neither copied nor
        observed): at real sizes a hand-over costs per rollout, and a round trains on a few
        hundred sequences at most (docs/design.md, "On a GPU")."""
        return self.targets.handover(policy, subset)

    def heldout_subset(self, rollouts: Iterable[Any], policy_version: int) -> list[int]:
        """The indices of one RL step's ``rollouts`` (sampled by ``policy_version``) that
        validation will score: those whose prompt the replay holds out, at most
        ``validation.max_heldout``. Their prompts are numbered in the replay as observing all of
        them would, so a hand-over of only these (``handover(policy, subset=...)``) keeps the same
        held-out share. What a paused adapter hands over: it trains nothing, and
        :meth:`simulate_live` scores only these (docs/design.md, "Stepping aside")."""
        prompts = [s.prompt_ids for s in as_sequences(rollouts)]
        self.replay.register_prompts(policy_version, prompts)
        held = [i for i, h in enumerate(self.replay.holdout_plan(policy_version, prompts)) if h]
        cap = self.replay.max_heldout
        return held if cap is None else held[:cap]

    @_timed
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
        seqs = as_sequences(rollouts)
        given: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
        if handover is not None:
            given = list(handover.tensors(len(seqs)))
            seqs = [seqs[i] for i in handover.chosen(len(seqs))]  # a subset hand-over: only its rollouts
        elif hidden_states is not None:
            hidden_states = list(hidden_states)
            if len(hidden_states) != len(seqs):
                raise ValueError(f"observe: {len(hidden_states)} hidden-state tensors for {len(seqs)} rollouts")
            given = [{"aux_hidden": torch.as_tensor(h)} for h in hidden_states]
        # every rollout is checked before any enters the buffer: a bad one would fail every
        # later round (docs/design.md, "Checks at the door")
        for i, (s, extra) in enumerate(zip(seqs, given)):
            self._policy.check_rollout(i, s, extra, self.capture.aux_layer_ids)
        if hidden_states is not None and handover is None:
            given = [{"aux_hidden": g["aux_hidden"].detach().to(torch.bfloat16).cpu()} for g in given]
        added = 0
        for i, (s, extra) in enumerate(zip(seqs, given)):
            if not s.response_ids:
                continue
            self.replay.add(s.prompt_ids, s.response_ids, policy_version, extra,
                            source=None if source is None else f"{source}#{i}")
            added += 1
        if getattr(handover, "shared", None):
            self._policy.load_shared(handover.shared)
        self.targets.keep_heads(getattr(handover, "lm_head", None), policy_version, set(self.replay.version_counts()))
        self.trigger.observed()
        return added

    def forget(self, source: str) -> int:
        """Drop the rollouts observed with ``source`` (e.g. a shard that made a round fail)."""
        return self.replay.remove(lambda it: it.source is not None and it.source.rsplit("#", 1)[0] == source)

    def report_measured(self, acceptance_length: float, first_rate: float | None = None,
                        positions: int | None = None) -> None:
        """The acceptance length the engine measured for the live draft (feeds the drift trigger)
        and, when given, the share of first draft tokens it accepted (the lost-draft check,
        :meth:`_lost_draft`, at the next round call). ``positions``: the draft positions the
        length counts (``AcceptanceStats.length_at``, what the step boundary reports: the length
        at this adapter's k); a measurement over other positions than the last replaces the
        reference instead of being compared with it.

        A round is due when a measurement falls drift_fraction below the reference: the last
        measurement before the latest round, or a higher one since."""
        self.trigger.report(acceptance_length, positions)
        if first_rate is not None and math.isfinite(first_rate):
            self._measured_first = (float(first_rate), self._engine_version)

    def not_counted(self):
        """A context for work between RL steps that is not the run's (an evaluation, a
        measurement): schedule.max_share's clock skips it, and adapter calls inside it are not
        charged to the adapter."""
        return self.cost.excluded()

    # ------------------------------------------------------------------ the round

    @_timed
    def run_round(self, force: bool = False) -> dict[str, float]:
        """Train if the schedule says so, validate, and publish a better draft. Returns metrics."""
        self._wait_round()
        return self._run_round(force)

    def _run_round(self, force: bool) -> dict[str, float]:
        metrics: dict[str, float] = {"adapt/trained": 0.0, "adapt/published": 0.0, "adapt/rejected": 0.0}
        metrics.update(self._guard())
        due, why = self.trigger.due(len(self.replay), lambda: self.score(self.live_draft(), self.targets.batches(
            self.replay.heldout(), self.cfg.train.batch_size)))
        share = self.cost.share()
        if share is not None:
            metrics["adapt/share"] = share
        urgent = why in ("drift", "chase")
        steps = None  # the whole round; a number: a partial round of that many optimizer steps
        if due and not force and not self.cost.allows_round(self.cfg.schedule.burst_rounds if urgent else 0):
            steps = self._partial_steps(urgent, metrics)
            if steps is None:
                # over schedule.max_share: the round stays due and runs when the run has earned the time
                metrics.update({"adapt/skipped": 1.0, "adapt/deferred": 1.0})
                self._log(metrics)
                return metrics
        split = self._round_split() if due or force and len(self.replay) > 0 else None
        if split is None:
            metrics["adapt/skipped"] = 1.0
            return metrics
        t0 = time.perf_counter()
        heldout, train = split
        # Both drafts are scored on the same held-out rollouts, captured once: a score remembered
        # from an older policy is not comparable (when the policy moves fast every score falls,
        # and a stale live score would reject every candidate).
        held, live = self._live_scored(heldout)
        self.refresh_shared_embeddings()
        candidate, done, train_metrics, first_s = self._train_blocks(train, held, live, urgent, force, t0, steps)
        metrics.update({k: v for k, v in train_metrics.items() if k.startswith("train/")})
        if not math.isfinite(train_metrics.get("train/loss", 0.0)) or not self.trainer.weights_finite():
            return self._roll_back(metrics, live, t0)
        metrics.update({
            "adapt/train_steps": float(done),
            "adapt/trained": 1.0,
            "adapt/trigger_drift": float(why == "drift"),
            "adapt/trigger_chase": float(why == "chase"),
            "accept/simulated_length": candidate,
            "accept/simulated_live": live,
            "adapt/heldout_seqs": float(len(heldout)),
        })
        published = self.gate.passes(candidate, live)
        if published:
            metrics.update(self._publish_candidate(candidate, train + heldout))
        else:
            metrics["adapt/rejected"] = 1.0
        self.trigger.trained(published, candidate, live)
        self._validated_at = self.policy_version  # the served draft, trained or just scored against it
        metrics["stage/adapt_s"] = time.perf_counter() - t0
        if steps is None:
            self.cost.round_s = first_s
        self.cost.fixed_s = max(0.0, metrics["stage/adapt_s"] - done * (self.cost.step_s or 0.0))
        self._log(metrics)
        return metrics

    def _round_split(self) -> tuple[list[ReplayItem], list[ReplayItem]] | None:
        """(held-out, train) rollouts of a round; None when either is empty. The buffer holds out
        whole prompts of the newest version (GRPO groups sample a prompt several times), but the
        max_heldout cap can cut a group and an older version may hold the same prompt; a
        held-out rollout whose prompt is trained on would flatter the candidate, so those
        rollouts sit this round out."""
        heldout, train = self.replay.split_recent()
        held_prompts = {it.prompt_key for it in heldout}
        train = [it for it in train if it.prompt_key not in held_prompts]
        return (heldout, train) if heldout and train else None

    def _partial_steps(self, urgent: bool, metrics: dict[str, float]) -> int | None:
        """A due round the budget cannot pay whole: the optimizer steps that fit
        (schedule.partial_rounds), or at least one once the served draft is schedule.max_draft_age
        policy versions old; None: it waits. Metrics ``adapt/partial``, ``adapt/age_bound``."""
        sched = self.cfg.schedule
        advance_s = sched.burst_rounds * (self.cost.round_s or 0.0) if urgent else 0.0
        fits = min(self.cost.affordable_steps(advance_s), sched.train_steps) if sched.partial_rounds else 0
        age = self.policy_version - self._validated_at
        metrics["draft/age_validated"] = float(age)
        if fits >= 1:
            metrics["adapt/partial"] = 1.0
            return fits
        if sched.max_draft_age and age >= sched.max_draft_age:
            metrics.update({"adapt/partial": 1.0, "adapt/age_bound": 1.0})
            return 1
        return None

    def _train_blocks(self, train: list[ReplayItem], held: list[CapturedBatch], live: float, urgent: bool,
                      force: bool, t0: float, steps: int | None = None) -> tuple[float, int, dict[str, float], float]:
        """Blocks of schedule.train_steps optimizer steps, another only while the last one still
        paid off (the draft is behind the policy) and, under max_share, while another block's time
        fits the budget; ``steps``: one block of that many (a partial round, prioritized: the
        sequences the served draft fails on most). Returns (the candidate's score, steps done, the
        last block's metrics, the first block's seconds from ``t0``)."""
        sched = self.cfg.schedule
        budget = max(sched.max_train_steps, sched.train_steps) if steps is None else steps
        advance_s = sched.burst_rounds * (self.cost.round_s or 0.0) if urgent else 0.0
        block = sched.train_steps if steps is None else steps
        done, before, first_s = 0, live, None
        while True:
            t_block = time.perf_counter()
            train_metrics = self._train_block(train, block, priority=None if steps is None else self.cfg.priority or 1.0)
            self.cost.step_s = (time.perf_counter() - t_block) / block
            done += block
            candidate = self._score_candidate(held)
            now = time.perf_counter()
            first_s = first_s or now - t0
            if (done + block > budget or candidate < before * (1 + sched.catchup_gain)
                    or not (force or self.cost.allows(now - t_block, advance_s, running_s=now - t0))):
                return candidate, done, train_metrics, first_s
            before = candidate

    def _roll_back(self, metrics: dict[str, float], live: float, t0: float) -> dict[str, float]:
        """A non-finite round would poison every later one: back to the live draft, fresh moments."""
        self.trainer.reset_to(self.live_draft())
        log.warning("adapter: the round's loss or weights went non-finite; the trainer is back at the live draft")
        metrics.update({"adapt/trained": 1.0, "adapt/rolled_back": 1.0, "adapt/rejected": 1.0,
                        "train/loss": float("nan")})
        self.trigger.trained(False, live)
        metrics["stage/adapt_s"] = time.perf_counter() - t0
        self._log({k: v for k, v in metrics.items() if math.isfinite(v)})
        return metrics

    def _publish_candidate(self, candidate: float, items: list[ReplayItem]) -> dict[str, float]:
        """The trainer's draft as the next version, tagged with the newest policy its targets came
        from: the sampling policy of the newest rollouts when they were handed over, else the
        adapter's current copy."""
        target_version = self.policy_version
        if all(self.targets.handed_over(it) for it in items):
            target_version = max(it.policy_version for it in items)
        version = self.publisher.publish(target_version)
        self._simulated[version] = candidate
        self._serving_frozen = False
        # on the round's path: the copies; the write before this one, done beside the run
        return {"adapt/published": 1.0, "draft/published_version": float(version),
                "publish/copy_s": self.publisher.copy_s, "publish/write_s": self.publisher.write_s}

    def _live_scored(self, heldout: list[ReplayItem]) -> tuple[list[CapturedBatch], float]:
        """A round's held-out rollouts as captured batches and the live draft's score on them:
        the guard's of this round call where it scored the same rollouts and the same draft (it
        scores the newest held-out share every step, and a round holds out that same share), else
        captured and scored now. On the toy a score is ~0.1 s, a quarter of a step's fixed cost."""
        scored, self._scored = self._scored, None
        if scored is not None and scored[:2] == ([it.uid for it in heldout], self.publisher.live_version):
            return scored[2], scored[3]
        held = self.targets.batches(heldout, self.cfg.train.batch_size)
        return held, self.score(self.live_draft(), held)

    def _guard(self) -> dict[str, float]:
        """The served draft's checks at every round call, both on the newest rollouts' held-out
        share (the same rows, the hand-over's states: no generation, no policy forward where
        handed over): is it lost in the engine (:meth:`_lost_draft`), and is it still better than
        the frozen first draft (:meth:`_keep_better`). The served draft's score, or the frozen
        one's where it went back in, is kept for the round that follows (:meth:`_live_scored`)."""
        self._scored = None
        measured = self._take_measured_first()
        keep = self.cfg.validation.guard and not self._serving_frozen
        if measured is None and not keep:
            return {}
        newest = self._newest_heldout()
        if newest is None:
            return {}
        heldout, held = newest
        served, _ = score_draft(self.live_draft(), held, self.gate.k)
        out = {} if measured is None else self._lost_draft(measured, served.reached_rates[0])
        if keep:
            out.update(self._keep_better(served.length, held))
        live = out["guard/frozen_simulated"] if out.get("guard/reverted") else served.length
        self._scored = ([it.uid for it in heldout], self.publisher.live_version, held, live)
        return out

    def _take_measured_first(self) -> float | None:
        """The engine's first-token acceptance rate since the last check, when it measured the
        version the adapter serves now (a measurement of an older version says nothing of it)."""
        seen, self._measured_first = self._measured_first, None
        if seen is None or not self.cfg.validation.lost_below:
            return None
        rate, version = seen
        return rate if version is not None and version == self.publisher.live_version else None

    def _lost_draft(self, measured: float, simulated: float) -> dict[str, float]:
        """Notice a lost draft: the engine accepted fewer first draft tokens than
        validation.lost_below of what the draft it should serve simulates on the step's rollouts
        (its weights lost, zeroed or never loaded, whatever the checksum read back says). The
        newest version is then swapped in again at this boundary (:meth:`swap`). Metrics
        ``guard/first_measured``, ``guard/first_simulated``, ``guard/lost_draft``."""
        self._reload_pending, self._reloaded = False, weakref.WeakSet()
        out = {"guard/first_measured": measured, "guard/first_simulated": simulated, "guard/lost_draft": 0.0}
        if simulated >= LOST_MIN_FIRST_RATE and measured < simulated * self.cfg.validation.lost_below:
            self._reload_pending = True
            out["guard/lost_draft"] = 1.0
            log.warning("adapter: the engine accepted %.3f of first draft tokens where version %s simulates %.3f: "
                        "its draft is taken as lost and the newest version is swapped in again",
                        measured, self.publisher.live_version, simulated)
        return out

    def _keep_better(self, served: float, held: list[CapturedBatch]) -> dict[str, float]:
        """Keep the better draft: when the served draft (simulated ``served``) falls below the
        frozen first one by more than validation.guard_margin, the frozen draft is published as
        the next version (the trainer restarts from it, fresh moments) and swapped in at this
        boundary. Metrics ``guard/*`` (docs/design.md, "Keep the better draft")."""
        self.method.refresh_shared(self._frozen, self.policy)
        frozen = self.score(self._frozen, held)
        out = {"guard/served_simulated": served, "guard/frozen_simulated": frozen,
               "guard/served_over_frozen": served / frozen, "guard/reverted": 0.0}
        if self.trigger.measured is not None:  # the engine's counters for the served one, on the RL batch
            out["guard/served_measured"] = self.trigger.measured
        if served < frozen * (1 - self.cfg.validation.guard_margin):
            self.trainer.reset_to(self._frozen)
            version = self.publisher.publish(self.policy_version)
            self._simulated[version] = frozen
            self._serving_frozen = True
            out.update({"guard/reverted": 1.0, "draft/published_version": float(version)})
            log.warning("adapter: the served draft (simulated %.3f) fell below the frozen first draft (%.3f) by more "
                        "than %.0f%%; the frozen draft is published as version %d", served, frozen,
                        100 * self.cfg.validation.guard_margin, version)
        return out

    def _train_block(self, train: list[ReplayItem], n: int, priority: float | None = None) -> dict[str, float]:
        """``n`` optimizer steps on batches drawn from ``train`` (recent versions weighted up);
        ``priority``: the prioritized replay exponent, when not AdapterConfig.priority's."""
        priority = self.cfg.priority if priority is None else priority
        if priority:
            return self.trainer.train_steps(self._prioritized_batches(train, n, priority), n=n)
        bs = self.cfg.train.batch_size
        picks = [self.replay.sample(n_seqs=bs, rng=self.rng, items=train) for _ in range(n)]
        if self.cfg.group_by_length:
            picks = group_by_length(picks, self.rng)
        return self.trainer.train_steps((self._train_batch(p) for p in picks), n=n)

    def _train_batch(self, items: list[ReplayItem]) -> CapturedBatch:
        batch = self.targets.batch(items)
        return batch.packed() if self.cfg.pack and self.method.packs else batch

    def _prioritized_batches(self, train: list[ReplayItem], n: int, priority: float) -> Iterator[CapturedBatch]:
        """AdapterConfig.priority: ``n`` batches, each drawn after the step before it recorded
        the draft's loss on the sequences it trained on (drawn a step at a time, they are not
        regrouped by length: on seed 2's spool, drawing a block ahead and regrouping it, or
        drawing each step's batch from one length bucket, lost most of what the priorities gain;
        docs/design.md, "Prioritized replay")."""
        for _ in range(n):
            pick = self.replay.sample(n_seqs=self.cfg.train.batch_size, rng=self.rng, items=train,
                                      priority=priority)
            yield self._train_batch(pick)
            # resumed once the trainer has taken its step on that batch
            self.replay.prioritize(pick, self.trainer.last_row_losses)

    def _score_candidate(self, held: list[CapturedBatch]) -> float:
        """The trainer's draft as it stands, scored in place (no export copy)."""
        model = self.trainer.model
        model.eval()
        try:
            return self.score(self.trainer.draft, held)
        finally:
            model.train()

    def score(self, draft, batches: list[CapturedBatch]) -> float:
        """Simulated acceptance length (vLLM's greedy drafting, k tokens) of a bare draft (an
        Eagle3Head or HF draft LM) on captured batches."""
        return self.gate.score(draft, batches)

    def refresh_shared_embeddings(self, head=None) -> None:
        """A draft that shares the target's modules sees the policy's current ones (as in vLLM)."""
        self.method.refresh_shared(self.trainer.draft if head is None else head, self.policy)

    def live_draft(self):
        """The newest published draft as the engine serves it (shared modules from the current
        policy). Kept in memory from its publish; callers must not modify it."""
        self.refresh_shared_embeddings(self.publisher.live)
        return self.publisher.live

    def publish(self, policy_version: int | None = None) -> int:
        """Write the trainer's current draft as a new version (atomic), tagged with the policy
        version it was trained against (default: the adapter's current one); in the store when
        this returns."""
        self._wait_round()
        version = self.publisher.publish(self.policy_version if policy_version is None else policy_version)
        self.publisher.wait()
        return version

    def wait_published(self, max_policy_version: int | None = None) -> None:
        """Until every version this adapter published is in the store with its trainer state
        (None), or the newest of them an engine at ``max_policy_version`` may serve. A background
        write that failed raises here (AdapterConfig.publish_background)."""
        self.publisher.wait(max_policy_version)

    @property
    def store(self) -> DraftStore:
        """The draft store, with every version this adapter published in it: a write still under
        way is waited for (AdapterConfig.publish_background), so what is read here is what the
        adapter published."""
        self.publisher.wait()
        return self._store

    @property
    def live_version(self) -> int | None:
        latest = self.store.latest()
        return None if latest is None else latest.version

    def _log(self, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log_dict(metrics, step=self.policy_version)

    # ------------------------------------------------------------------ background rounds

    def start_round(self, force: bool = False) -> None:
        """Run :meth:`run_round` in a background thread while the RL loop goes on (the next
        rollouts, the next update); :meth:`finish_round` returns its metrics. Every other adapter
        call first waits for the round, so the replay buffer, the trainer and the store are never
        used by two threads at once. On a 2-core CPU the round competes with generation for the cores
        (docs/design.md, "Background rounds")."""
        if self._round is not None:
            raise RuntimeError("a background adapter round is still open: call finish_round() before starting another")
        if self._round_pool is None:
            self._round_pool = JobThreads("draftadapt-round")  # a thread per round: threads.py says why
        self._round = self._round_pool.submit(self._run_round, force)

    def finish_round(self) -> dict[str, float]:
        """Wait for the round :meth:`start_round` began and return its metrics ({} when none is
        open); an error raised in the round is raised here."""
        round_, self._round = self._round, None
        return {} if round_ is None else round_.result()

    def _wait_round(self) -> None:
        if self._round is not None:
            wait([self._round])

    def close(self) -> None:
        """Finish an open background round and the publisher's writes in flight (a failed one
        raises) and stop their threads (nothing else to release)."""
        try:
            self.finish_round()
        finally:
            if self._round_pool is not None:
                self._round_pool.shutdown(wait=True)
                self._round_pool = None
            self.publisher.close()

    # ------------------------------------------------------------------ engine side

    @_timed
    def simulate_live(self) -> float | None:
        """The simulated acceptance length at ``cfg.k`` of the draft the engines serve, on the
        newest rollouts' held-out share (their hand-over's states where given: no policy
        forward); None before any rollout. What a paused adapter (no engine drafts) reports
        instead of training (StepBoundary.paused)."""
        self._wait_round()
        newest = self._newest_heldout()
        return None if newest is None else self.score(self.live_draft(), newest[1])

    def _newest_heldout(self) -> tuple[list[ReplayItem], list[CapturedBatch]] | None:
        """The newest rollouts' held-out share and its captured batches (None before any
        rollout): what the guard and simulate_live score drafts on."""
        heldout = self.replay.heldout()
        return (heldout, self.targets.batches(heldout, self.cfg.train.batch_size)) if heldout else None

    def fresh_length(self) -> float | None:
        """The simulated acceptance length at ``cfg.k`` of the newest draft this adapter
        published, on the rollouts of its publish (the frozen draft's when the guard reverted
        to it): what a fresh draft of this adapter accepts. None before any publish."""
        return self._simulated[max(self._simulated)] if self._simulated else None

    def simulated_length(self, version: int) -> float | None:
        """The acceptance length at ``cfg.k`` this adapter simulated on held-out rollouts for the
        draft it published as ``version`` (what decided the publish); None for a version it did
        not publish. Online k starts a newly swapped-in draft from it (``OnlineK.new_draft``)."""
        return self._simulated.get(version)

    @_timed
    def swap(self, engine) -> Any:
        """Put the newest published draft the engine may serve into it, in place
        (:meth:`DraftStore.swap_newest_into`: never one trained on a newer policy than the engine
        serves, never an older version than it served). Returns the SwapResult or None."""
        self._wait_round()
        self.publisher.wait(engine.policy_version)  # only for the version it may swap in
        res = self.swaps.swap(engine)
        if res is None and self._reload_pending and engine not in self._reloaded:
            res = self.swaps.reload(engine)  # a draft noticed lost (_lost_draft): the newest one again
            self._reloaded.add(engine)
            self._log({"draft/reloaded": 1.0})
        if res is not None:
            self._engine_version = res.version
            self._log({"swap/ms": res.ms, "draft/version": float(res.version)})
        return res

    def newest_package(self, max_policy_version: int, newer_than: int | None = None):
        """The newest published draft an engine at ``max_policy_version`` may serve, newer than
        version ``newer_than`` of this store, as a :class:`~draftadapt.data.store.DraftPackage`
        (its files' bytes, for engines that share no filesystem with the adapter); None if none."""
        from draftadapt.data.store import DraftPackage

        self._wait_round()
        self.publisher.wait(max_policy_version)
        if self._reload_pending:  # a draft noticed lost (_lost_draft): the newest one again, whatever is served
            newer_than, self._reload_pending = None, False
        dv = self._store.latest(max_policy_version=max_policy_version, newer_than=newer_than)
        if dv is None:
            return None
        self._engine_version = dv.version
        return DraftPackage.read(dv)

    @_timed
    def check_integrity(self, engine) -> bool:
        """After a policy update: is the live draft still the one last swapped in? Repair if not.

        Other systems lost their drafts silently on weight sync or sleep/wake (docs/design.md,
        "Failures other systems shipped"). Returns True when the draft was intact.
        """
        self._wait_round()
        intact = self.swaps.intact(engine)
        if not intact:
            self._log({"draft/integrity_repairs": 1.0})
        return intact
