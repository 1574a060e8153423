"""Token sequences (prompt + the target's own response) on disk, and their padded batches.

One JSON object per line: ``{"prompt_ids": [...], "response_ids": [...]}``. Batches are right
padded (positions start at 0 for every sequence, as in vLLM) and carry a ``loss_mask`` that marks
slot u when token u + 1 exists and belongs to the response: the positions a draft is asked to
predict.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from draftadapt.fileio import atomic_path


@dataclass
class Sequence:
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def as_sequences(rollouts: Iterable[Any]) -> list[Sequence]:
    """Rollouts as (prompt ids, response ids), in order: the one conversion from whatever an RL
    run holds to what the trainer batches. Takes the engine's Rollouts (``prompt_token_ids``,
    ``token_ids``), Sequences and spool records (``prompt_ids``, ``response_ids``), dicts with
    those keys, or (prompt, response) pairs."""
    out = []
    for r in rollouts:
        if hasattr(r, "prompt_token_ids"):
            out.append(Sequence(list(r.prompt_token_ids), list(r.token_ids)))
        elif hasattr(r, "prompt_ids"):
            out.append(Sequence(list(r.prompt_ids), list(r.response_ids)))
        elif isinstance(r, dict):
            out.append(Sequence(list(r["prompt_ids"]), list(r["response_ids"])))
        else:
            p, c = r
            out.append(Sequence(list(p), list(c)))
    for s in out:
        if s.response_ids and not s.prompt_ids:
            raise ValueError("a rollout has no prompt tokens; pass the prompt ids the engine was given")
    return out


def save_sequences(path: str | Path, seqs: Iterable[Sequence]) -> Path:
    """Write atomically (temp file + rename): an interrupted run never leaves half a data file."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for s in seqs:
            f.write(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids}) + "\n")
    return path


def load_sequences(path: str | Path) -> list[Sequence]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                out.append(Sequence(list(obj["prompt_ids"]), list(obj["response_ids"])))
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(
                    f"{path}:{n} is not a sequence record ({exc}); expected "
                    '{"prompt_ids": [...], "response_ids": [...]}; delete the file to regenerate it'
                ) from None
    return out


def collate(seqs: list[Sequence], pad_id: int, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch.

    returns input_ids [B, T] long, attention_mask [B, T] long, loss_mask [B, T] bool
    (slot u: token u + 1 exists and is a response token), prompt_lens [B], lengths [B].
    """
    ids = [s.ids[:max_len] if max_len else s.ids for s in seqs]
    width = max(len(x) for x in ids)
    b = len(seqs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in seqs], dtype=torch.long)
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
    for r, x in enumerate(ids):
        input_ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
        attention[r, : len(x)] = 1
        p = len(seqs[r].prompt_ids)
        # slots p-1 .. len-2 predict the response tokens p .. len-1
        loss_mask[r, max(p - 1, 0) : len(x) - 1] = True
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
            "prompt_lens": prompt_lens, "lengths": lengths}


def batch_order(lengths: list[int], batch_size: int, seed: int, bucket: int = 8) -> list[list[int]]:
    """The run's fixed batches of indices: shuffled, grouped by length within buckets of
    ``bucket`` batches (little padding), in a deterministic order for ``seed``."""
    rng = random.Random(seed * 1_000_003)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    batches: list[list[int]] = []
    chunk = batch_size * bucket
    for start in range(0, len(idx), chunk):
        group = sorted(idx[start : start + chunk], key=lambda i: lengths[i])
        batches += [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def epoch_plan(num_batches: int, seed: int, epoch: int, skip: int = 0, rank: int = 0,
               world: int = 1) -> list[int]:
    """Which of the fixed batches this rank trains on in ``epoch``, in order (batch ids).

    Epoch 0 takes them in their stored order, later epochs in a permutation drawn from
    (seed, epoch): the same on every run, which is what lets a resumed run skip the ``skip``
    steps it already took and continue identically. Every rank gets the same number of steps.
    """
    order = list(range(num_batches))
    if epoch > 0:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    usable = num_batches - num_batches % world
    return [order[n] for n in range(skip * world, usable) if n % world == rank]


def iter_batches(
    seqs: list[Sequence], batch_size: int, pad_id: int, seed: int, epoch: int, skip: int = 0,
    rank: int = 0, world: int = 1,
) -> Iterator[dict[str, torch.Tensor]]:
    """Padded batches for one epoch (see :func:`epoch_plan`); rank r of ``world`` gets its share."""
    order = batch_order([len(s) for s in seqs], batch_size, seed)
    for b in epoch_plan(len(order), seed, epoch, skip, rank, world):
        yield collate([seqs[i] for i in order[b]], pad_id)
