"""The toy world as the rest of draftadapt sees it, handed down from toy/ (nothing below imports it).

    TOY                                    # pretrain(cfg, toy=TOY), evaluate(cfg, toy=TOY)
    toy, draft = prepare_toy_world(out, None, None, seed=0, pretrain_recipe=PRETRAIN_RECIPE)

``TOY`` gives ``data.source=toy`` its prompts and ``build_toy`` its builder; the ``draftadapt``
command passes it to ``pretrain`` and ``eval``. :func:`prepare_toy_world` is where a toy RL run
(the demo, recipes/trl_grpo_toy.py, recipes/verl_grpo_toy.py) gets its target and first draft.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftadapt.config import ConfigError, load_config
from draftadapt.drafts.serving import serving_for
from draftadapt.pretrain import PretrainConfig, ToyWorld, pretrain
from draftadapt.drafts.formats import META_FILE
from draftadapt.rl.world import copy_model_files
from draftadapt.toy import PRETRAIN_RECIPE, task


def toy_prompts(num: int, seed: int) -> list[str]:
    """``num`` toy prompts drawn with ``seed``: the same list on every machine."""
    return [p["prompt"] for p in task.sample_problems(num, seed)]


def build_toy(out: str) -> dict:
    """Build the toy target into ``out`` with its defaults (``draftadapt toy build --out OUT``)."""
    from draftadapt.toy.build import build

    return build(out)


TOY = ToyWorld(prompts=toy_prompts, build=build_toy)


def prepare_toy_world(out: str | Path, toy: str | Path | None, draft: str | Path | None, seed: int,
                      pretrain_recipe: str | Path, pretrain_overrides: list[str] | tuple[str, ...] = (),
                      tag: str = "demo", method: str = "eagle3", own_draft: bool = False,
                      need_draft: bool = True) -> tuple[Path, Path]:
    """The toy target and an Eagle-3 draft pretrained on it, built into ``out`` unless given (and
    reused from ``out`` on a rerun). Returns (toy target dir, draft dir). ``method="mtp"``: the
    toy has one MTP layer (trained with it); the draft is that layer as the build left it with
    ``own_draft``, else a fresh MTP layer pretrained like the Eagle-3 head, on the toy's own
    samples (docs/design.md, "MTP"). ``need_draft=False`` (a run that serves no draft): the draft's
    path is returned as it is, nothing pretrained."""
    from draftadapt.draft_init import init_draft

    in_target = serving_for(method).in_target
    if own_draft and not in_target:
        raise ConfigError(f"method={method}: the target has no {method} draft of its own to start from; "
                          "pretrain one (the default) or pass draft=DIR")
    out = Path(out)
    toy = Path(toy) if toy else out / "toy"
    if not (toy / "heldout.jsonl").is_file():
        from draftadapt.toy.build import build

        print(f"[{tag}] building the toy target into {toy} (a few minutes, once)", flush=True)
        kind = {"arch": "qwen2", "mtp": 1} if in_target else {}
        print(json.dumps(build(str(toy), seed=seed, **kind)), flush=True)
    draft = Path(draft) if draft else out / "draft0"
    if (draft / META_FILE).is_file() or not need_draft:
        return toy, draft  # given, made by an earlier run into out, or not needed
    if own_draft:
        print(f"[{tag}] the target's own {method} layers as the draft, into {draft}", flush=True)
        init_draft(toy, method, draft)
    else:
        print(f"[{tag}] pretraining the {method} draft into {draft} (a few minutes, once)", flush=True)
        pretrain(load_config(PretrainConfig, pretrain_recipe, [f"target={toy}", f"out={draft}", f"method={method}",
                                                               *pretrain_overrides]), TOY)
    return toy, draft


class ToyRL:
    """The toy world as the demo's RL loop takes it (draftadapt/rl/world.py's ``World``)."""

    name = "toy"
    pretrain_recipe = PRETRAIN_RECIPE
    pretrain_source = TOY
    style = "verbose"  # the answer style the reward's bonus pays for unless grpo.style says another

    def prepare(self, cfg, out: Path, need_draft: bool = True) -> tuple[Path, Path]:
        from draftadapt.rl.config import demo_pretrain_overrides

        return prepare_toy_world(out, cfg.target, cfg.draft, cfg.seed, cfg.pretrain_recipe or PRETRAIN_RECIPE,
                                 demo_pretrain_overrides(cfg, PRETRAIN_RECIPE), tag="demo", method=cfg.method,
                                 own_draft=cfg.initial_draft == "own", need_draft=need_draft)

    def sample_problems(self, target: Path, n: int, seed: int) -> list[dict]:
        return task.sample_problems(n, seed)

    def heldout_prompts(self, target: Path, n: int) -> list[str]:
        return [p["prompt"] for p in task.load_heldout(target)[:n]]

    def score(self, problem: dict, text: str, cfg) -> tuple[float, float, bool]:
        correct = task.reward(problem, text)
        styled = task.style_of(text) == (cfg.style or self.style)
        reward = correct
        if cfg.style_bonus and styled:
            reward += cfg.style_bonus
        return reward, correct, styled

    def fresh_overrides(self, target: Path) -> list[str]:
        return ["build_toy=false"]

    def save_policy(self, policy, target: Path, path: Path) -> None:
        """The final policy as a model dir transformers and vLLM load (tokenizer and held-out
        problems copied from the toy; an MTP toy's layers carried over)."""
        from draftadapt.toy.mtp import carry_mtp_layers

        policy.save_pretrained(str(path), safe_serialization=True)
        carry_mtp_layers(target, path)  # an MTP toy's final policy is an MTP target again (no-op otherwise)
        copy_model_files(target, path, ("heldout.jsonl",))
