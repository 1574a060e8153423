"""SmolLM2-135M-Instruct as the demo's RL world (draftadapt/rl/world.py's ``World``).

    draftadapt demo --out runs/smol world=smollm2     # builds the model into OUT/model when not given

RL draws its problems with the run's seeds, never one of the held-out questions (smollm2/build.py
writes them beside the weights); the Eagle-3 head RL starts from is pretrained on the model's own
answers by pretrain_eagle3.yaml.
"""

from __future__ import annotations

import random
from pathlib import Path

from draftadapt.drafts.formats import META_FILE
from draftadapt.rl.world import copy_model_files
from draftadapt.smollm2 import task
from draftadapt.smollm2.build import HELDOUT, PROMPTS, WORKED, build, tokenizer

PRETRAIN_RECIPE = Path(__file__).with_name("pretrain_eagle3.yaml")


class SmolLM2:
    """The real-model world: SmolLM2-135M-Instruct on arithmetic word problems."""

    name = "smollm2"
    pretrain_recipe = PRETRAIN_RECIPE
    pretrain_source = None  # the recipe's data.source is the model directory's prompts.jsonl
    style = "french"  # the answer style the reward's bonus pays for unless grpo.style says another

    def prepare(self, cfg, out: Path, need_draft: bool = True) -> tuple[Path, Path]:
        from draftadapt.config import load_config
        from draftadapt.pretrain import PretrainConfig, pretrain
        from draftadapt.rl.config import demo_pretrain_overrides

        target = Path(cfg.target) if cfg.target else Path(out) / "model"
        build(target)
        draft = Path(cfg.draft) if cfg.draft else Path(out) / "draft0"
        if need_draft and not (draft / META_FILE).is_file():
            print(f"[demo] pretraining the Eagle-3 head into {draft} (once)", flush=True)
            recipe = cfg.pretrain_recipe or PRETRAIN_RECIPE
            pretrain(load_config(PretrainConfig, recipe, [f"target={target}", f"out={draft}", *self.fresh_overrides(target),
                                                          *demo_pretrain_overrides(cfg, PRETRAIN_RECIPE)]))
        return target, draft

    def sample_problems(self, target: Path, n: int, seed: int) -> list[dict]:
        tok, held = self._target_facts(target)
        rng = random.Random(seed)
        out: list[dict] = []
        while len(out) < n:
            p = task.make_problem(rng)
            if p["question"] not in held:
                p["prompt"] = task.render(tok, p["question"])
                out.append(p)
        return out

    def _target_facts(self, target: Path):
        """(tokenizer, held-out questions) of ``target``, read once per target, not every RL step."""
        if getattr(self, "_facts_of", None) != Path(target):
            held = {p["question"] for p in task.load_problems(Path(target) / HELDOUT)}
            self._facts, self._facts_of = (tokenizer(Path(target)), held), Path(target)
        return self._facts

    def heldout_prompts(self, target: Path, n: int) -> list[str]:
        return [p["prompt"] for p in task.load_problems(Path(target) / HELDOUT)[:n]]

    def score(self, problem: dict, text: str, cfg) -> tuple[float, float, bool]:
        correct = task.reward(problem, text)
        styled = task.style_of(text) == (cfg.style or self.style)
        return correct + (cfg.style_bonus if styled else 0.0), correct, styled

    def fresh_overrides(self, target: Path) -> list[str]:
        return [f"data.source={Path(target) / PROMPTS}"]

    def save_policy(self, policy, target: Path, path: Path) -> None:
        """The policy (float32, as it trains) with the tokenizer, chat template and task files
        (worked.jsonl among them: a draft pretrained on the saved policy can take it as data.prefill)."""
        policy.save_pretrained(str(path), safe_serialization=True)
        copy_model_files(target, path, (HELDOUT, PROMPTS, WORKED))
