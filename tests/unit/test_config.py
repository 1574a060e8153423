import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from draftadapt.adapter import AdapterConfig
from draftadapt.config import ConfigError, load_config


@dataclass
class Train:
    lr: float = 1e-3  # learning rate
    steps: int = 10
    layers: list[int] = field(default_factory=lambda: [1, 2])
    mode: str = "kl"

    def validate(self):
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")


@dataclass
class Recipe:
    name: str = "x"
    train: Train = field(default_factory=Train)
    flag: bool = False


def test_yaml_then_overrides_win(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: a\ntrain:\n  lr: 0.01\n  steps: 5\n")
    cfg = load_config(Recipe, p, ["train.steps=7", "flag=true", "train.layers=[3,4]"])
    assert cfg.name == "a" and cfg.train.lr == 0.01 and cfg.train.steps == 7
    assert cfg.flag is True and cfg.train.layers == [3, 4]


def test_unknown_keys_are_errors_naming_the_key(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lrr: 0.01\n")
    with pytest.raises(ConfigError, match=r"lrr.*known keys"):
        load_config(Recipe, p)
    with pytest.raises(ConfigError, match="nope"):
        load_config(Recipe, None, ["train.nope=1"])


def test_types_are_checked_and_validate_runs():
    with pytest.raises(ConfigError, match="expected int"):
        load_config(Recipe, None, ["train.steps=abc"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(Recipe, None, ["train.lr=-1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Recipe, None, ["train.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Recipe, "/nonexistent.yaml")


def test_an_override_inside_a_section_keeps_the_parents_defaults_for_the_rest():
    """A recipe's default for a nested section (a default_factory) survives an override of one
    of its keys: only that key changes, at any depth."""
    from dataclasses import dataclass, field

    from draftadapt.config import load_config

    @dataclass
    class Inner:
        a: int = 1
        b: int = 2

    @dataclass
    class Mid:
        inner: Inner = field(default_factory=Inner)
        c: float = 0.5

    @dataclass
    class Top:
        mid: Mid = field(default_factory=lambda: Mid(inner=Inner(a=10, b=20), c=0.9))

    cfg = load_config(Top, None, ["mid.inner.a=11"])
    assert cfg.mid.inner == Inner(a=11, b=20) and cfg.mid.c == 0.9
    cfg = load_config(Top, None, ["mid.c=0.1"])
    assert cfg.mid.inner == Inner(a=10, b=20) and cfg.mid.c == 0.1
    assert load_config(Top, None, []) == Top()


def test_a_renamed_key_names_the_new_one(tmp_path):
    """A config.yaml saved before AdapterConfig.validate_cfg became ``validation`` fails telling
    the user what to write instead (at any depth), and the new key works."""
    from draftadapt.adapter import AdapterConfig
    from draftadapt.rl.config import DemoConfig

    with pytest.raises(ConfigError, match=r"^validate_cfg was renamed to validation; write validation"):
        load_config(AdapterConfig, None, ["validate_cfg.margin=0.1"])
    p = tmp_path / "config.yaml"
    p.write_text("adapter:\n  validate_cfg:\n    max_heldout: 16\n")
    with pytest.raises(ConfigError, match=r"^adapter.validate_cfg was renamed to adapter.validation"):
        load_config(DemoConfig, p)
    cfg = load_config(DemoConfig, None, ["adapter.validation.margin=0.2"])
    assert cfg.adapter.validation.margin == 0.2 and cfg.adapter.validation.max_heldout == 32


def test_demo_initial_draft_is_the_targets_own_only_where_it_has_one():
    from draftadapt.rl.config import DemoConfig

    assert load_config(DemoConfig, None, ["method=mtp"]).initial_draft == "pretrain"
    assert load_config(DemoConfig, None, ["method=mtp", "initial_draft=own"]).initial_draft == "own"
    with pytest.raises(ConfigError, match=r"initial_draft=own: method=eagle3 has no draft inside the target"):
        load_config(DemoConfig, None, ["initial_draft=own"])
    with pytest.raises(ConfigError, match=r"initial_draft"):
        load_config(DemoConfig, None, ["initial_draft=target"])


def test_demo_adapter_defaults_follow_the_method(tmp_path):
    """method=mtp starts from the toy adapter for MTP layers (one block a round, three rounds of
    advance, a 3% margin); a key given sets only itself, from the command line or a YAML file."""
    from draftadapt.rl.config import DemoConfig, toy_adapter

    def knobs(cfg):
        a = cfg.adapter
        return a.schedule.max_train_steps, a.schedule.burst_rounds, a.validation.margin, a.schedule.every_n_steps

    assert knobs(load_config(DemoConfig, None, [])) == (16, 2, 0.01, 2)
    assert load_config(DemoConfig, None, []).adapter == toy_adapter() == DemoConfig().adapter
    assert knobs(load_config(DemoConfig, None, ["method=mtp"])) == (8, 3, 0.03, 2)
    assert load_config(DemoConfig, None, ["method=mtp"]).adapter == toy_adapter("mtp")
    assert knobs(load_config(DemoConfig, None, ["method=mtp", "adapter.schedule.max_train_steps=24"])) == (24, 3, 0.03, 2)
    p = tmp_path / "mtp.yaml"
    p.write_text("method: mtp\nadapter:\n  schedule:\n    every_n_steps: 1\n")
    assert knobs(load_config(DemoConfig, p)) == (8, 3, 0.03, 1)
    # the rest of the two is the same adapter
    eagle, mtp = toy_adapter(), toy_adapter("mtp")
    assert (eagle.train, eagle.priority, eagle.schedule.max_share) == (mtp.train, mtp.priority, mtp.schedule.max_share)


def test_demo_drafts_are_trained_at_least_k_steps_deep(tmp_path):
    """vLLM chains the draft k times: the demo's pretrains and its adapter unroll at least k TTT
    steps and score at k; a deeper recipe or adapter setting is kept."""
    from draftadapt.rl.config import DemoConfig, demo_adapter, demo_pretrain_overrides
    from draftadapt.toy import PRETRAIN_RECIPE

    cfg = load_config(DemoConfig, None, [])  # k=3: the recipe's and the adapter's depth of 3 stand
    assert demo_pretrain_overrides(cfg, PRETRAIN_RECIPE) == ["data.num_prompts=768", "k=3"]
    assert (demo_adapter(cfg).k, demo_adapter(cfg).train.ttt_steps, demo_adapter(cfg).method) == (3, 3, "eagle3")
    cfg = load_config(DemoConfig, None, ["method=mtp"])  # MTP's default k is 5
    assert cfg.k == 5 and load_config(DemoConfig, None, ["method=mtp", "k=3"]).k == 3
    assert DemoConfig(method="mtp").k == 5 and DemoConfig().k == 3  # built in code too
    with pytest.raises(ConfigError, match=r"k=0: give the number of tokens"):
        load_config(DemoConfig, None, ["k=0"])
    assert demo_pretrain_overrides(cfg, PRETRAIN_RECIPE) == ["data.num_prompts=768", "k=5", "train.ttt_steps=5"]
    assert (demo_adapter(cfg).k, demo_adapter(cfg).train.ttt_steps, demo_adapter(cfg).method) == (5, 5, "mtp")
    assert cfg.adapter.train.ttt_steps == 3  # the config itself is not changed
    deep = tmp_path / "deep.yaml"
    deep.write_text(PRETRAIN_RECIPE.read_text().replace("ttt_steps: 3", "ttt_steps: 7"))
    cfg = load_config(DemoConfig, None, ["k=5", f"pretrain_recipe={deep}", "adapter.train.ttt_steps=6"])
    assert demo_pretrain_overrides(cfg, PRETRAIN_RECIPE) == ["data.num_prompts=768", "k=5"]
    assert demo_adapter(cfg).train.ttt_steps == 6
    # a run sampling at another temperature than the recipe's pretrains its draft at the run's
    cfg = load_config(DemoConfig, None, ["grpo.temperature=0.7"])
    assert demo_pretrain_overrides(cfg, PRETRAIN_RECIPE) == ["data.num_prompts=768", "k=3", "generate.temperature=0.7"]


def test_demo_engines_refuses_what_the_fleet_does_not_run():
    from draftadapt.rl.config import DemoConfig

    assert load_config(DemoConfig, None, ["engines=2"]).engines == 2
    with pytest.raises(ConfigError, match=r"engines=0: give the number of rollout engines"):
        load_config(DemoConfig, None, ["engines=0"])
    with pytest.raises(ConfigError, match=r"engines=2 runs the synchronous Ray fleet; .*async_lag, k_policy=online"):
        load_config(DemoConfig, None, ["engines=2", "async_lag=1", "k_policy=online"])


def test_a_fact_has_one_field_and_is_passed_down():
    """k, method and the sampling temperature are the demo's (k, method, grpo.temperature): the
    adapter gets them passed down; its own field set to another value is refused naming both."""
    from draftadapt.rl.config import DemoConfig, demo_adapter

    a = demo_adapter(load_config(DemoConfig, None, ["grpo.temperature=0.7"]))
    assert (a.method, a.k, a.temperature) == ("eagle3", 3, 0.7)  # the draft matches what the engine samples
    a = demo_adapter(load_config(DemoConfig, None, ["k=4", "adapter.k=4", "adapter.temperature=1.0"]))
    assert (a.k, a.temperature) == (4, 1.0)  # the same value twice is no conflict
    for overrides, message in [
        (["adapter.k=4"], "adapter.k=4 conflicts with k=3: set only k (k=4 if"),
        (["method=mtp", "adapter.k=3"], "adapter.k=3 conflicts with k=5"),
        (["adapter.method=draft_model"], "adapter.method=draft_model conflicts with method=eagle3: set only method"),
        (["grpo.temperature=0.7", "adapter.temperature=1.0"],
         "adapter.temperature=1.0 conflicts with grpo.temperature=0.7: set only grpo.temperature"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(DemoConfig, None, overrides)
    with pytest.raises(ConfigError, match=re.escape("adapter.k=4 conflicts with k=3")):
        demo_adapter(DemoConfig(adapter=AdapterConfig(k=4)))  # built in code: refused when the run starts


def test_the_trl_integration_passes_method_and_k_down(tmp_path):
    """SpeculativeRollouts(method=, k=) are the engine's; an adapter_cfg that says otherwise is
    refused before an engine starts."""
    from draftadapt.integrations.trl import SpeculativeRollouts

    with pytest.raises(ConfigError, match=re.escape("adapter_cfg.k=4 conflicts with SpeculativeRollouts.k=3")):
        SpeculativeRollouts(tmp_path / "policy", tmp_path / "draft", adapter_cfg=AdapterConfig(k=4))
    with pytest.raises(ConfigError, match=re.escape("adapter_cfg.method=mtp conflicts with SpeculativeRollouts.method")):
        SpeculativeRollouts(tmp_path / "policy", tmp_path / "draft", adapter_cfg=AdapterConfig(method="mtp"), k=5)
    with pytest.raises(ConfigError, match=re.escape("k_policy='sometimes': choose 'auto', 'online' or 'fixed'")):
        SpeculativeRollouts(tmp_path / "policy", tmp_path / "draft", k_policy="sometimes")


def test_an_adapter_made_directly_runs_eagle3_at_k3_and_t1():
    assert AdapterConfig().with_run_defaults() == AdapterConfig(method="eagle3", k=3, temperature=1.0)
    assert AdapterConfig(k=5).with_run_defaults().k == 5


@pytest.mark.parametrize("override, message", [
    ("schedule.max_share=1.5", "max_share is a fraction of the run's time"),
    ("schedule.chase_gain=-0.1", "chase_gain is a fraction >= 0"),
])
def test_the_schedules_fractions_are_checked_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(AdapterConfig, None, [override])


def test_demo_world_sets_the_runs_sizes_and_refuses_what_it_cannot_serve():
    """world=smollm2 starts from its own GRPO and eval sizes (a key given still wins); an MTP
    method on it is refused naming the fix."""
    from draftadapt.rl.config import DemoConfig, GRPOConfig, demo_adapter, demo_pretrain_overrides
    from draftadapt.smollm2.world import PRETRAIN_RECIPE as SMOLLM2_RECIPE

    toy, smol = load_config(DemoConfig, None, []), load_config(DemoConfig, None, ["world=smollm2"])
    assert toy.grpo == GRPOConfig() and toy.pretrain_prompts == 768
    assert (smol.grpo.prompts_per_step, smol.grpo.max_tokens, smol.grpo.lr, smol.eval.max_tokens) == (8, 128, 5e-5, 128)
    assert smol.pretrain_prompts == 0  # the SmolLM2 recipe's own
    # it samples at 0.7 (on task there), and so its head is distilled and its adapter trained at 0.7
    assert smol.grpo.temperature == 0.7 and toy.grpo.temperature == 1.0
    assert demo_adapter(smol).temperature == 0.7
    assert "generate.temperature=0.7" not in demo_pretrain_overrides(smol, SMOLLM2_RECIPE)  # the recipe's own
    assert load_config(DemoConfig, None, ["world=smollm2", "grpo.lr=1e-5"]).grpo.max_tokens == 128
    # its adapter is the toy's at a rate of 3e-4 (the toy's 2e-3 had every round rejected there);
    # a key given sets only itself
    assert (smol.adapter.train.lr, toy.adapter.train.lr) == (3e-4, 2e-3)
    assert replace(smol.adapter, train=toy.adapter.train) == toy.adapter
    given = load_config(DemoConfig, None, ["world=smollm2", "adapter.schedule.max_share=0"]).adapter
    assert (given.train.lr, given.schedule.max_share, given.schedule.train_steps) == (3e-4, 0.0, 8)
    with pytest.raises(ConfigError, match=r"method=mtp: world=smollm2 serves an Eagle-3 head"):
        load_config(DemoConfig, None, ["world=smollm2", "method=mtp"])
    with pytest.raises(ConfigError, match=r"world"):
        load_config(DemoConfig, None, ["world=llama"])
