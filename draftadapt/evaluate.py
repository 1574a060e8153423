"""Acceptance of a draft, measured in vLLM and simulated offline, and what it buys in speed.

    draftadapt eval --target DIR --draft DIR [--k 3] [--temperature 1.0] [--num-prompts 64] [--json]
    draftadapt eval --target DIR --draft DIR --ks 0,1,2,3,4,5 --batch-sizes 8,32,128 [--json]

Starts the engine with the draft, generates one response per held-out prompt (the target's
``heldout.jsonl``; otherwise the toy world's prompts, which the ``draftadapt`` command hands in)
and reads vLLM's speculative-decoding counters; starts it again without the draft for the plain
tokens/s; then captures the target on the responses vLLM produced (they are target samples:
speculative decoding is lossless) and simulates the acceptance of the draft on them
(``metrics.acceptance``). Prints one JSON object:
``acceptance_length_measured``, ``acceptance_length_simulated``, ``per_position_acceptance``,
``per_position_acceptance_simulated``, ``tokens_per_s_spec``, ``tokens_per_s_plain``, ``speedup``
and the time per engine step with and without speculation.

With ``--ks``, the k table instead (:func:`k_table`): tokens/s and acceptance length for every
draft length k (0 = no speculation) at every batch size, measured with one engine per k, the
measured best k per batch size, and the k the step-cost model of ``metrics.kcost`` chooses from
three of those engines (0, the smallest and the largest k; the choice with ``measure="fit"``).
Prints ``{"table": [{"k", "batch_size", "tokens_per_s", "acceptance_length", ...predicted...}],
"choice": {"<batch_size>": k}, "choice_from", "model_choice", ...}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from draftadapt.config import ConfigError, load_config
from draftadapt.drafts.formats import DraftFormatError
from draftadapt.metrics.acceptance import AcceptanceStats
from draftadapt.metrics.kcost import (
    acceptance_length_at,
    choose_k,
    fit_ks,
    fit_step_costs,
    predicted_tokens_per_s,
    step_cost,
    step_seconds,
)
from draftadapt.precision import engine_dtype, served_dtype
from draftadapt.pretrain import ToyWorld
from draftadapt.progress import progress
from draftadapt.train.methods import method_of_dir

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
    # The k table (set ks to get it instead of the one-k eval; k is then unused):
    ks: list[int] = field(default_factory=list)  # draft lengths to tabulate; must hold 0 (no speculation)
    batch_sizes: list[int] = field(default_factory=list)  # sequences per generate (the first batch_size prompts)
    measure: Literal["all", "fit"] = "all"  # engines to start: every k (checks the prediction) or only the fitted ones
    table_repeats: int = 5  # generations per (k, batch size), the fastest counts (3 left 5-10% noise at 32 sequences)
    # the engines' weights: "auto" is bf16 on a CPU with AMX-BF16 or avx512_bf16 for a target at least 512 wide,
    # else the target's own dtype (as the demo serves it); "bf16" / "fp32" force one
    precision: Literal["auto", "bf16", "fp32"] = "auto"

    def validate(self) -> None:
        if not self.target or not self.draft:
            raise ConfigError("eval needs target and draft: pass --target DIR --draft DIR")
        if self.batch_sizes and not self.ks:
            raise ConfigError("eval: --batch-sizes is for the k table; pass --ks too (e.g. --ks 0,1,2,3)")
        if self.ks:
            if 0 not in self.ks or max(self.ks) < 1 or min(self.ks) < 0:
                raise ConfigError(f"eval: ks {self.ks} must hold 0 (the plain step anchors the cost model and "
                                  "is what speculation has to beat) and at least one k >= 1, none negative")
            if not self.batch_sizes or min(self.batch_sizes) < 1:
                raise ConfigError(f"eval: the k table needs batch sizes >= 1 (got {self.batch_sizes}); "
                                  "pass --batch-sizes 8,32,128")
            if self.table_repeats < 1:
                raise ConfigError(f"eval: table_repeats must be >= 1 (got {self.table_repeats}); pass --repeats 3")
        if self.k < 1 or self.temperature < 0 or self.num_prompts < 1 or self.max_tokens < 1:
            raise ConfigError(f"eval: k >= 1, temperature >= 0, num_prompts >= 1 and max_tokens >= 1 "
                              f"(got {self.k}, {self.temperature}, {self.num_prompts}, {self.max_tokens})")


def eval_prompts(target: str | Path, num: int, seed: int, toy: ToyWorld | None = None) -> list[str]:
    """The first ``num`` prompts of the target's ``heldout.jsonl`` (one JSON object a line, with a
    ``prompt``), or without one ``num`` prompts of the ``toy`` world drawn with another seed."""
    held = Path(target) / "heldout.jsonl"
    if held.is_file():
        with open(held) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if len(rows) < num:
            print(f"note: {held} has only {len(rows)} prompts; evaluating on those", file=sys.stderr)
        return [r["prompt"] for r in rows[:num]]
    if toy is None:
        raise FileNotFoundError(f"{held} does not exist; pass the prompts, or the toy world to draw them from "
                                "(`draftadapt eval` does)")
    print(f"note: {target} has no heldout.jsonl; evaluating on toy prompts (seed {seed})", file=sys.stderr)
    return toy.prompts(num, seed + 7_777_777)


def _run_engine(target: Path, draft: Path | None, method: str | None, k: int, batches: list[list[str]],
                temperature: float, max_tokens: int, seed: int, repeats: int, threads: int | None,
                dtype: str | None = None):
    """Start an engine, warm it up, generate each batch of prompts ``repeats`` times (rounds over
    the batches, so a slow spell of a busy machine does not land on one batch size); returns the
    runs per batch. The fastest run counts for speed."""
    from draftadapt.engine.rollout import RolloutEngine

    engine = RolloutEngine(target, draft, method=method, num_speculative_tokens=k, max_model_len=256,
                           max_num_seqs=max(max(len(p) for p in batches), 1), kv_cache_gib=1, seed=seed,
                           threads=threads, dtype=dtype)
    runs: list[list] = [[] for _ in batches]
    try:
        first = batches[0]
        engine.generate(first[: min(8, len(first))], temperature=temperature, max_tokens=8, seed=seed)
        for _ in range(max(1, repeats)):
            for i, prompts in enumerate(batches):
                runs[i].append(engine.generate(prompts, temperature=temperature, max_tokens=max_tokens, seed=seed))
    finally:
        engine.close()
        gc.collect()
    return runs


def simulate_on_rollouts(target: Path, draft: Path, method: str, rollouts, k: int, temperature: float,
                         batch_size: int = 32, threads: int | None = None):
    """Simulated acceptance of ``draft`` on the target's samples ``rollouts`` (visited, all starts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftadapt.capture.hidden import iter_captured
    from draftadapt.data.sequences import as_sequences, collate
    from draftadapt.train.methods import method_for
    from draftadapt.train.trainer import score_draft

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(target))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    target_model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    m = method_for(method)
    model = m.load(draft, target).eval()
    capture = m.target_capture(target_model, model, max(temperature, GREEDY_EPS))
    seqs = as_sequences(rollouts)
    batches = (collate(seqs[i : i + batch_size], pad_id) for i in range(0, len(seqs), batch_size))
    return score_draft(model, iter_captured(capture, batches), k)


def _sum_stats(stats: list[AcceptanceStats]) -> AcceptanceStats:
    total = AcceptanceStats()
    for s in stats:
        total = total + s
    return total


def evaluate(cfg: EvaluateConfig, repeats: int = 1, threads: int | None = None,
             prompts: list[str] | None = None, toy: ToyWorld | None = None) -> dict[str, Any]:
    target, draft = Path(cfg.target), Path(cfg.draft)
    k, temperature, num_prompts, max_tokens, seed = cfg.k, cfg.temperature, cfg.num_prompts, cfg.max_tokens, cfg.seed
    method = method_of_dir(draft).name
    prompts = prompts if prompts is not None else eval_prompts(target, num_prompts, seed, toy)
    dtype = engine_dtype(cfg.precision, target)
    spec_runs = _run_engine(target, draft, method, k, [prompts], temperature, max_tokens, seed, repeats, threads,
                            dtype)[0]
    plain_runs = _run_engine(target, None, None, k, [prompts], temperature, max_tokens, seed, repeats, threads,
                             dtype)[0]
    acceptance = _sum_stats([r.acceptance for r in spec_runs])
    tps_spec = max(r.tokens_per_s for r in spec_runs)
    tps_plain = max(r.tokens_per_s for r in plain_runs)
    t0 = time.perf_counter()
    # one torch thread: the capture is small, and two spinning OpenMP threads on a busy 2-core box
    # were several times slower than one
    visited, uniform = simulate_on_rollouts(target, draft, method, spec_runs[0].rollouts, k, temperature,
                                            threads=threads or 1)
    sim_seconds = time.perf_counter() - t0
    measured = acceptance.length
    speedup = tps_spec / tps_plain
    n = len(prompts)
    return {
        "method": method,
        "k": k,
        "temperature": temperature,
        "engine_dtype": served_dtype(cfg.precision, target),
        "num_prompts": n,
        "acceptance_length_measured": round(measured, 4),
        "acceptance_length_simulated": round(visited.length, 4),
        "acceptance_length_simulated_all_starts": round(uniform.length, 4),
        "simulated_vs_measured": round(visited.length / measured - 1.0, 4),
        "per_position_acceptance": [round(x, 4) for x in acceptance.per_position],
        "per_position_acceptance_simulated": [round(x, 4) for x in visited.per_position],
        "drafts": acceptance.drafts,
        "tokens_per_s_spec": round(tps_spec, 1),
        "tokens_per_s_plain": round(tps_plain, 1),
        "speedup": round(speedup, 4),
        # With n sequences decoding in lockstep a step emits n tokens (plain) or n * L (speculating):
        # the cost of one speculative step relative to a plain one is L / speedup.
        "ms_per_step_plain_est": round(1e3 * n / tps_plain, 2),
        "ms_per_step_spec_est": round(1e3 * n * measured / tps_spec, 2),
        "spec_step_cost_ratio": round(measured / speedup, 4),
        "tokens_generated": spec_runs[0].num_tokens,
        "seconds_spec": round(min(r.seconds for r in spec_runs), 3),
        "seconds_plain": round(min(r.seconds for r in plain_runs), 3),
        "seconds_simulation": round(sim_seconds, 2),
    }


def k_table(cfg: EvaluateConfig, threads: int | None = None, toy: ToyWorld | None = None) -> dict[str, Any]:
    """tokens/s and acceptance length for each k in ``cfg.ks`` at each batch size, measured, and
    the same predicted by the step-cost model fitted on three of the engines (``fit_ks``). The
    choice per batch size is the measured best where every k was measured (``measure="all"``),
    else the argmax of the prediction (``metrics.kcost``, docs/design.md "Choosing k"); the
    model's argmax is reported beside it either way. Batch size b generates one response for each of the first b prompts (the
    held-out prompts, reused in order if there are fewer than b)."""
    target, draft = Path(cfg.target), Path(cfg.draft)
    method = method_of_dir(draft).name
    ks, bss = sorted(set(cfg.ks)), sorted(set(cfg.batch_sizes))
    pool = eval_prompts(target, max(bss), cfg.seed, toy)
    prompts = [pool[i % len(pool)] for i in range(max(bss))]
    fitted = fit_ks(ks)
    run_ks = ks if cfg.measure == "all" else fitted
    cells: dict[tuple[int, int], tuple[float, AcceptanceStats]] = {}
    t0 = time.perf_counter()
    bar = progress(total=len(run_ks), desc="k table (one engine per k)", unit="engine")
    dtype = engine_dtype(cfg.precision, target)
    for k in run_ks:
        runs = _run_engine(target, draft if k else None, method if k else None, max(k, 1), [prompts[:b] for b in bss],
                           cfg.temperature, cfg.max_tokens, cfg.seed, cfg.table_repeats, threads, dtype)
        for b, rs in zip(bss, runs):
            cells[(k, b)] = (max(r.tokens_per_s for r in rs), _sum_stats([r.acceptance for r in rs]))
        bar.update(1)
    bar.close()

    def measured_length(k: int, b: int) -> float:
        return cells[(k, b)][1].length if k else 1.0

    # acceptance for every k from the longest draft's per-position rates, pooled over batch sizes
    k_max = max(ks)
    rates = _sum_stats([cells[(k_max, b)][1] for b in bss]).per_position
    model = fit_step_costs([(k, b, step_seconds(b, cells[(k, b)][0], measured_length(k, b)))
                            for k in fitted for b in bss])
    predicted = {(k, b): predicted_tokens_per_s(model, k, b, acceptance_length_at(rates, k)) for k in ks for b in bss}
    rows = []
    for k in ks:
        for b in bss:
            row = {"k": k, "batch_size": b, "tokens_per_s": None, "acceptance_length": None,
                   "tokens_per_s_predicted": round(predicted[(k, b)], 1),
                   "acceptance_length_predicted": round(acceptance_length_at(rates, k), 4),
                   "step_ms": None, "step_ms_predicted": round(1e3 * step_cost(model, k, b), 3),
                   "fitted": k in fitted}
            if (k, b) in cells:
                tps = cells[(k, b)][0]
                row.update(tokens_per_s=round(tps, 1), acceptance_length=round(measured_length(k, b), 4),
                           step_ms=round(1e3 * step_seconds(b, tps, measured_length(k, b)), 3))
            rows.append(row)
    model_choice = choose_k(predicted)
    # Where every k was measured, the choice is the measured best; the model's argmax is printed
    # beside it (what `--measure fit`, which measures three engines only, would have chosen).
    measured = {kb: v[0] for kb, v in cells.items()}
    choice = choose_k(measured) if cfg.measure == "all" else model_choice
    result: dict[str, Any] = {
        "table": rows,
        "choice": {str(b): k for b, k in choice.items()},
        "choice_from": "measured" if cfg.measure == "all" else "model",
        "model_choice": {str(b): k for b, k in model_choice.items()},
        "method": method, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens,
        "fit_ks": fitted, "per_position_acceptance": [round(x, 4) for x in rates],
        "cost_model": model.to_dict(),
    }
    if cfg.measure == "all":
        result["best_measured"] = result["choice"]
        # what the model's choice would leave on the table: its measured tokens/s over the best k's
        result["model_vs_best"] = {str(b): round(measured[(model_choice[b], b)] / measured[(choice[b], b)], 4)
                                   for b in bss}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def k_table_lines(result: dict[str, Any]) -> list[str]:
    """The k table for a person: one line per k, measured / predicted tokens/s per batch size."""
    bss = sorted({r["batch_size"] for r in result["table"]})
    head = "k  accept(meas/pred)  " + "  ".join(f"b={b}: tok/s meas / pred" for b in bss)
    lines = [head]
    for k in sorted({r["k"] for r in result["table"]}):
        cells = {r["batch_size"]: r for r in result["table"] if r["k"] == k}
        acc = cells[bss[0]]
        meas_acc = [cells[b]["acceptance_length"] for b in bss if cells[b]["acceptance_length"] is not None]
        acc_meas = f"{sum(meas_acc) / len(meas_acc):.3f}" if meas_acc else "-"
        acc_txt = f"{acc_meas} / {acc['acceptance_length_predicted']:.3f}"
        parts = []
        for b in bss:
            c = cells[b]
            mark = "*" if result["choice"].get(str(b)) == k else "+" if result["model_choice"].get(str(b)) == k else " "
            meas = f"{c['tokens_per_s']:.0f}" if c["tokens_per_s"] is not None else "-"
            parts.append(f"{mark}{meas:>6} / {c['tokens_per_s_predicted']:.0f}".ljust(len(f"b={b}: tok/s meas / pred")))
        lines.append(f"{k}  {acc_txt:<17}  " + "  ".join(parts) + ("  (fitted)" if acc["fitted"] else ""))
    lines.append(f"chosen k (*, {'the measured best' if result['choice_from'] == 'measured' else 'from the model'}): "
                 + ", ".join(f"b={b}: {k}" for b, k in result["choice"].items()))
    if "model_vs_best" in result:
        lines.append("the model's k (+): " + ", ".join(
            f"b={b}: {k} ({result['model_vs_best'][b]:.3f}x the best k's tokens/s)"
            for b, k in result["model_choice"].items()))
    return lines


def eval_cli(overrides: list[str], json_only: bool, toy: ToyWorld | None = None) -> int:
    """``draftadapt eval``: ``overrides`` are EvaluateConfig's ``key=value`` (from the flags);
    ``toy``: the toy world, for a target without ``heldout.jsonl``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = load_config(EvaluateConfig, None, overrides)
    try:
        result = k_table(cfg, toy=toy) if cfg.ks else evaluate(cfg, toy=toy)
    except (DraftFormatError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.ks:
        if not json_only:
            print("\n".join(k_table_lines(result)), file=sys.stderr)
    elif not json_only:
        print(f"acceptance length: measured {result['acceptance_length_measured']:.3f}, simulated "
              f"{result['acceptance_length_simulated']:.3f} (k={cfg.k}, T={cfg.temperature}); speedup "
              f"{result['speedup']:.2f}x ({result['tokens_per_s_plain']:.0f} -> {result['tokens_per_s_spec']:.0f} "
              "tokens/s)", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0
