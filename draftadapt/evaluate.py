"""Acceptance of a draft, measured in vLLM and simulated offline, and what it buys in speed.

    draftadapt eval --target DIR --draft DIR [--k 3] [--temperature 1.0] [--num-prompts 64] [--json]

Starts the engine with the draft, generates one response per held-out prompt (the target's
``heldout.jsonl``; the toy's prompts otherwise) and reads vLLM's speculative-decoding counters;
starts it again without the draft for the plain tokens/s; then captures the target on the
responses vLLM produced (they are target samples: speculative decoding is lossless) and
simulates the acceptance of the draft on them (``metrics.acceptance``). Prints one JSON object:
``acceptance_length_measured``, ``acceptance_length_simulated``, ``per_position_acceptance``,
``per_position_acceptance_simulated``, ``tokens_per_s_spec``, ``tokens_per_s_plain``, ``speedup``
and the time per engine step with and without speculation.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftadapt.config import ConfigError, load_config
from draftadapt.drafts.formats import DraftFormatError
from draftadapt.drafts.methods import method_of_dir

GREEDY_EPS = 1e-4  # temperature 0 is greedy: capture at a tiny temperature (one-hot target)


@dataclass
class EvaluateConfig:
    """``draftadapt eval``'s settings (each flag sets the field of the same name)."""

    target: str = ""  # HF target model directory
    draft: str = ""  # draft directory (Eagle-3 or a small draft LM)
    k: int = 3  # speculative tokens per step
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    num_prompts: int = 64  # held-out prompts, one response each
    max_tokens: int = 96  # response budget
    seed: int = 0  # sampling seed (and the toy prompts' when the target has no heldout.jsonl)

    def validate(self) -> None:
        if not self.target or not self.draft:
            raise ConfigError("eval needs target and draft: pass --target DIR --draft DIR")
        if self.k < 1 or self.temperature < 0 or self.num_prompts < 1 or self.max_tokens < 1:
            raise ConfigError(f"eval: k >= 1, temperature >= 0, num_prompts >= 1 and max_tokens >= 1 "
                              f"(got {self.k}, {self.temperature}, {self.num_prompts}, {self.max_tokens})")


def eval_prompts(target: str | Path, num: int, seed: int) -> list[str]:
    held = Path(target) / "heldout.jsonl"
    if held.is_file():
        from draftadapt.toy.task import load_heldout

        rows = load_heldout(held)
        if len(rows) < num:
            print(f"note: {held} has only {len(rows)} prompts; evaluating on those", file=sys.stderr)
        return [r["prompt"] for r in rows[:num]]
    from draftadapt.toy.task import sample_problems

    print(f"note: {target} has no heldout.jsonl; evaluating on toy prompts (seed {seed})", file=sys.stderr)
    return [p["prompt"] for p in sample_problems(num, seed + 7_777_777)]


def _run_engine(target: Path, draft: Path | None, method: str, k: int, prompts: list[str], temperature: float,
                max_tokens: int, seed: int, repeats: int, threads: int | None):
    """Start an engine, warm it up, generate ``repeats`` times; the fastest run counts for speed."""
    from draftadapt.engine.rollout import RolloutEngine

    engine = RolloutEngine(target, draft, method=method, num_speculative_tokens=k, max_model_len=256,
                           max_num_seqs=max(len(prompts), 1), kv_cache_gib=1, seed=seed, threads=threads)
    try:
        engine.generate(prompts[: min(8, len(prompts))], temperature=temperature, max_tokens=8, seed=seed)
        runs = [engine.generate(prompts, temperature=temperature, max_tokens=max_tokens, seed=seed)
                for _ in range(max(1, repeats))]
    finally:
        engine.close()
        gc.collect()
    return runs


def simulate_on_rollouts(target: Path, draft: Path, method: str, rollouts, k: int, temperature: float,
                         batch_size: int = 32, threads: int | None = None):
    """Simulated acceptance of ``draft`` on the target's samples ``rollouts`` (visited, all starts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.capture.hidden import iter_captured
    from draftadapt.data.sequences import Sequence, collate
    from draftadapt.drafts.methods import method_for
    from draftadapt.train.trainer import score_draft

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(target))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    target_model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    m = method_for(method)
    model = m.load(draft, target).eval()
    capture = m.target_capture(target_model, model, max(temperature, GREEDY_EPS))
    seqs = [Sequence(list(r.prompt_token_ids), list(r.token_ids)) for r in rollouts]
    batches = (collate(seqs[i : i + batch_size], pad_id) for i in range(0, len(seqs), batch_size))
    return score_draft(model, iter_captured(capture, batches), k)


def evaluate(cfg: EvaluateConfig, repeats: int = 1, threads: int | None = None,
             prompts: list[str] | None = None) -> dict[str, Any]:
    target, draft = Path(cfg.target), Path(cfg.draft)
    k, temperature, num_prompts, max_tokens, seed = cfg.k, cfg.temperature, cfg.num_prompts, cfg.max_tokens, cfg.seed
    method = method_of_dir(draft).name
    prompts = prompts if prompts is not None else eval_prompts(target, num_prompts, seed)
    spec_runs = _run_engine(target, draft, method, k, prompts, temperature, max_tokens, seed, repeats, threads)
    plain_runs = _run_engine(target, None, method, k, prompts, temperature, max_tokens, seed, repeats, threads)
    spec = spec_runs[0].spec
    for r in spec_runs[1:]:
        spec = spec + r.spec
    tps_spec = max(r.tokens_per_s for r in spec_runs)
    tps_plain = max(r.tokens_per_s for r in plain_runs)
    t0 = time.perf_counter()
    # one torch thread: the capture is small, and two spinning OpenMP threads on a busy 2-core box
    # were several times slower than one
    visited, uniform = simulate_on_rollouts(target, draft, method, spec_runs[0].rollouts, k, temperature,
                                            threads=threads or 1)
    sim_seconds = time.perf_counter() - t0
    measured = spec.length
    speedup = tps_spec / tps_plain
    n = len(prompts)
    return {
        "method": method,
        "k": k,
        "temperature": temperature,
        "num_prompts": n,
        "acceptance_length_measured": round(measured, 4),
        "acceptance_length_simulated": round(visited.length, 4),
        "acceptance_length_simulated_all_starts": round(uniform.length, 4),
        "simulated_vs_measured": round(visited.length / measured - 1.0, 4),
        "per_position_acceptance": [round(x, 4) for x in spec.per_position],
        "per_position_acceptance_simulated": [round(x, 4) for x in visited.per_position],
        "drafts": spec.drafts,
        "tokens_per_s_spec": round(tps_spec, 1),
        "tokens_per_s_plain": round(tps_plain, 1),
        "speedup": round(speedup, 4),
        # With n sequences decoding in lockstep a step emits n tokens (plain) or n * L (spec):
        # the cost of one speculative step relative to a plain one is L / speedup.
        "ms_per_step_plain_est": round(1e3 * n / tps_plain, 2),
        "ms_per_step_spec_est": round(1e3 * n * measured / tps_spec, 2),
        "spec_step_cost_ratio": round(measured / speedup, 4),
        "tokens_generated": spec_runs[0].num_tokens,
        "seconds_spec": round(min(r.seconds for r in spec_runs), 3),
        "seconds_plain": round(min(r.seconds for r in plain_runs), 3),
        "seconds_simulation": round(sim_seconds, 2),
    }


def eval_cli(overrides: list[str], json_only: bool) -> int:
    """``draftadapt eval``: ``overrides`` are EvaluateConfig's ``key=value`` (from the flags)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = load_config(EvaluateConfig, None, overrides)
    try:
        result = evaluate(cfg)
    except (DraftFormatError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not json_only:
        print(f"acceptance length: measured {result['acceptance_length_measured']:.3f}, simulated "
              f"{result['acceptance_length_simulated']:.3f} (k={cfg.k}, T={cfg.temperature}); speedup "
              f"{result['speedup']:.2f}x ({result['tokens_per_s_plain']:.0f} -> {result['tokens_per_s_spec']:.0f} tokens/s)",
              file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0
