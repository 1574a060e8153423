"""``draftadapt draft init``: a fresh draft for a target, ready for vLLM (and for training)."""

from __future__ import annotations

import json
from pathlib import Path

from draftadapt.drafts.formats import META_FILE, DraftFormatError
from draftadapt.train.methods import method_for


def init_draft(target: str | Path, method: str, out: str | Path, fmt: str = "speculators",
               seed: int = 0, source: str | Path | None = None, draft_vocab: int | None = None,
               num_speculative_tokens: int = 3) -> Path:
    """Create a draft directory for ``target``. ``source`` imports an existing Eagle-3 head instead."""
    m = method_for(method)
    module = m.init(Path(target), seed=seed, source=source, draft_vocab=draft_vocab)
    return m.export(module, out, target, fmt=fmt, num_speculative_tokens=num_speculative_tokens,
                    meta={"version": 0, "policy_version": 0})


def init_cli(target: str, method: str, out: str, fmt: str, seed: int, source: str | None) -> int:
    try:
        path = init_draft(target, method, out, fmt=fmt, seed=seed, source=source)
    except DraftFormatError as exc:
        print(f"error: {exc}")
        return 2
    meta = json.loads((path / META_FILE).read_text())
    print(json.dumps({"out": str(path), "method": meta["method"], "format": meta["format"],
                      "sha256": meta["sha256"]}))
    return 0
