"""Prompt files, and the token statistics of the target's own responses.

A draft must imitate the target's own outputs, not a dataset's: the prompts come from a
``datasets.Dataset`` (here: a local jsonl / json / parquet file; the toy world's generator is the
other source, chosen in ``draftadapt/pretrain.py``) and every response is sampled from the target
at the temperature RL will sample at.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from draftadapt.data.sequences import Sequence

if TYPE_CHECKING:
    import datasets

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _load_rows(source: str | Path, num: int | None, seed: int, fields: dict[str, str], what: str) -> "datasets.Dataset":
    """The file's ``fields`` columns (``{column: setting naming it}``), shuffled with ``seed``, first ``num`` kept."""
    import datasets

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{what} {source} does not exist; pass a local .jsonl/.json/.parquet file")
    fmt = _FORMATS.get(path.suffix)
    if fmt is None:
        raise ValueError(f"{what} {path} has suffix {path.suffix!r}; use one of {sorted(_FORMATS)}")
    ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    for column, setting in fields.items():
        if column not in ds.column_names:
            raise ValueError(f"{path} has no {column!r} column (columns: {ds.column_names}); set {setting}")
    ds = ds.shuffle(seed=seed)
    if num:
        ds = ds.select(range(min(num, len(ds))))
    return ds.select_columns(list(fields))


def load_prompt_file(source: str | Path, num: int | None = None, seed: int = 0, field: str = "prompt") -> "datasets.Dataset":
    """A Dataset with a ``prompt`` column from a local .jsonl/.json/.parquet file whose ``field``
    column holds prompt text (shuffled with ``seed``, first ``num`` kept)."""
    ds = _load_rows(source, num, seed, {field: "data.prompt_field"}, "prompt source")
    return ds.rename_column(field, "prompt") if field != "prompt" else ds


def load_prefill_file(tokenizer, source: str | Path, num: int | None = None, seed: int = 0, prompt_field: str = "prompt",
                      response_field: str = "response", chat_template: bool = False) -> list[Sequence]:
    """Prompts with their responses, as written (pretrain's ``data.prefill``): token sequences
    whose responses a draft is distilled on without decoding. Each response ends with the
    tokenizer's EOS, as a reply the engine finished would."""
    ds = _load_rows(source, num, seed, {prompt_field: "data.prompt_field", response_field: "data.response_field"},
                    "prefill file")
    prompts = tokenize_prompts(tokenizer, list(ds[prompt_field]), chat_template)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [Sequence(p, tokenizer(r, add_special_tokens=False).input_ids + eos)
            for p, r in zip(prompts, ds[response_field])]


def tokenize_prompts(tokenizer, prompts: list[str], chat_template: bool = False) -> list[list[int]]:
    """Prompt text -> token ids as the engine will see them (BOS included by the tokenizer)."""
    if chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True) for p in prompts]
    return [tokenizer(p).input_ids for p in prompts]


def token_counts(seqs: list[Sequence], vocab_size: int):
    """[V] frequency of each token id in the responses (for a reduced draft vocabulary)."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in seqs:
        if s.response_ids:
            counts += torch.bincount(torch.tensor(s.response_ids), minlength=vocab_size)[:vocab_size].double()
    return counts
