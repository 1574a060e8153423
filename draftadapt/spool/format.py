"""The spool format (version 1), defined once: names, tensors, manifest fields and their checks.

The writer (``writer.py``) builds manifests with :func:`rollout_manifest` / :func:`policy_manifest`
and runs :func:`check_rollout_tensors` before writing; the reader (``reader.py``) runs
:func:`check_manifest` and :func:`check_rollout_tensors` after reading, so both hold the same
rule. ``docs/spool-format.md`` documents it for writers in other languages.

Layout::

    SPOOL/rollouts/r{step:012d}-p{policy_version:09d}-{writer}-{seq:06d}.safetensors   data
    SPOOL/rollouts/r{step:012d}-p{policy_version:09d}-{writer}-{seq:06d}.json          manifest
    SPOOL/policy/p{version:09d}-{writer}-{seq:06d}/model.safetensors (+ config.json)   weights
    SPOOL/policy/p{version:09d}-{writer}-{seq:06d}.json                                manifest
    SPOOL/FINISHED.json                                                                end of run
    SPOOL/quarantine/                                                                  bad entries

Atomicity rule: data first (temp name, fsync, rename), the manifest LAST (temp name, fsync,
rename). An entry is complete iff its manifest exists and every sha256 in it matches; a reader
ignores entries without a manifest (still being written, or abandoned by a killed writer) and
every name that starts with ``.`` (temp files). Names are zero-padded so that sorting them sorts
rollouts by (step, policy_version); ``writer`` is unique per ``SpoolWriter`` so several writers
(ranks, restarts) never collide.
"""

from __future__ import annotations

import re
import time
from typing import Any, Mapping

import torch

FORMAT_VERSION = 1
ROLLOUT_FORMAT = "draftadapt-spool-rollouts"
POLICY_FORMAT = "draftadapt-spool-policy"

ROLLOUTS_DIR = "rollouts"
POLICY_DIR = "policy"
QUARANTINE_DIR = "quarantine"
FINISHED_FILE = "FINISHED.json"

MAX_STEP = 10**12 - 1  # 12 digits in the name
MAX_VERSION = 10**9 - 1  # 9 digits in the name
MAX_TOKEN_ID = 2**31 - 1  # tokens are stored as int32

# r{step}-p{policy_version}-{writer}-{seq}; the writer id is [A-Za-z0-9_]+ (no '-', so it parses).
ROLLOUT_NAME_RE = re.compile(r"^r(\d{12})-p(\d{9})-([A-Za-z0-9_]{1,64})-(\d{6})$")
POLICY_NAME_RE = re.compile(r"^p(\d{9})-([A-Za-z0-9_]{1,64})-(\d{6})$")
WRITER_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,40}$")

REQUIRED_TENSORS = ("tokens", "offsets", "prompt_lens")
OPTIONAL_TENSORS = ("rewards", "aux_hidden")
INT_DTYPES = (torch.int32, torch.int64)
AUX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SpoolFormatError(ValueError):
    """A spool entry that breaks the format; the message names the entry and what is wrong."""


def rollout_name(step: int, policy_version: int, writer: str, seq: int) -> str:
    return f"r{step:012d}-p{policy_version:09d}-{writer}-{seq:06d}"


def policy_name(version: int, writer: str, seq: int) -> str:
    return f"p{version:09d}-{writer}-{seq:06d}"


def check_rollout_tensors(t: Mapping[str, torch.Tensor], where: str) -> tuple[int, int, int | None]:
    """Check the arrays of one rollout shard against each other; return (sequences, tokens, aux dim).

    The writer runs it before writing and the reader after reading, so both hold the same rule.

    tokens [T] int32 (int64 accepted), offsets [n+1] int64 (int32 accepted), prompt_lens [n] int32,
    rewards [n] float32 (optional), aux_hidden [T, D] float32/float16/bfloat16 (optional).
    """
    missing = [k for k in REQUIRED_TENSORS if k not in t]
    unknown = sorted(set(t) - set(REQUIRED_TENSORS) - set(OPTIONAL_TENSORS))
    if missing or unknown:
        raise SpoolFormatError(
            f"{where}: tensors {sorted(t)}; required {list(REQUIRED_TENSORS)}, optional "
            f"{list(OPTIONAL_TENSORS)} (missing {missing}, unexpected {unknown})"
        )
    tokens, offsets, prompt_lens = t["tokens"], t["offsets"], t["prompt_lens"]
    for key in REQUIRED_TENSORS:
        if t[key].dim() != 1 or t[key].dtype not in INT_DTYPES:
            raise SpoolFormatError(
                f"{where}: {key} must be a 1-D int32/int64 tensor, got {t[key].dtype} {tuple(t[key].shape)}"
            )
    n, total = offsets.numel() - 1, tokens.numel()
    if n < 1:
        raise SpoolFormatError(f"{where}: offsets has {offsets.numel()} entries; need n + 1 >= 2")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise SpoolFormatError(
            f"{where}: offsets must start at 0 and end at len(tokens) = {total}, "
            f"got {int(offsets[0])} .. {int(offsets[-1])}"
        )
    lens = offsets[1:] - offsets[:-1]
    if bool((lens < 1).any()):
        raise SpoolFormatError(f"{where}: offsets must increase strictly (every sequence has a token)")
    if prompt_lens.numel() != n:
        raise SpoolFormatError(f"{where}: prompt_lens has {prompt_lens.numel()} entries, offsets describe {n} sequences")
    if bool((prompt_lens < 1).any()) or bool((prompt_lens.to(torch.int64) > lens).any()):
        raise SpoolFormatError(f"{where}: every prompt_lens[i] must be in 1..sequence length")
    if total and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
        raise SpoolFormatError(f"{where}: token ids must be in 0..{MAX_TOKEN_ID}")
    if "rewards" in t:
        r = t["rewards"]
        if r.dim() != 1 or r.numel() != n or not r.dtype.is_floating_point:
            raise SpoolFormatError(f"{where}: rewards must be float [{n}], got {r.dtype} {tuple(r.shape)}")
    dim = None
    if "aux_hidden" in t:
        a = t["aux_hidden"]
        if a.dim() != 2 or a.shape[0] != total or a.dtype not in AUX_DTYPES:
            raise SpoolFormatError(
                f"{where}: aux_hidden must be float32/float16/bfloat16 [{total}, D] (one row per token of "
                f"tokens, in order), got {a.dtype} {tuple(a.shape)}"
            )
        dim = int(a.shape[1])
    return n, total, dim


# Manifest fields (docs/spool-format.md). The reader requires the first group; the second is
# written by SpoolWriter and optional for foreign writers (informational, or with a default).
ROLLOUT_REQUIRED = ("format", "format_version", "data_file", "sha256", "step", "policy_version",
                    "num_sequences", "num_tokens")
ROLLOUT_OPTIONAL = ("aux_hidden_dim", "extra", "name", "bytes", "has_rewards", "writer", "host", "created_unix")
POLICY_REQUIRED = ("format", "format_version", "version", "files")
POLICY_OPTIONAL = ("step", "dir", "name", "writer", "host", "created_unix", "extra")
INT_FIELDS = ("step", "policy_version", "version", "num_sequences", "num_tokens")  # or null where optional

_MANIFESTS = {
    ROLLOUT_FORMAT: (ROLLOUT_REQUIRED, ROLLOUT_OPTIONAL),
    POLICY_FORMAT: (POLICY_REQUIRED, POLICY_OPTIONAL),
}


def _manifest(fmt: str, fields: dict[str, Any]) -> dict[str, Any]:
    required, optional = _MANIFESTS[fmt]
    man = {"format": fmt, "format_version": FORMAT_VERSION, **fields, "created_unix": time.time()}
    if set(man) != set(required) | set(optional):
        raise AssertionError(f"{fmt} manifest fields {sorted(man)} differ from the format's {sorted(required + optional)}")
    return man


def rollout_manifest(*, name: str, data_file: str, sha256: str, bytes: int, step: int, policy_version: int,
                     num_sequences: int, num_tokens: int, aux_hidden_dim: int | None, has_rewards: bool,
                     writer: str, host: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The manifest of one rollout shard (written after its data file)."""
    return _manifest(ROLLOUT_FORMAT, dict(
        name=name, data_file=data_file, sha256=sha256, bytes=bytes, step=step, policy_version=policy_version,
        num_sequences=num_sequences, num_tokens=num_tokens, aux_hidden_dim=aux_hidden_dim,
        has_rewards=has_rewards, writer=writer, host=host, extra=extra,
    ))


def policy_manifest(*, name: str, version: int, step: int | None, files: dict[str, dict[str, Any]],
                    writer: str, host: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The manifest of one policy checkpoint; ``files``: name -> {"sha256", "bytes"} of every file."""
    return _manifest(POLICY_FORMAT, dict(
        name=name, dir=name, version=version, step=step, files=files, writer=writer, host=host, extra=extra,
    ))


def check_manifest(man: Any, fmt: str, where: str) -> dict[str, Any]:
    """Check a manifest read back: a JSON object of format ``fmt`` and version 1, int fields
    that are ints, every required field present. Raises :class:`SpoolFormatError`."""
    if not isinstance(man, dict):
        raise SpoolFormatError(f"{where}: manifest must be a JSON object")
    if man.get("format") != fmt:
        raise SpoolFormatError(f"{where}: manifest format is {man.get('format')!r}, expected {fmt!r}")
    if man.get("format_version") != FORMAT_VERSION:
        raise SpoolFormatError(
            f"{where}: format_version {man.get('format_version')!r}; this draftadapt reads version "
            f"{FORMAT_VERSION}. If it was written by a newer draftadapt, upgrade and move it back from quarantine/"
        )
    for key in INT_FIELDS:
        if key in man and man[key] is not None and (isinstance(man[key], bool) or not isinstance(man[key], int)):
            raise SpoolFormatError(f"{where}: manifest {key} must be an int, got {man[key]!r}")
    for key in _MANIFESTS[fmt][0]:
        if key not in man:
            raise SpoolFormatError(f"{where}: manifest has no {key!r}")
    return man
