"""recipes/verl_grpo_toy.py's summary of verl's metric rows (pure; the runs are
tests/integration/test_verl.py) and the arms' settings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("verl_grpo_toy", REPO / "recipes" / "verl_grpo_toy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def _rows(step_s, gen_s, accept=None, extra=None):
    out = []
    for i, (s, g) in enumerate(zip(step_s, gen_s)):
        d = {"timing_s/step": s, "timing_s/gen": g, "timing_s/old_log_prob": 1.0, "timing_s/update_actor": 2.0}
        if accept is not None:
            d["rollout/spec_accept_length"] = accept[i]
        d.update((extra or {}).get(i, {}))
        out.append({"step": i + 1, "data": d})
    return out


def test_the_summary_compares_the_three_arms_over_steps_two_on(recipe):
    da = {i: {"draftadapt/boundary_s": 0.5, "draftadapt/adapter_policy_forwards": 0.0,
              "draftadapt/served_workers": 2.0, "draftadapt/version_skew": float(i == 1),
              "draftadapt/handover_rows": 32.0, "draftadapt/engine/step_s": [50.0, 1.0, 3.0][i]} for i in range(3)}
    arms = {"adapted": _rows([99, 10, 12], [90, 4, 6], [2.0, 3.0, 3.3], da),
            "frozen": _rows([99, 11, 13], [90, 5, 7], [2.0, 2.5, 2.2]),
            "plain": _rows([99, 14, 16], [90, 8, 10])}
    s = recipe.summarize(arms, steps=3)
    a, f, p = (s["arms"][n] for n in ("adapted", "frozen", "plain"))
    assert (a["mean_step_s"], f["mean_step_s"], p["mean_step_s"]) == (11.0, 12.0, 15.0)  # step 1 left out
    assert a["stage_s"]["gen"] == 5.0 and a["stage_s"]["draftadapt"] == 0.5 and a["stage_s"]["update"] == 2.0
    assert p["stage_s"]["draftadapt"] != p["stage_s"]["draftadapt"]  # nan: no boundary without draftadapt
    assert s["step_adapted_over_frozen"] == 11.0 / 12.0 and s["step_adapted_over_plain"] == 11.0 / 15.0
    assert s["last_third_adapted_over_frozen"] == 3.3 / 2.2
    assert a["adapter_policy_forwards"] == 0 and a["served_workers"] == 2 and a["max_version_skew"] == 1
    assert "adapter_policy_forwards" not in f
    # the engine cores' share of the adapted arm's generation (steps 2 on): 2 s of 5
    assert a["engine_step_s"] == 2.0 and s["adapted_engine_share_of_gen"] == 0.4 and "engine_step_s" not in f


def test_only_the_speculating_arms_serve_a_draft(recipe, tmp_path):
    paths = {"draft": tmp_path / "draft", "policy": tmp_path / "policy"}
    for arm, speculates, mode in [("adapted", True, "draftadapt"), ("frozen", True, "sync"), ("plain", False, "sync")]:
        cfg = recipe.VerlToyConfig(arm=arm, replicas=2)
        over = recipe.verl_overrides(cfg, paths, tmp_path, tmp_path / arm)
        assert any("speculative_config" in o for o in over) is speculates
        assert f"trainer.v1.trainer_mode={mode}" in over
        assert "trainer.n_gpus_per_node=2" in over and "+ray_kwargs.ray_init.num_gpus=2" in over
        # one FSDP rank per replica: each rank's micro-batch is its share of the step's 64 x 4
        assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128" in over
        # every arm's actor trains and forwards in float32: verl's FSDP wrap would otherwise cast
        # to bf16 and autocast (175 s a toy update on a CPU without bf16, 7x the float32 one)
        [mp] = [o for o in over if ".actor.fsdp_config.mixed_precision=" in o]
        fields = dict(kv.split(":") for kv in mp.split("=", 1)[1].strip("{}").split(","))
        assert fields == {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}, mp
    # a draft given relative to the caller's directory reaches verl, which runs in the arm's, whole
    over = recipe.verl_overrides(recipe.VerlToyConfig(arm="adapted"), {"draft": Path("runs/x/draft0"), "policy":
                                                                       tmp_path / "policy"}, tmp_path, tmp_path / "a")
    whole = str(Path("runs/x/draft0").resolve())
    assert f"+draftadapt.draft={whole}" in over and any(f'"model": "{whole}"' in o for o in over if "speculative_config" in o)


def test_the_adapted_arm_starts_vllm_with_a_k_table_for_online_k(recipe, tmp_path):
    import json

    paths = {"draft": tmp_path / "draft", "policy": tmp_path / "policy"}

    def spec_of(over):
        [line] = [o for o in over if "speculative_config" in o]
        return json.loads(line.split("=", 1)[1].strip("'"))

    over = recipe.verl_overrides(recipe.VerlToyConfig(arm="adapted", online_k=("step_aside=false",)), paths,
                                 tmp_path, tmp_path / "a")
    spec = spec_of(over)
    assert spec["num_speculative_tokens"] == 5 and spec["num_speculative_tokens_per_batch_size"] == [[1, 256, 3]]
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.per_request_spec_decode_metrics=detailed" in over
    assert "+draftadapt.k_policy=auto" in over and "+draftadapt.online_k.step_aside=false" in over
    fixed = recipe.verl_overrides(recipe.VerlToyConfig(arm="adapted", k_policy="fixed"), paths, tmp_path, tmp_path / "a")
    assert spec_of(fixed)["num_speculative_tokens"] == 3 and "num_speculative_tokens_per_batch_size" not in spec_of(fixed)
    frozen = recipe.verl_overrides(recipe.VerlToyConfig(arm="frozen"), paths, tmp_path, tmp_path / "f")
    assert spec_of(frozen)["num_speculative_tokens"] == 3  # verl's own trainer at k


def test_the_summary_compares_arms_per_generated_token(recipe):
    # adapted: longer replies, slower steps; per token it is the cheaper one
    arms = {"adapted": _rows([99, 12, 12], [90, 6, 6], extra={i: {"response_length/mean": 60.0} for i in range(3)}),
            "plain": _rows([99, 10, 10], [90, 5, 5], extra={i: {"response_length/mean": 40.0} for i in range(3)})}
    s = recipe.summarize(arms, steps=3, batch=8)
    a, p = s["arms"]["adapted"], s["arms"]["plain"]
    assert a["mean_reply_tokens"] == 60.0 and p["mean_reply_tokens"] == 40.0
    assert a["gen_ms_per_token"] == pytest.approx(1e3 * 12 / (2 * 60 * 8))
    assert s["gen_per_token_adapted_over_plain"] == pytest.approx((6 / 60) / (5 / 40))
    assert s["step_per_token_adapted_over_plain"] == pytest.approx((12 / 60) / (10 / 40))
