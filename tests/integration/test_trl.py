"""TRL 1.16's GRPOTrainer with draftadapt's rollout_func: a real trainer, a real vLLM engine.

On-policy check (issue 16, item 3): the log-probs the engine returns with its completions, drafted
by an Eagle-3 head and verified by the target, agree with the log-probs TRL recomputes for the
same tokens with its own forward (its ``old_per_token_logps``, the quantity its importance-sampling
correction compares them with).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from .conftest import pretrain_toy_head

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def quick_head(toy_target, tmp_path_factory) -> Path:
    """An Eagle-3 head trained for a few steps on toy sequences: it gets some drafts accepted."""
    return pretrain_toy_head(toy_target, tmp_path_factory.mktemp("trl") / "eagle3", 24)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_trls_recomputed_logprobs_with_speculation_on(toy_target, quick_head, tmp_path,
                                                                            temperature):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from draftadapt.adapter import DraftAdapter
    from draftadapt.integrations import import_framework

    trl = import_framework("trl")  # without its import's VLLM_LOGGING_LEVEL=ERROR for the tests after this one
    GRPOConfig, GRPOTrainer = trl.GRPOConfig, trl.GRPOTrainer
    from draftadapt.integrations.trl import SpeculativeRollouts
    from draftadapt.toy.task import load_heldout

    prompts = [p["prompt"] for p in load_heldout(toy_target / "heldout.jsonl")[:8]]
    import vllm  # noqa: F401  its import sets env defaults of its own (TORCHINDUCTOR_*); not ours

    torch.manual_seed(5)
    before = host_state()
    # k=3 at every batch size: every rollout goes through verification (online k's own path is the
    # recipe's, tests/e2e/test_readme_commands.py)
    rollouts = SpeculativeRollouts(toy_target, quick_head, tmp_path / "drafts", adapt=False, k=3, k_policy="fixed",
                                   engine_kwargs={"max_model_len": 256, "max_num_seqs": 64, "kv_cache_gib": 1,
                                                  "seed": 0})
    try:
        # issue 16, item 5: starting the engine (and an adapter beside it) inside the host's process
        # leaves its environment, torch thread count and RNG as they were
        assert host_state() == before, "starting the engine changed the host's state"
        DraftAdapter(toy_target, quick_head, tmp_path / "adapter")
        assert host_state() == before, "constructing the adapter changed the host's state"
        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, use_vllm=False, max_steps=1, seed=0,
            per_device_train_batch_size=32, num_generations=4, max_completion_length=64, temperature=temperature,
            # generation every 2 micro-steps with 1 accumulation step: TRL then recomputes the
            # sampling policy's log-probs (old_per_token_logps) with its own forward
            steps_per_generation=2, report_to=[], save_strategy="no", log_level="warning")
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(str(toy_target), dtype=torch.float32),
            processing_class=AutoTokenizer.from_pretrained(str(toy_target)),
            reward_funcs=[lambda prompts, completions, **_: [0.0] * len(completions)],
            args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), rollout_func=rollouts)
        trainer.model.train()
        before = rollouts.engine.acceptance_counters()
        out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(4)])
        acceptance = rollouts.engine.acceptance_counters() - before
    finally:
        rollouts.close()

    # speculation was on and drafts were accepted: the tokens went through verification
    assert acceptance.drafts > 0 and acceptance.length > 1.2, acceptance.to_dict()
    mask = out["completion_mask"].bool()
    assert mask.sum() > 32 * 10
    ours, theirs = out["sampling_per_token_logps"][mask], out["old_per_token_logps"][mask]
    assert torch.isfinite(ours).all()
    within_tolerance(ours, theirs)

    # the same check fails for a policy 10% off in its LM head (what a missed weight sync or a
    # wrong temperature looks like): the tolerance can tell
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        trainer.model.lm_head.weight.mul_(1.1)
        moved, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, out["completion_ids"].shape[1])
    with pytest.raises(AssertionError):
        within_tolerance(ours, moved[mask])


def within_tolerance(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Engine vs trainer log-probs of the same tokens (nats). vLLM's CPU kernels and transformers'
    differ in float32 rounding. Measured here (8 prompts x 4, 1661 tokens): with speculation,
    mean |d| 1.4e-3, 99th percentile 0.024, max 0.22, mean d -4e-4; without speculation (same
    setup, no draft) max 0.04, no offset. A policy 10% off in its LM head: mean |d| 0.014. At
    T = 0.7 (processed log-probs, 1652 tokens): mean |d| 9.6e-4, p99 0.030, max 0.073, mean d
    -4e-5; the 10%-off policy 6.8e-3.
    Bounds: mean |d| < 3e-3, 99th percentile < 0.05, |mean d| < 1e-3, max < 0.5."""
    d = ours - theirs
    a = d.abs()
    print(f"engine vs TRL log-probs: mean |d| {float(a.mean()):.2e}, p99 {float(a.quantile(0.99)):.2e}, "
          f"max {float(a.max()):.2e}, mean d {float(d.mean()):.2e} over {d.numel()} tokens")
    assert float(a.mean()) < 3e-3, f"mean |engine - TRL| log-prob {float(a.mean()):.2e}"
    assert float(a.quantile(0.99)) < 0.05, f"99th percentile {float(a.quantile(0.99)):.2e}"
    assert abs(float(d.mean())) < 1e-3, f"systematic offset {float(d.mean()):.2e}"
    assert float(a.max()) < 0.5, f"max {float(a.max()):.2e}"


# set once, at first import, by torch and vLLM modules imported lazily (not by constructing anything)
IMPORT_TIME_ENV = {"TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}


def host_state() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in IMPORT_TIME_ENV}
    # set_num_threads itself: vLLM's CPU worker swaps in a process-wide no-op (put back by RolloutEngine)
    return {"env": env, "threads": torch.get_num_threads(), "set_num_threads": torch.set_num_threads,
            "rng": torch.get_rng_state().tolist()}
