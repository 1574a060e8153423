"""``draftadapt demo``: runs the toy GRPO recipe (recipes/toy_grpo.py) with draftadapt attached."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy_grpo.py"


def load_recipe():
    if not RECIPE.is_file():
        raise FileNotFoundError(
            f"{RECIPE} is missing: the demo recipe lives in the repository's recipes/ folder; "
            "run `draftadapt demo` from an editable install of the repository (bash scripts/setup.sh)"
        )
    spec = importlib.util.spec_from_file_location("draftadapt_recipe_toy_grpo", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def demo_cli(out: str, steps: int | None, seed: int, toy: str | None, overrides: list[str] | None = None) -> int:
    argv = ["--out", out, "--seed", str(seed), *(overrides or [])]
    if steps is not None:
        argv += ["--steps", str(steps)]
    if toy is not None:
        argv += ["--toy", toy]
    return load_recipe().main(argv)
