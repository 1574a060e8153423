"""The pretrain recipes load into their dataclasses; overrides win; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftadapt.config import ConfigError, load_config
from draftadapt.pretrain import PretrainConfig, pretrain_cli

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize("name,method", [("pretrain_eagle3_toy.yaml", "eagle3"),
                                         ("pretrain_draft_lm_toy.yaml", "draft_model")])
def test_recipes_load(name, method):
    cfg = load_config(PretrainConfig, RECIPES / name, ["train.lr=1e-3", "data.num_prompts=8", "k=2"])
    assert cfg.method == method and cfg.train.lr == 1e-3 and cfg.data.num_prompts == 8 and cfg.k == 2
    assert cfg.train.ttt_steps >= 3  # Eagle-3 training-time test depth


@pytest.mark.parametrize("override,match", [
    ("train.lrr=1", "unknown key"),
    ("bogus=1", "unknown key"),
    ("train.loss=mse", "train.loss"),
    ("method=medusa", "method"),
    ("train.ttt_steps=0", "ttt_steps"),
])
def test_bad_overrides_are_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(PretrainConfig, RECIPES / "pretrain_eagle3_toy.yaml", [override])


def test_cli_reports_config_errors(capsys):
    assert pretrain_cli(str(RECIPES / "pretrain_eagle3_toy.yaml"), ["train.nope=1"]) == 2
    assert "unknown key" in capsys.readouterr().err
    assert pretrain_cli(str(RECIPES / "pretrain_eagle3_toy.yaml"), ["target=/nonexistent", "build_toy=false"]) == 2
    assert "toy build" in capsys.readouterr().err
