"""Bad simulator input gets a clear error naming the field and the fix."""

from __future__ import annotations

import pytest

from draftadapt.config import ConfigError, load_config
from draftadapt.sim.config import SimConfig
from draftadapt.sim.model import simulate


@pytest.mark.parametrize("overrides,fragment", [
    (["engine.step_overhead_ms=-1"], "engine.step_overhead_ms=-1.0 is negative"),
    (["learner.data_s=-0.5"], "learner.data_s=-0.5 is negative"),
    (["adapt.train_s=-3"], "adapt.train_s=-3.0 is negative"),
    (["spec.k=3", "spec.accept_length=4.5"], "must lie in [1, k+1] = [1, 4]"),
    (["spec.accept_length=0.5"], "spec.accept_length=0.5"),
    (["spec.k=2", "spec.accept_pos=[0.5,0.7]"], "rates cannot rise"),
    (["spec.k=3", "spec.accept_pos=[0.5,0.3]"], "has 2 entries but spec.k=3"),
    (["spec.k=2", "spec.accept_pos=[0.9,0.5]", "spec.accept_length=3.0"], "disagrees with spec.accept_pos"),
    (["spec.drift_per_step=1.5"], "spec.drift_per_step=1.5"),
    (["spec.nonsense=1"], "unknown key(s) ['nonsense'] for SpecConfig"),
    (["enigne.tp=2"], "unknown key(s) ['enigne']"),
    (["engine.gpu=A100"], "engine.gpu='A100' is unknown"),
    (["target.model=llama"], "target.model='llama' is unknown"),
    (["engine.bw_eff=1.5"], "engine.bw_eff=1.5 must lie in (0, 1]"),
    (["pipeline.modes=[async]"], "needs separate GPUs"),
    (["cluster.colocated=false", "cluster.gen_gpus=24", "cluster.train_gpus=4"], "must be positive and add up"),
    (["engine.tp=3"], "do not split into replicas of engine.tp=3"),
    (["spec.k=3", "adapt.accept_length=5"], "adapt.accept_length=5.0"),
    (["pipeline.max_lag=0"], "0 is the sync pipeline"),
    (["engine.fallback_ns_per_ctx=-1"], "engine.fallback_ns_per_ctx=-1.0 is negative"),
    (["engine.ngram_ns_per_token=-5"], "engine.ngram_ns_per_token=-5.0 is negative"),
    (["engine.decode_max_q=0"], "engine.decode_max_q=0 must be >= 1"),
])
def test_bad_input_is_a_config_error_that_names_the_field(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(SimConfig, None, overrides)
    assert fragment in str(info.value)


def test_model_that_does_not_fit_names_the_fix():
    cfg = load_config(SimConfig, None, ["target.model=qwen3-235b-a22b", "engine.tp=1"])
    with pytest.raises(ConfigError, match="raise engine.tp"):
        simulate(cfg, sweep=False)


def test_unknown_published_figure_is_rejected(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("published:\n  - figure: sync.speed.spec\n    value: 1.5\n")
    with pytest.raises(ConfigError, match="not one the model computes"):
        load_config(SimConfig, recipe)


def test_accept_pos_sets_the_acceptance_length():
    cfg = load_config(SimConfig, None, ["spec.k=3", "spec.accept_pos=[0.8,0.6,0.4]"])
    assert cfg.spec.accept_length == pytest.approx(2.8)


def test_overrides_win_over_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("spec:\n  k: 5\n  accept_length: 4.0\n")
    cfg = load_config(SimConfig, recipe, ["spec.accept_length=3.5"])
    assert (cfg.spec.k, cfg.spec.accept_length) == (5, 3.5)
