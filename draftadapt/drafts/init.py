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
            module = load_eagle3(source, target)
        else:
            from transformers import AutoModelForCausalLM

            from draftadapt.drafts.eagle3 import init_from_target

            model = AutoModelForCausalLM.from_pretrained(str(target))
            module = init_from_target(model, None, draft_vocab, None, seed)
    elif method == "draft_model":
        if source is not None:
            raise DraftFormatError("--from imports Eagle-3 heads; a draft LM is an HF model dir already")
        from draftadapt.drafts.small_lm import build_small_lm

        module = build_small_lm(target, seed=seed)
    else:
        raise DraftFormatError(f"unknown draft method {method!r}; use eagle3 or draft_model")
    return export_draft(module, method, out, target, fmt=fmt, num_speculative_tokens=num_speculative_tokens,
                        meta={"version": 0, "policy_version": 0})


def export_draft(module, method: str, out: str | Path, target: str | Path, fmt: str = "speculators",
                 num_speculative_tokens: int = 3, meta: dict | None = None) -> Path:
    """Write a trained draft of either method as a draft directory vLLM loads (the one export
    every producer uses: ``draft init``, pretraining, the adapter's publishes). ``fmt``: the
    Eagle-3 checkpoint layout ("speculators" or "eagle"); a draft LM is always an HF directory."""
    if method == "eagle3":
        return export_eagle3(module, out, target, fmt=fmt, num_speculative_tokens=num_speculative_tokens, meta=meta)
    if method == "draft_model":
        from draftadapt.drafts.small_lm import export_small_lm

        return export_small_lm(module, out, target, meta=meta)
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
