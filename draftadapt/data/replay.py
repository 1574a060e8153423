"""Replay buffer of rollout sequences, tagged by the policy version that sampled them.

    buf = ReplayBuffer(max_tokens=2_000_000, max_bytes=8 << 30, recency_decay=0.5, holdout_fraction=0.1)
    buf.add(prompt_ids, response_ids, policy_version, tensors={"aux_hidden": h})   # or add_shard(shard)
    batch = buf.sample(n_tokens=16_384, rng=rng)   # newer policy versions weigh more
    val = buf.heldout()                             # newest version's held-out sequences

Bounds: ``max_tokens`` (token ids held) and ``max_bytes`` (tensor payload: 4 bytes per token id
plus every per-sequence tensor, e.g. aux hidden states; Python object overhead is not counted).
Over a bound, the oldest sequences go first: lowest policy version, then earliest added.

Recency: a sequence of version v is drawn with weight ``recency_decay ** (newest - v)``: the
policy drifts, so old rollouts describe a distribution the draft no longer has to match
(0.5 halves the weight per version; 0 uses the newest version only; 1 is uniform).

Priority: ``sample(priority=a)`` also weighs each sequence by ``loss ** a``, the draft's loss on it
the last time it was trained on (``prioritize``); a sequence not trained on yet counts as the
hardest seen. What the draft has not learned yet (a style the policy is turning to) is drawn
more often than its share of the buffer (prioritized replay, Schaul et al. 2016).

Validation: with ``holdout_fraction`` f > 0, a deterministic f of each version's distinct prompts
(the 1st, then about every 1/f-th new prompt) is held out, with every sequence sampled from it.
Whole prompts, because GRPO-style groups sample one prompt several times: a held-out rollout
whose prompt is trained on would flatter the candidate, and holding out every 1/f-th *sequence*
of groups of 1/f would hold out every prompt and leave nothing of the newest version to train on.
``heldout()`` returns those of the newest version (at most ``max_heldout``) and ``sample()``
never returns them, so the validation set is never trained on while it is the validation set;
once a newer version arrives they become training data like the rest (validation always
measures against the newest policy).

Not thread-safe. After a crash, rebuild it from the spool (the shards are kept until pruned), or
save ``state_dict()`` with torch.save and restore it with ``load_state_dict``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from draftadapt.data.sequences import Sequence as TokenSequence

if TYPE_CHECKING:
    from draftadapt.spool import RolloutShard


MAX_PRIORITY = 8.0  # sample(priority=): beyond this the draws are all but deterministic


@dataclass
class ReplayItem:
    uid: int  # insertion order, unique in this buffer
    policy_version: int
    token_ids: torch.Tensor  # [T] int32, prompt + response
    prompt_len: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per sequence, e.g. aux_hidden [T, D]
    source: str | None = None  # where it came from, e.g. "<shard name>#<index>"
    holdout: bool = False  # a validation position of its version (see heldout())
    # the draft's mean loss on this sequence the last time it was trained on; None: not yet
    # (sample(priority=...) draws the sequences the draft is worst at more often)
    priority: float | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        return _nbytes(self.token_ids) + sum(_nbytes(t) for t in self.tensors.values())

    @property
    def prompt_key(self) -> tuple[int, ...]:
        """The prompt's token ids, hashable: samples of one prompt share it."""
        return tuple(self.token_ids[: self.prompt_len].tolist())

    def sequence(self) -> TokenSequence:
        ids = self.token_ids.tolist()
        return TokenSequence(ids[: self.prompt_len], ids[self.prompt_len :])


def _prompt_key(prompt_ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """A prompt's token ids as :attr:`ReplayItem.prompt_key` holds them."""
    return tuple(int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _own(t: torch.Tensor) -> torch.Tensor:
    """A view into a bigger tensor would keep all of it alive and make the byte count a lie."""
    t = t.detach()
    if t.untyped_storage().nbytes() > _nbytes(t) or not t.is_contiguous():
        t = t.contiguous().clone()
    return t


class ReplayBuffer:
    def __init__(
        self,
        max_tokens: int,
        max_bytes: int | None = None,
        recency_decay: float = 0.5,
        holdout_fraction: float = 0.0,
        max_heldout: int | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        if not 0.0 <= recency_decay <= 1.0:
            raise ValueError(f"recency_decay must be in [0, 1], got {recency_decay}")
        if not 0.0 <= holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
        if max_heldout is not None and max_heldout < 0:
            raise ValueError(f"max_heldout must be >= 0 or None, got {max_heldout}")
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.recency_decay = recency_decay
        self.holdout_fraction = holdout_fraction
        self.max_heldout = max_heldout
        self._by_version: dict[int, deque[ReplayItem]] = {}
        self._versions: list[int] = []  # sorted keys of _by_version
        # version -> {prompt ids: held out?}, in order of first appearance (holdout positions)
        self._prompts: dict[int, dict[tuple[int, ...], bool]] = {}
        self._next_uid = 0
        self._tokens = 0
        self._bytes = 0
        self.evicted_seqs = 0
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ add / evict

    def add(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        response_ids: Sequence[int] | torch.Tensor,
        policy_version: int,
        tensors: dict[str, torch.Tensor] | None = None,
        source: str | None = None,
    ) -> ReplayItem | None:
        """Add one sequence sampled by ``policy_version``; evict the oldest while over a bound.

        ``tensors``: per-sequence tensors with one row per token of prompt + response (e.g.
        ``{"aux_hidden": [T, D]}``); counted in bytes. Returns the item, or None if it was itself
        the oldest and evicted at once (a version older than everything held, buffer full).
        """
        if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        p = torch.as_tensor(prompt_ids).reshape(-1).to(torch.int32)
        r = torch.as_tensor(response_ids).reshape(-1).to(torch.int32)
        ids = torch.cat([p, r])
        n, prompt_len = ids.numel(), p.numel()
        if n == 0:
            raise ValueError("cannot add an empty sequence")
        if n > self.max_tokens:
            raise ValueError(
                f"a sequence of {n} tokens exceeds the buffer's max_tokens {self.max_tokens}; raise max_tokens"
            )
        owned = {k: _own(v) for k, v in (tensors or {}).items()}
        for k, v in owned.items():
            if v.dim() == 0 or v.shape[0] != n:
                raise ValueError(f"tensor {k!r} has shape {tuple(v.shape)}; per-sequence tensors need one row per token ({n})")
        item = ReplayItem(self._next_uid, policy_version, ids, prompt_len, owned, source)
        if self.max_bytes is not None and item.nbytes > self.max_bytes:
            raise ValueError(f"a sequence of {item.nbytes} bytes exceeds max_bytes {self.max_bytes}; raise max_bytes")
        self.register_prompts(policy_version, [item.prompt_key])
        item.holdout = self._prompts[policy_version][item.prompt_key]
        self._next_uid += 1
        if policy_version not in self._by_version:
            self._by_version[policy_version] = deque()
            bisect.insort(self._versions, policy_version)
        self._by_version[policy_version].append(item)
        self._tokens += n
        self._bytes += item.nbytes
        gone = self._evict()
        return None if item.uid in gone else item

    def holdout_plan(self, policy_version: int, prompts: Sequence[Sequence[int] | torch.Tensor]) -> list[bool]:
        """Whether each of ``prompts`` (one per sequence, in the order they would be added to
        ``policy_version``) would be held out; nothing changes. What lets a caller hand over only
        the sequences that validation will score before they exist (a paused adapter's hand-over)."""
        keys = [_prompt_key(p) for p in prompts]
        seen = self._number(dict(self._prompts.get(policy_version, {})), keys)
        return [seen[key] for key in keys]

    def register_prompts(self, policy_version: int, prompts: Sequence[Sequence[int] | torch.Tensor]) -> None:
        """Number ``prompts`` (in this order) among ``policy_version``'s, as adding their sequences
        would, without adding any: a caller that adds only some of a step's sequences (a subset
        hand-over) keeps the held-out prompts that adding all of them would have chosen."""
        self._number(self._prompts.setdefault(policy_version, {}), map(_prompt_key, prompts))

    def _number(self, seen: dict[tuple[int, ...], bool], keys) -> dict[tuple[int, ...], bool]:
        """Give each new prompt key of ``keys`` its held-out flag by its position in ``seen``."""
        for key in keys:
            if key not in seen:
                seen[key] = self._is_holdout(len(seen))
        return seen

    def add_shard(self, shard: RolloutShard) -> list[ReplayItem]:
        """Add every sequence of a spool shard (with its aux hidden states if it has them)."""
        out = []
        for i, (p, r) in enumerate(zip(shard.prompt_ids, shard.response_ids)):
            tensors = {"aux_hidden": shard.aux_hidden[i]} if shard.aux_hidden is not None else None
            item = self.add(p, r, shard.policy_version, tensors, source=f"{shard.name}#{i}")
            if item is not None:
                out.append(item)
        return out

    def _is_holdout(self, k: int) -> bool:
        """Is a version's k-th distinct prompt held out? Prompts 0, ~1/f, ~2/f, ...: at least one
        per version, a fraction f in the long run."""
        f = self.holdout_fraction
        if f <= 0:
            return False
        eps = 1e-9  # so that k * f landing on an integer does not count twice
        return math.ceil((k + 1) * f - eps) > math.ceil(k * f - eps)

    def _evict(self) -> set[int]:
        gone = set()
        while self._tokens > self.max_tokens or (self.max_bytes is not None and self._bytes > self.max_bytes):
            v = self._versions[0]
            q = self._by_version[v]
            item = q.popleft()
            if not q:
                del self._by_version[v]
                self._versions.pop(0)
                self._prompts.pop(v, None)
            self._tokens -= item.num_tokens
            self._bytes -= item.nbytes
            self.evicted_seqs += 1
            self.evicted_tokens += item.num_tokens
            gone.add(item.uid)
        return gone

    def remove(self, where: Callable[[ReplayItem], bool]) -> int:
        """Drop every item ``where(item)`` is true for (e.g. a shard that made a round fail); returns how many."""
        gone = 0
        for v in list(self._versions):
            keep: deque[ReplayItem] = deque()
            for it in self._by_version[v]:
                if where(it):
                    self._tokens -= it.num_tokens
                    self._bytes -= it.nbytes
                    gone += 1
                else:
                    keep.append(it)
            if keep:
                self._by_version[v] = keep
            else:
                del self._by_version[v]
                self._versions.remove(v)
                self._prompts.pop(v, None)
        return gone

    # ------------------------------------------------------------------ read

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_version.values())

    def __iter__(self) -> Iterator[ReplayItem]:
        """Items oldest first (by version, then insertion)."""
        for v in self._versions:
            yield from self._by_version[v]

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def newest_version(self) -> int | None:
        return self._versions[-1] if self._versions else None

    def version_counts(self) -> dict[int, int]:
        """policy version -> sequences held."""
        return {v: len(self._by_version[v]) for v in self._versions}

    def weight(self, policy_version: int) -> float:
        """Sampling weight of one sequence of ``policy_version``: decay ** (newest - version)."""
        newest = self.newest_version
        if newest is None:
            return 0.0
        return float(self.recency_decay ** (newest - policy_version))

    def heldout(self) -> list[ReplayItem]:
        """The newest version's held-out sequences (never returned by :meth:`sample`), oldest first."""
        v = self.newest_version
        if v is None:
            return []
        held = [it for it in self._by_version[v] if it.holdout]
        return held if self.max_heldout is None else held[: self.max_heldout]

    def split_recent(self) -> tuple[list[ReplayItem], list[ReplayItem]]:
        """(held out: :meth:`heldout`, trainable: everything else), each oldest first."""
        held = self.heldout()
        uids = {it.uid for it in held}
        return held, [it for it in self if it.uid not in uids]

    def sample(
        self,
        n_seqs: int | None = None,
        n_tokens: int | None = None,
        rng: np.random.Generator | random.Random | int | None = None,
        items: Sequence[ReplayItem] | None = None,
        priority: float = 0.0,
    ) -> list[ReplayItem]:
        """Draw without replacement, each sequence weighted ``decay ** (newest - version)``, times
        ``loss ** priority`` with ``priority`` > 0 (``prioritize``; never trained on: the highest).

        Give ``n_seqs`` (that many sequences) or ``n_tokens`` (sequences until their tokens reach
        it; the last one may overshoot). Draws from the trainable part (not :meth:`heldout`), or
        from ``items`` if given (e.g. the second half of :meth:`split_recent`); returns fewer if
        there are fewer. The first draw is exactly proportional to the weights.
        """
        if (n_seqs is None) == (n_tokens is None):
            raise ValueError("pass exactly one of n_seqs or n_tokens")
        if (n_seqs is not None and n_seqs < 0) or (n_tokens is not None and n_tokens < 0):
            raise ValueError(f"n_seqs / n_tokens must be >= 0, got {n_seqs} / {n_tokens}")
        if isinstance(rng, random.Random):
            rng = rng.getrandbits(64)
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        if items is None:
            items = self.split_recent()[1]
        newest = self.newest_version
        if newest is None or not items:
            return []
        # one weight per version (decay ** age), not one call per item: this runs every optimizer step
        ages = newest - np.fromiter((it.policy_version for it in items), dtype=np.int64, count=len(items))
        weights = float(self.recency_decay) ** ages.astype(np.float64)
        if priority:
            if not 0 <= priority <= MAX_PRIORITY:
                raise ValueError(f"priority is an exponent in [0, {MAX_PRIORITY}], got {priority}")
            weights = weights * self._priorities(items) ** priority
        keep = np.flatnonzero(weights > 0)
        if keep.size < len(items):
            items, weights = [items[i] for i in keep], weights[keep]
        if not items:
            return []
        # Efraimidis & Spirakis (2006): the largest u ** (1 / w) keys are a weighted sample without
        # replacement; log form for stability.
        keys = np.log(gen.random(len(items))) / weights
        order = np.argsort(-keys, kind="stable")
        if n_seqs is not None:
            return [items[i] for i in order[:n_seqs]]
        out, total = [], 0
        for i in order:
            if total >= n_tokens:
                break
            out.append(items[i])
            total += items[i].num_tokens
        return out

    @staticmethod
    def _priorities(items: Sequence[ReplayItem]) -> np.ndarray:
        pr = np.fromiter((np.nan if it.priority is None else it.priority for it in items), dtype=np.float64,
                         count=len(items))
        seen = ~np.isnan(pr)
        if not seen.any():
            return np.ones(len(items))
        top = max(pr[seen].max(), 1e-12)
        # relative to the hardest seen, which a sequence not trained on yet counts as (new rollouts
        # get the highest weight); the floor keeps a learned sequence drawable (1e-3 ** MAX_PRIORITY
        # is still far above 0)
        return np.maximum(np.where(seen, pr, top) / top, 1e-3)

    def prioritize(self, items: Sequence[ReplayItem], losses: Sequence[float] | torch.Tensor) -> None:
        """Record the draft's loss on each of ``items`` (one value each, in order) for ``sample``'s
        priority; a non-finite loss leaves the item as it was."""
        losses = torch.as_tensor(losses, dtype=torch.float64).reshape(-1).tolist()
        if len(losses) != len(items):
            raise ValueError(f"prioritize: {len(losses)} losses for {len(items)} items")
        for it, v in zip(items, losses):
            if math.isfinite(v):
                it.priority = max(float(v), 0.0)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything, as plain containers and tensors (torch.save / torch.load(weights_only=True))."""
        return {
            "format_version": 2,
            "config": {
                "max_tokens": self.max_tokens,
                "max_bytes": self.max_bytes,
                "recency_decay": self.recency_decay,
                "holdout_fraction": self.holdout_fraction,
                "max_heldout": self.max_heldout,
            },
            "next_uid": self._next_uid,
            # per version, its prompts in order of first appearance and whether each is held out
            "prompts": {str(v): [[list(k), h] for k, h in ps.items()] for v, ps in self._prompts.items()},
            "evicted": [self.evicted_seqs, self.evicted_tokens],
            "items": [
                {
                    "uid": it.uid,
                    "policy_version": it.policy_version,
                    "token_ids": it.token_ids,
                    "prompt_len": it.prompt_len,
                    "tensors": dict(it.tensors),
                    "source": it.source,
                    "holdout": it.holdout,
                    "priority": it.priority,
                }
                for it in self
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state`` (bounds stay this buffer's; evicts if they are tighter)."""
        if state.get("format_version") != 2:
            raise ValueError(
                f"replay state format_version {state.get('format_version')!r}; expected 2 (format 1 held out "
                "sequences by position, not whole prompts: rebuild the buffer from the spool instead)"
            )
        self._by_version, self._versions, self._tokens, self._bytes = {}, [], 0, 0
        for d in state["items"]:
            it = ReplayItem(
                int(d["uid"]), int(d["policy_version"]), d["token_ids"].to(torch.int32),
                int(d["prompt_len"]), dict(d["tensors"]), d["source"], bool(d["holdout"]),
                None if d.get("priority") is None else float(d["priority"]),
            )
            if it.policy_version not in self._by_version:
                self._by_version[it.policy_version] = deque()
                bisect.insort(self._versions, it.policy_version)
            self._by_version[it.policy_version].append(it)
            self._tokens += it.num_tokens
            self._bytes += it.nbytes
        self._prompts = {int(v): {tuple(int(t) for t in k): bool(h) for k, h in ps} for v, ps in state["prompts"].items()}
        self._next_uid = int(state["next_uid"])
        self.evicted_seqs, self.evicted_tokens = (int(x) for x in state["evicted"])
        self._evict()
