"""The command line's flags are fields of the commands' config dataclasses: a flag left out
leaves the dataclass default, a flag given sets its field, unknown keys are errors."""

from __future__ import annotations

import os

import pytest

from draftadapt.cli import DEMO_FLAGS, EVAL_FLAGS, _parser, field_overrides, main, parse_cli
from draftadapt.config import ConfigError, load_config
from draftadapt.evaluate import EvaluateConfig
from draftadapt.rl.config import DemoConfig


def _demo(argv: list[str]) -> DemoConfig:
    args = parse_cli(["demo", *argv])
    return load_config(DemoConfig, None, [*args.overrides, *field_overrides(args, DEMO_FLAGS)])


def test_demo_flags_are_democonfig_fields():
    assert _demo([]) == DemoConfig()
    cfg = _demo(["--out", "o", "--steps", "4", "--seed", "2", "--target", "t", "fresh_final=false"])
    assert (cfg.out, cfg.grpo.steps, cfg.seed, cfg.target, cfg.fresh_final) == ("o", 4, 2, "t", False)
    assert _demo(["--toy", "t"]).target == "t"  # the flag's older name, for the toy world's commands
    # the flag wins over an override of the same field
    assert _demo(["--seed", "5", "seed=3"]).seed == 5
    assert _demo(["seed=3"]).seed == 3  # no flag: the override holds (a flag's default used to win)


def test_overrides_may_sit_between_flags():
    cfg = _demo(["--toy", "t", "k=5", "--steps", "4", "fresh_final=false", "k=4"])
    assert (cfg.target, cfg.grpo.steps, cfg.fresh_final, cfg.k) == ("t", 4, False, 4)  # in order: the last k wins
    for argv in (["--toy", "t", "k=5", "--nope", "1"], ["--toy", "t", "k=5", "--steps", "4", "stray"]):
        with pytest.raises(SystemExit) as exc:
            parse_cli(["demo", *argv])
        assert exc.value.code == 2


def test_eval_flags_are_evaluateconfig_fields():
    args = _parser().parse_args(["eval", "--target", "t", "--draft", "d"])
    assert load_config(EvaluateConfig, None, field_overrides(args, EVAL_FLAGS)) == EvaluateConfig(target="t", draft="d")
    args = _parser().parse_args(["eval", "--target", "t", "--draft", "d", "--k", "5", "--temperature", "0",
                                 "--num-prompts", "8", "--max-tokens", "32", "--seed", "1", "--precision", "fp32"])
    cfg = load_config(EvaluateConfig, None, field_overrides(args, EVAL_FLAGS))
    assert (cfg.k, cfg.temperature, cfg.num_prompts, cfg.max_tokens, cfg.seed) == (5, 0.0, 8, 32, 1)
    assert cfg.precision == "fp32" and EvaluateConfig().precision == "auto"


def test_eval_k_table_flags_are_evaluateconfig_fields():
    args = _parser().parse_args(["eval", "--target", "t", "--draft", "d", "--ks", "0,1,2,3,4,5",
                                 "--batch-sizes", "8,32,128", "--measure", "fit", "--repeats", "2"])
    cfg = load_config(EvaluateConfig, None, field_overrides(args, EVAL_FLAGS))
    assert (cfg.ks, cfg.batch_sizes, cfg.measure, cfg.table_repeats) == ([0, 1, 2, 3, 4, 5], [8, 32, 128], "fit", 2)


@pytest.mark.parametrize("overrides,message", [
    (["ks=1,2"], "must hold 0"),
    (["ks=0"], "at least one k >= 1"),
    (["ks=0,2"], "needs batch sizes >= 1"),
    (["ks=0,2", "batch_sizes=0,8"], "needs batch sizes >= 1"),
    (["batch_sizes=8"], "pass --ks too"),
    (["ks=0,2", "batch_sizes=8", "table_repeats=0"], "table_repeats must be >= 1"),
    (["ks=0,2", "batch_sizes=8", "measure=some"], "is not one of"),
])
def test_eval_k_table_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EvaluateConfig, None, ["target=t", "draft=d", *overrides])


@pytest.mark.parametrize("argv,message", [
    (["demo", "--out", "/nonexistent/x", "nope=1"], "unknown key(s) ['nope'] for DemoConfig"),
    (["demo", "--out", "/nonexistent/x", "adapter.validate_cfg.margin=0.1"],
     "adapter.validate_cfg was renamed to adapter.validation"),
])
def test_demo_refuses_a_bad_key_before_it_starts(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_pretrain_command_waits_passively_and_no_other_does(monkeypatch, tmp_path, capsys):
    """OMP_WAIT_POLICY=PASSIVE is the `draftadapt pretrain` command's own (set before torch loads
    in its process); the demo's process keeps libgomp's default."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["demo", "--out", str(tmp_path), "nope=1"]) == 2
    assert "OMP_WAIT_POLICY" not in os.environ
    assert main(["pretrain", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe" in capsys.readouterr().err
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
