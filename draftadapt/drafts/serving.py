"""The draft methods' names and serving facts: what an engine needs to know, without torch.

    serving = serving_for("eagle3")                      # a method name -> its serving facts
    serving.speculative_config(draft_dir, k, max_len)    # vLLM's speculative_config
    check_serves(serving, draft_dir, fmt, "set adapter.method={method}")

The serving layer (``engine/``) reads these and nothing of training; the per-method training
strategies (``train/methods.py``) are these classes extended with how a draft is made, captured
for, trained and scored (docs/design.md, "Draft methods"). Standard library only: importing this
module loads no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

METHODS = ("eagle3", "draft_model", "mtp")  # the names configs, the CLI and vLLM's speculative_config use


class DraftFormatError(ValueError):
    """A draft directory that cannot serve the given target; the message says why and what to do."""


class Eagle3Serving:
    """An Eagle-3 head on the target's aux hidden states (vLLM ``method="eagle3"``)."""

    name = "eagle3"
    describe = "an Eagle-3 head"
    formats = ("speculators", "eagle")  # its checkpoint layouts (drafts/formats.py)
    in_target = False  # True: the target itself carries the draft (MTP); an engine needs no draft dir

    def speculative_config(self, draft_dir: str | Path, k: int, max_model_len: int) -> dict[str, Any]:
        """vLLM's ``speculative_config``. ``method`` is always named: an Eagle-3 head served as
        EAGLE runs without an error at acceptance 1.0 (docs/design.md, "Eagle-3 aux layers")."""
        return {"method": self.name, "model": str(draft_dir), "num_speculative_tokens": k}


class DraftLMServing:
    """A small draft LM sharing the target's tokenizer (vLLM ``method="draft_model"``)."""

    name = "draft_model"
    describe = "an HF draft LM"
    formats = ("hf",)
    in_target = False

    def speculative_config(self, draft_dir: str | Path, k: int, max_model_len: int) -> dict[str, Any]:
        # vLLM sizes the draft model's own KV cache from it
        return {"method": self.name, "model": str(draft_dir), "num_speculative_tokens": k,
                "max_model_len": max_model_len}


class MTPServing:
    """The target's own MTP layers (vLLM ``method="mtp"``, MiMo layout; docs/design.md, "MTP")."""

    name = "mtp"
    describe = "a target's MTP layers"
    formats = ("mtp",)
    in_target = True

    def speculative_config(self, draft_dir: str | Path | None, k: int, max_model_len: int) -> dict[str, Any]:
        # no "model": vLLM reads the MTP layers from the target's own checkpoint; a draft dir's
        # layers are loaded into the drafter once it runs (RolloutEngine)
        return {"method": self.name, "num_speculative_tokens": k}


SERVINGS = (Eagle3Serving(), DraftLMServing(), MTPServing())  # in METHODS' order
MethodServing = Eagle3Serving | DraftLMServing | MTPServing


def serving_for(name: str) -> MethodServing:
    """The serving facts of a method name ("eagle3", "draft_model", "mtp")."""
    for serving in SERVINGS:
        if serving.name == name:
            return serving
    raise DraftFormatError(f"unknown draft method {name!r}; use one of {', '.join(METHODS)}")


def serving_of_format(fmt: str) -> MethodServing:
    """The method that serves a checkpoint layout (``formats.detect_format``)."""
    eagle3, draft_lm, mtp = SERVINGS
    if fmt in mtp.formats:
        return mtp
    return draft_lm if fmt in draft_lm.formats else eagle3


def check_serves(method: MethodServing, draft_dir: str | Path, fmt: str | None, fix: str,
                 error: type[Exception] = DraftFormatError) -> None:
    """Refuse a draft directory in another method's layout (``fix``: what to set, with
    ``{method}`` for the right one): served or trained as the wrong method it runs without an
    error at acceptance 1.0 (docs/design.md, "Eagle-3 aux layers")."""
    if fmt is not None and fmt not in method.formats:
        right = serving_of_format(fmt)
        raise error(f"{draft_dir} is {right.describe}; " + fix.format(method=right.name))
