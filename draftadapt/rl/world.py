"""What a world gives the RL loop: the target and the draft RL starts from, the prompts, the
reward, and how a fresh draft is pretrained. The toy (draftadapt/toy/world.py, ``ToyRL``) and
SmolLM2-135M-Instruct (draftadapt/smollm2/world.py) are the two; ``draftadapt demo world=NAME``
picks one (draftadapt/demo.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol


class World(Protocol):
    name: str
    pretrain_recipe: Path  # the YAML that pretrains its Eagle-3/MTP draft (the initial and the fresh one)
    pretrain_source: Any  # handed to pretrain() for data.source=toy (None: the recipe names a prompt file)

    def prepare(self, cfg, out: Path, need_draft: bool = True) -> tuple[Path, Path]:
        """The target and the draft RL starts from, built into ``out`` once (given in ``cfg``: reused);
        ``need_draft=False`` (a run that serves none): the draft's path only, nothing pretrained."""

    def sample_problems(self, target: Path, n: int, seed: int) -> list[dict]:
        """``n`` problems drawn with ``seed``, each with the ``prompt`` text the engine generates from."""

    def heldout_prompts(self, target: Path, n: int) -> list[str]:
        """The held-out prompts every measurement arm generates on (never an RL prompt)."""

    def score(self, problem: dict, text: str, cfg) -> tuple[float, bool, bool]:
        """(reward, correct, in the style the reward's bonus pays for) of one response; ``cfg``: GRPOConfig."""

    def save_policy(self, policy, target: Path, path: Path) -> None:
        """The policy as a model directory transformers and vLLM load (the target's tokenizer beside it)."""


def copy_model_files(target: Path, path: Path, extra: tuple[str, ...] = ()) -> None:
    """The target's tokenizer files, chat template, generation config and ``extra`` files, copied
    into ``path`` (beside a policy saved there, so transformers and vLLM load it as a model)."""
    for f in Path(target).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name in ("generation_config.json", *extra):
            shutil.copy2(f, Path(path) / f.name)
