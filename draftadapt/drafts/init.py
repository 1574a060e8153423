"""``draftadapt draft init``: a fresh draft for a target, ready for vLLM (and for training)."""

from __future__ import annotations

import json
from pathlib import Path

from draftadapt.drafts.formats import DraftFormatError, export_eagle3, load_eagle3


def init_draft(target: str | Path, method: str, out: str | Path, fmt: str = "speculators",
               seed: int = 0, source: str | Path | None = None, draft_vocab: int | None = None,
               num_speculative_tokens: int = 3) -> Path:
    """Create a draft directory for ``target``. ``source`` imports an existing Eagle-3 head instead."""
    target = Path(target)
    if method == "eagle3":
        if source is not None:
            head = load_eagle3(source, target)
        else:
            from transformers import AutoModelForCausalLM

            from draftadapt.drafts.eagle3 import init_from_target

            model = AutoModelForCausalLM.from_pretrained(str(target))
            head = init_from_target(model, None, draft_vocab, None, seed)
        return export_eagle3(head, out, target, fmt=fmt, num_speculative_tokens=num_speculative_tokens,
                             meta={"version": 0, "policy_version": 0})
    if method == "draft_model":
        if source is not None:
            raise DraftFormatError("--from imports Eagle-3 heads; a draft LM is an HF model dir already")
        from draftadapt.drafts.small_lm import build_small_lm, export_small_lm

        return export_small_lm(build_small_lm(target, seed=seed), out, target,
                               meta={"version": 0, "policy_version": 0})
    raise DraftFormatError(f"unknown draft method {method!r}; use eagle3 or draft_model")


def init_cli(target: str, method: str, out: str, fmt: str, seed: int, source: str | None) -> int:
    try:
        path = init_draft(target, method, out, fmt=fmt, seed=seed, source=source)
    except DraftFormatError as exc:
        print(f"error: {exc}")
        return 2
    meta = json.loads((path / "draftadapt.json").read_text())
    print(json.dumps({"out": str(path), "method": meta["method"], "format": meta["format"],
                      "sha256": meta["sha256"]}))
    return 0
