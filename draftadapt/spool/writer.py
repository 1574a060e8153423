"""The spool writer: how an RL run hands rollouts and policy checkpoints to ``draftadapt sidecar``.

The RL side (any framework, any process) writes into a spool directory; the sidecar reads it
(``reader.py``). The format is defined in ``format.py`` and documented for other languages and
frameworks in ``docs/spool-format.md``; this module is its reference writer.

    from draftadapt.spool import SpoolWriter

    spool = SpoolWriter("runs/rl/spool")
    spool.write_policy(0, "checkpoints/policy-0")           # HF dir, safetensors file or state dict
    for step in range(num_steps):
        prompts, responses, rewards = rollout(...)          # token ids, list[list[int]]
        spool.write_rollouts(step, policy_version, prompts, responses, rewards=rewards)
        ...
        spool.write_policy(policy_version, model.state_dict())
    spool.finish()
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftadapt.fileio import atomic_path, atomic_write_json, file_sha256, fsync_dir, fsync_file
from draftadapt.spool.format import (
    AUX_DTYPES,
    FINISHED_FILE,
    MAX_STEP,
    MAX_TOKEN_ID,
    MAX_VERSION,
    POLICY_DIR,
    ROLLOUTS_DIR,
    WRITER_ID_RE,
    check_rollout_tensors,
    policy_manifest,
    policy_name,
    rollout_manifest,
    rollout_name,
)


def _check_version(value: Any, what: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value <= limit:
        raise ValueError(f"{what} must be in 0..{limit}, got {value}")
    return value


def _ids(seq: Any, what: str) -> torch.Tensor:
    """One sequence of token ids (list, tuple, numpy array or tensor) as a 1-D int64 tensor."""
    try:
        t = torch.as_tensor(seq)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} is not a sequence of token ids ({exc})") from None
    if t.dim() != 1 or (t.numel() and t.dtype.is_floating_point) or t.dtype == torch.bool:
        raise ValueError(f"{what} must be a flat sequence of int token ids, got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int64)


class SpoolWriter:
    """Writes rollout shards and policy checkpoints into ``spool_dir`` (created if missing).

    ``writer_id`` ([A-Za-z0-9_], e.g. ``"rank0"``) goes into every name, followed by a random
    suffix drawn per instance, so writers never collide, also across restarts. Not thread-safe:
    use one instance per thread or process.
    """

    def __init__(self, spool_dir: str | Path, writer_id: str = "w") -> None:
        if not WRITER_ID_RE.match(writer_id):
            raise ValueError(f"writer_id {writer_id!r} must match {WRITER_ID_RE.pattern} (no '-', no '.')")
        self.spool_dir = Path(spool_dir)
        self.writer = f"{writer_id}_{secrets.token_hex(6)}"
        self._seq = 0
        self._finished = False
        self._host = socket.gethostname()
        for sub in (ROLLOUTS_DIR, POLICY_DIR):
            (self.spool_dir / sub).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ rollouts

    def write_rollouts(
        self,
        step: int,
        policy_version: int,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        rewards: Sequence[float] | None = None,
        aux_hidden: torch.Tensor | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write one shard of rollouts sampled by ``policy_version`` at RL ``step``; return its manifest path.

        ``prompt_ids[i]`` (non-empty) and ``response_ids[i]`` (may be empty) are token ids of
        sequence i. ``aux_hidden``: optional float tensor [total_tokens, D], one row per token of
        prompt + response of every sequence, in order (e.g. the Eagle-3 aux hidden states the
        trainer already computed). ``extra``: JSON-serialisable, copied into the manifest.
        """
        self._check_open()
        _check_version(step, "step", MAX_STEP)
        _check_version(policy_version, "policy_version", MAX_VERSION)
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty batch: write_rollouts needs at least one sequence")
        if len(response_ids) != n:
            raise ValueError(f"prompt_ids has {n} sequences, response_ids has {len(response_ids)}; pass one response per prompt")
        parts, prompt_lens = [], []
        for i in range(n):
            p = _ids(prompt_ids[i], f"prompt_ids[{i}]")
            r = _ids(response_ids[i], f"response_ids[{i}]")
            if p.numel() == 0:
                raise ValueError(f"prompt_ids[{i}] is empty; every sequence needs at least one prompt token")
            parts += [p, r]
            prompt_lens.append(p.numel())
        tokens = torch.cat(parts)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
            raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}, got {int(tokens.min())}..{int(tokens.max())}")
        seq_lens = [int(parts[2 * i].numel() + parts[2 * i + 1].numel()) for i in range(n)]
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
        tensors = {
            "tokens": tokens.to(torch.int32),
            "offsets": offsets,
            "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
        }
        if rewards is not None:
            rw = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
            if rw.numel() != n:
                raise ValueError(f"rewards has {rw.numel()} values for {n} sequences; pass one reward per sequence")
            tensors["rewards"] = rw
        if aux_hidden is not None:
            aux = torch.as_tensor(aux_hidden)
            if aux.dim() != 2 or aux.shape[0] != tokens.numel():
                raise ValueError(
                    f"aux_hidden has shape {tuple(aux.shape)}; expected [{tokens.numel()}, D]: one row per "
                    "token of prompt + response of every sequence, in order"
                )
            if aux.dtype not in AUX_DTYPES:
                raise ValueError(f"aux_hidden dtype {aux.dtype}; use float32, float16 or bfloat16")
            tensors["aux_hidden"] = aux.detach().cpu().contiguous()
        extra = self._check_extra(extra)
        name = self._next_name(lambda seq: rollout_name(step, policy_version, self.writer, seq), ROLLOUTS_DIR)
        _, total, dim = check_rollout_tensors(tensors, where=name)

        rdir = self.spool_dir / ROLLOUTS_DIR
        data = rdir / f"{name}.safetensors"
        with atomic_path(data) as tmp:  # streamed to disk: aux hidden states can be large
            save_file(tensors, str(tmp))
        manifest = rollout_manifest(
            name=name, data_file=data.name, sha256=file_sha256(data), bytes=data.stat().st_size, step=step,
            policy_version=policy_version, num_sequences=n, num_tokens=total, aux_hidden_dim=dim,
            has_rewards=rewards is not None, writer=self.writer, host=self._host, extra=extra,
        )
        path = rdir / f"{name}.json"
        atomic_write_json(path, manifest)  # last: from here on the shard is complete
        fsync_dir(rdir)
        return path

    # ------------------------------------------------------------------ policy checkpoints

    def write_policy(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | str | Path,
        step: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write policy checkpoint ``version`` (HF tensor names); return its manifest path.

        ``weights``: a state dict (written as ``model.safetensors``), a ``.safetensors`` file
        (copied as ``model.safetensors``) or an HF model directory (its ``*.safetensors``,
        ``model.safetensors.index.json`` and ``config.json`` are copied).
        """
        self._check_open()
        _check_version(version, "policy version", MAX_VERSION)
        if step is not None:
            _check_version(step, "step", MAX_STEP)
        extra = self._check_extra(extra)
        name = self._next_name(lambda seq: policy_name(version, self.writer, seq), POLICY_DIR)
        pdir = self.spool_dir / POLICY_DIR
        tmp = pdir / f".tmp-{name}"
        tmp.mkdir()
        try:
            self._fill_policy_dir(tmp, weights)
            files = {}
            for f in sorted(tmp.iterdir()):
                fsync_file(f)
                files[f.name] = {"sha256": file_sha256(f), "bytes": f.stat().st_size}
            fsync_dir(tmp)
            os.rename(tmp, pdir / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(pdir)
        manifest = policy_manifest(name=name, version=version, step=step, files=files, writer=self.writer,
                                   host=self._host, extra=extra)
        path = pdir / f"{name}.json"
        atomic_write_json(path, manifest)
        fsync_dir(pdir)
        return path

    @staticmethod
    def _fill_policy_dir(tmp: Path, weights: Mapping[str, torch.Tensor] | str | Path) -> None:
        if isinstance(weights, Mapping):
            if not weights:
                raise ValueError("write_policy got an empty state dict")
            bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise ValueError(f"write_policy: values of {bad[:3]} are not tensors; pass a state dict of tensors")
            sd, seen = {}, set()
            for k, v in weights.items():
                v = v.detach().cpu().contiguous()
                # safetensors refuses tensors that share memory (tied embeddings): copy the repeats.
                key = (v.untyped_storage().data_ptr(), v.storage_offset())
                sd[k] = v.clone() if key in seen else v
                seen.add(key)
            save_file(sd, str(tmp / "model.safetensors"))
            return
        src = Path(weights)
        if src.is_file():
            if src.suffix != ".safetensors":
                raise ValueError(f"{src} is not a .safetensors file; write_policy takes safetensors, an HF dir or a state dict")
            sources = [(src, "model.safetensors")]
        elif src.is_dir():
            shards = sorted(src.glob("*.safetensors"))
            if not shards:
                raise ValueError(
                    f"no *.safetensors in {src}; save the policy with save_pretrained(DIR, safe_serialization=True)"
                )
            sources = [(f, f.name) for f in shards]
            for meta in ("model.safetensors.index.json", "config.json"):
                if (src / meta).is_file():
                    sources.append((src / meta, meta))
        else:
            raise ValueError(f"policy weights {src} do not exist")
        for f, dst in sources:
            if f.suffix == ".safetensors":
                try:
                    with safe_open(str(f), "pt"):
                        pass
                except Exception as exc:
                    raise ValueError(f"{f} is not a readable safetensors file ({exc})") from None
            shutil.copyfile(f, tmp / dst)

    # ------------------------------------------------------------------ end of run

    def finish(self, **info: Any) -> Path:
        """Mark the end of the run (``FINISHED.json``). With several writers, call it once, from
        one of them, after all the others have returned from their last write."""
        self._check_open()
        info = self._check_extra(info)
        path = self.spool_dir / FINISHED_FILE
        atomic_write_json(path, {"writer": self.writer, "finished_unix": time.time(), **info})
        fsync_dir(self.spool_dir)
        self._finished = True
        return path

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError(f"{self.spool_dir}: this writer already called finish()")

    @staticmethod
    def _check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
        if extra is None:
            return {}
        if not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict, got {type(extra).__name__}")
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"extra must be JSON-serialisable ({exc})") from None
        return extra

    def _next_name(self, make, sub: str) -> str:
        while True:  # the random writer id makes a clash unlikely; never overwrite one anyway
            if self._seq > 999_999:  # six digits in the name: start a fresh writer id
                self.writer = f"{self.writer.rsplit('_', 1)[0]}_{secrets.token_hex(6)}"
                self._seq = 0
            name = make(self._seq)
            self._seq += 1
            if not (self.spool_dir / sub / f"{name}.json").exists():
                return name
