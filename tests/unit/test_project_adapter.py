"""scripts/project_adapter.py: the calibration read from a run and its arithmetic (simulator only)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from project_adapter import calibration, project  # noqa: E402


def fake_run(root: Path, adapt_s: float = 0.4, train_s: float = 6.0) -> Path:
    """A finished demo's files as the script reads them (the toy's shape, a 768-sample draft)."""
    (root / "final_policy").mkdir(parents=True)
    (root / "final_policy" / "config.json").write_text(json.dumps({
        "num_hidden_layers": 16, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 64, "intermediate_size": 384, "vocab_size": 64}))
    (root / "draft0").mkdir()
    (root / "draft0" / "config.json").write_text(json.dumps({
        "draft_vocab_size": 64, "transformer_layer_config": {"intermediate_size": 256}}))
    (root / "summary.json").write_text(json.dumps({
        "spec": True,
        "end_to_end": {"rl_step_s": 11.0, "gen_s": 4.6, "train_s": train_s, "adapt_s": adapt_s, "gen_share": 0.42},
        "last_third": {"adapted_over_frozen_acceptance": 1.4, "adapted_over_fresh_final_acceptance": 1.1}}))
    return root


def test_projection_scales_the_adapter_by_the_heads_size_and_keeps_the_acceptance_ratio(tmp_path):
    cal = calibration(fake_run(tmp_path / "a"))
    assert cal["adapt_over_update"] == pytest.approx(0.4 / 6.0)
    assert 0.05 < cal["toy_size_ratio"] < 0.12  # a one-layer head next to 16 layers
    (row,) = project(cal, "recipes/sim_qwen3_8b_sync.yaml", head_efficiency=0.5)
    assert row["accept_adapted"] == pytest.approx(3.32)  # capped at the recipe's fresh acceptance
    assert row["accept_frozen"] == pytest.approx(3.32 / 1.4)
    # twice the toy's adapter cost projects to twice the seconds at scale, and so does half the efficiency
    cal2 = calibration(fake_run(tmp_path / "b", adapt_s=0.8))
    (row2,) = project(cal2, "recipes/sim_qwen3_8b_sync.yaml", head_efficiency=0.5)
    assert row2["adapter_s"] == pytest.approx(2 * row["adapter_s"], rel=1e-9)
    (row3,) = project(cal, "recipes/sim_qwen3_8b_sync.yaml", head_efficiency=0.25)
    assert row3["adapter_s"] == pytest.approx(2 * row["adapter_s"], rel=1e-9)
    expected = cal["adapt_over_update"] * row["head_size_ratio"] / cal["toy_size_ratio"] / 0.5 * row["update_s"]
    assert row["adapter_s"] == pytest.approx(expected, rel=1e-9)
    # a better draft and a small adapter: faster than no speculation, the frozen draft in between
    assert row["step_adapted_s"] < row["step_frozen_s"] < row["step_plain_s"]


def test_a_run_without_an_adapter_is_refused(tmp_path):
    run = fake_run(tmp_path / "c", adapt_s=0.0)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "project_adapter.py"), "--run", str(run)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "not a finished draftadapt run" in proc.stderr, proc.stderr
