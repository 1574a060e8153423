"""The published figures, reproduced within their tolerance from the recipes; the simulate
command's table, --json and --plot; the reproduce script's exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftadapt.config import load_config
from draftadapt.sim.cli import run
from draftadapt.sim.config import SimConfig
from draftadapt.sim.model import simulate
from draftadapt.sim.report import compare

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("sim_*.yaml"))


def comparisons(path: Path):
    cfg = load_config(SimConfig, path)
    return compare(str(path), [], cfg, simulate(cfg, sweep=False))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_gated_published_figures_within_tolerance(path):
    for c in comparisons(path):
        if c.gated:
            assert abs(c.rel_err) <= c.tolerance, (
                f"{path.name} {c.figure} {c.overrides}: projected {c.projected:.4g}, "
                f"published {c.published:.4g} ({c.rel_err:+.1%})"
            )
        else:
            assert c.note, f"{path.name} {c.figure}: an ungated figure must say why"


def test_the_issues_headline_figures_are_gated_and_met():
    """Issue 5: 8B sync generation 65-72% of the step and 1.8x rollout; 235B async 2.5x."""
    zero = {(c.figure, tuple(c.overrides)): c for c in comparisons(ROOT / "recipes" / "sim_qwen3_8b_sync.yaml")}
    think = {(c.figure, tuple(c.overrides)): c for c in comparisons(ROOT / "recipes" / "sim_qwen3_8b_think_sync.yaml")}
    big = {(c.figure, tuple(c.overrides)): c for c in comparisons(ROOT / "recipes" / "sim_qwen3_235b_async.yaml")}
    headline = zero[("sync.gen_speedup.spec", ())]
    assert headline.gated and not headline.calibrated and abs(headline.rel_err) <= 0.10
    for share in (zero[("sync.gen_share.plain", ())], think[("sync.gen_share.plain", ())]):
        assert 0.65 * 0.9 <= share.projected <= 0.72 * 1.1
    for figure, published in (("async.e2e_speedup.spec", 2.5), ("async.gen_speedup.spec", 3.5)):
        c = big[(figure, ())]
        assert c.gated and c.published == published and abs(c.rel_err) <= 0.10


def test_8b_async_rows_reproduced_within_10_percent_one_fitted():
    """Issue 18 item 5: step 75.0 -> 60.5 s, exposed generation 10.4 s, 1.24x within 10%; only
    the exposed generation is fitted (the recipe's tail), the rest are predictions."""
    rows = {c.figure: c for c in comparisons(ROOT / "recipes" / "sim_qwen3_8b_async.yaml")}
    for figure, published in (("async.step_s.plain", 75.0), ("async.step_s.spec", 60.5),
                              ("async.e2e_speedup.spec", 1.24), ("async.exposed_gen_s.plain", 10.4)):
        c = rows[figure]
        assert c.gated and c.published == published and c.tolerance == 0.10
        assert abs(c.rel_err) <= 0.10, f"{figure}: {c.projected:.4g} vs {published} ({c.rel_err:+.1%})"
        assert c.calibrated == (figure == "async.exposed_gen_s.plain")
    assert rows["async.exposed_gen_s.spec"].projected < 0.6 * 1.1  # generation hidden, as published


def test_draft_length_and_ngram_rows_gated_within_15_percent():
    """Issue 20 item 5: the k=5/7 rows (one constant fitted to all four) and the n-gram rows
    (fitted on RL-Think, predicted on RL-Zero) within 15%; the k=3 rows stay within 10%."""
    think, zero = "sim_qwen3_8b_think_sync.yaml", "sim_qwen3_8b_sync.yaml"
    published = {(think, "spec.k=5"): 0.84, (think, "spec.k=7"): 0.71, (think, "spec.method=ngram"): 0.5,
                 (zero, "spec.k=5"): 1.44, (zero, "spec.k=7"): 1.21, (zero, "spec.method=ngram"): 0.7}
    seen = set()
    for name in (think, zero):
        for c in comparisons(ROOT / "recipes" / name):
            if c.figure != "sync.gen_speedup.spec":
                continue
            key = next(((name, o) for o in c.overrides if (name, o) in published), None)
            if key is None:
                if c.gated:  # a k = 3 row
                    assert c.tolerance == 0.10 and abs(c.rel_err) <= 0.10
                continue
            seen.add(key)
            assert c.gated and c.tolerance == 0.15 and c.published == published[key]
            assert abs(c.rel_err) <= 0.15, f"{key}: {c.projected:.3g} vs {c.published} ({c.rel_err:+.1%})"
            predicted = key == (zero, "spec.method=ngram")
            assert c.calibrated != predicted, key
            if key[1] == "spec.method=ngram":  # accepts over 2 tokens and is still slower than plain
                assert c.projected < 1.0
    assert seen == set(published)


def test_simulate_prints_table_and_published(capsys):
    assert run(str(ROOT / "recipes" / "sim_qwen3_8b_sync.yaml"), []) == 0
    out = capsys.readouterr().out
    assert "sync pipeline (seconds per RL step)" in out
    assert "speculation, frozen draft" in out
    assert "projected vs published" in out and "sync.gen_speedup.spec" in out
    assert "assumptions (not published):" in out


def test_simulate_json_and_plot(tmp_path, capsys):
    png = tmp_path / "sim.png"
    recipe = str(ROOT / "recipes" / "sim_qwen3_8b_adapt.yaml")
    assert run(recipe, ["sweep_points=3", "adapt.horizon_steps=20"], json_out=True, plot=str(png)) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["rows"]["sync"]) == {"plain", "spec", "adapt"}
    assert data["adapt_decision"]["gain_s"] == pytest.approx(data["adapt_decision"]["gain_s"])
    assert len(data["sweep"]["sync"]) == 3
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("overrides,fragment", [
    (["spec.accept_length=9"], "spec.accept_length=9.0 must lie in [1, k+1]"),
    (["engine.step_overhead_ms=-2"], "is negative"),
    (["spec.bogus=1"], "unknown key(s) ['bogus']"),
])
def test_simulate_bad_input_is_one_line_and_exit_2(overrides, fragment, capsys):
    assert run(str(ROOT / "recipes" / "sim_qwen3_8b_sync.yaml"), overrides) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and err.startswith("draftadapt simulate:")


def test_simulate_missing_recipe_exit_2(capsys):
    assert run("recipes/sim_nope.yaml", []) == 2
    assert "does not exist" in capsys.readouterr().err


def test_reproduce_script_exits_zero_and_prints_each_figure():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_reproduce.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "async.e2e_speedup.spec" in proc.stdout
    assert "gated figures within tolerance" in proc.stdout.splitlines()[-1]


def test_reproduce_script_fails_when_a_figure_is_off(tmp_path):
    recipe = tmp_path / "sim_off.yaml"
    recipe.write_text("published:\n  - figure: sync.gen_speedup.spec\n    value: 9.0\n"
                      "spec:\n  k: 3\n  accept_length: 3.0\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_reproduce.py"), str(recipe)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "OFF" in proc.stdout


def test_simulate_calibrates_to_telemetry_first(capsys):
    sample = ROOT / "recipes" / "sim_telemetry_sample.jsonl"
    recipe = str(ROOT / "recipes" / "sim_qwen3_8b_think_sync.yaml")
    assert run(recipe, [f"calibration.telemetry={sample}", "workload.sigma=0.7"], json_out=True) == 0
    data = json.loads(capsys.readouterr().out)
    fit = data["calibration"]
    assert fit["start"]["workload.sigma"] == 0.7
    assert fit["params"]["workload.sigma"] == pytest.approx(1.189, rel=0.05)  # the sample's truth
    assert fit["rms_rel_err"] < 0.03 and set(fit["rms_rel_err_by_stage"]) >= {"gen_s", "train_s"}
    assert run(recipe, ["calibration.telemetry=missing.jsonl"]) == 2


def test_reproduce_script_gates_the_demos_async_step():
    """Issue 18 item 5: the demo's async step time predicted within 15%, from the committed
    telemetry by default and from another run's with slowdowns given (nothing fitted)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_reproduce.py")],
                          capture_output=True, text=True, timeout=300)
    demo = [line for line in proc.stdout.splitlines() if " demo.async.step_s " in line]
    assert proc.returncode == 0 and len(demo) == 4, proc.stdout + proc.stderr
    assert all(line.rstrip().endswith(" ok") for line in demo)
    async_path, sync_path = (str(ROOT / "recipes" / f"demo_{k}_telemetry.jsonl") for k in ("async", "sync"))
    demo_only = ["--demo-async", async_path, "--demo-sync", sync_path, str(ROOT / "recipes" / "sim_qwen3_8b_sync.yaml")]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_reproduce.py"), *demo_only,
                           "--demo-cores", "1.44,2.27,0.16"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sync costs: steady steps, given s" in proc.stdout, proc.stdout + proc.stderr
    assert "none fitted" in proc.stdout
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_reproduce.py"), *demo_only,
                           "--demo-cores", "3,3,2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "OFF" in proc.stdout


def test_reproduce_script_refuses_a_sync_run_from_another_world(tmp_path):
    lines = (ROOT / "recipes" / "demo_sync_telemetry.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["rl/reward"] += 0.25
    other = tmp_path / "sync.jsonl"
    other.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sim_reproduce.py"), "--demo-async",
                           str(ROOT / "recipes" / "demo_async_telemetry.jsonl"), "--demo-sync", str(other)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not the same world and seed" in proc.stderr, proc.stdout + proc.stderr
