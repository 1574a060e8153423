"""Build the real-model world's target: SmolLM2-135M-Instruct converted from the registry
package's GGUF (smollm2/convert.py), the task's files beside it, checked in vLLM.

    draftadapt smollm2 build --out runs/smollm2/model

The model directory gains ``heldout.jsonl`` (the problems every measurement arm generates on;
pretrain's held-out prompts too), ``prompts.jsonl`` (the problems a draft is pretrained on:
``data.source`` of recipes/pretrain_eagle3_smollm2.yaml) and ``worked.jsonl`` (those problems
with worked answers, which a draft can be distilled on without decoding: ``data.prefill``).
``smollm2.json``, written last, marks a complete build: a directory without it is rebuilt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from draftadapt.smollm2 import task
from draftadapt.smollm2.convert import DONE, ModelSourceError, convert, finish

HELDOUT = "heldout.jsonl"
PROMPTS = "prompts.jsonl"
WORKED = "worked.jsonl"  # prompts.jsonl's problems with worked answers: pretrain's data.prefill
HELDOUT_SEED, PROMPTS_SEED = 1_000_003, 2_000_003  # fixed draws: the same files on every machine
NUM_HELDOUT, NUM_PROMPTS = 256, 4096
CHECK_PROMPTS, CHECK_TOKENS = 4, 24  # greedy agreement between transformers and vLLM at build time


def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def write_task_files(model_dir: Path) -> None:
    """heldout.jsonl and prompts.jsonl (RL never draws a held-out question; nor does pretraining)."""
    tok = tokenizer(model_dir)
    held = task.sample_problems(NUM_HELDOUT, HELDOUT_SEED, tok)
    seen = {p["question"] for p in held}
    pool = [p for p in task.sample_problems(NUM_PROMPTS + NUM_HELDOUT, PROMPTS_SEED, tok) if p["question"] not in seen]
    task.write_problems(model_dir / HELDOUT, held)
    task.write_problems(model_dir / PROMPTS, pool[:NUM_PROMPTS])
    write_worked(model_dir)


def write_worked(model_dir: Path) -> None:
    """worked.jsonl: every problem of prompts.jsonl with a worked answer (task.worked_answer),
    from the pool's draw (which records each problem's steps; a build from before it did lacks
    them in prompts.jsonl, so the draw is the one source for both)."""
    drawn = {p["question"]: p for p in task.sample_problems(NUM_PROMPTS + NUM_HELDOUT, PROMPTS_SEED,
                                                            tokenizer(model_dir))}
    problems = [drawn[p["question"]] for p in task.load_problems(model_dir / PROMPTS)]
    task.write_problems(model_dir / WORKED, task.worked_examples(problems, PROMPTS_SEED))


def _task_is_current(model_dir: Path) -> bool:
    """Whether the directory's task files carry the task's current instruction (the questions
    never change; the instruction did when the world's task did)."""
    held = task.load_problems(model_dir / HELDOUT) if (model_dir / HELDOUT).is_file() else []
    return bool(held) and task.INSTRUCTION in held[0].get("prompt", "")


def check_greedy(model_dir: Path, prompts: list[str], max_tokens: int = CHECK_TOKENS) -> dict:
    """vLLM loads the directory and its greedy tokens equal transformers' on ``prompts``; raises
    ModelSourceError naming the first prompt that differs."""
    import torch
    from transformers import AutoModelForCausalLM

    from draftadapt.engine.rollout import RolloutEngine

    tok = tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            hf.append(out[0, ids.shape[1]:].tolist())
    del model
    t0 = time.perf_counter()
    engine = RolloutEngine(model_dir, None, dtype="float32", threads=2)
    try:
        start_s = time.perf_counter() - t0
        got = engine.generate([tok(p, add_special_tokens=False).input_ids for p in prompts], temperature=0.0,
                              max_tokens=max_tokens)
    finally:
        engine.close()
    for p, a, b in zip(prompts, hf, (r.token_ids for r in got.rollouts)):
        # vLLM stops at the EOS token; transformers' generate pads after it
        a = a[: a.index(tok.eos_token_id) + 1] if tok.eos_token_id in a else a
        if list(a) != list(b):
            raise ModelSourceError(f"{model_dir}: vLLM's greedy tokens differ from transformers' on {p[-60:]!r}: "
                                   f"{tok.decode(b)!r} vs {tok.decode(a)!r}; rebuild it (`draftadapt smollm2 build`)")
    return {"greedy_agree_prompts": len(prompts), "vllm_start_s": round(start_s, 1),
            "sample": tok.decode(got.rollouts[0].token_ids)}


def build(out: str | Path, dtype: str = "float32") -> dict:
    """The model directory, complete: converted, the task's files written, checked in vLLM."""
    out = Path(out)
    if (out / DONE).is_file():
        if not _task_is_current(out):  # built for another instruction (an earlier task): text only, no model run
            print(f"[smollm2] rewriting {out}'s task files for the current instruction", flush=True)
            write_task_files(out)
        elif not (out / WORKED).is_file():  # built before worked answers were written
            write_worked(out)
        return json.loads((out / DONE).read_text())
    print(f"[smollm2] converting the packaged GGUF into {out} (about 2 minutes, once)", flush=True)
    info = convert(out, dtype=dtype)
    write_task_files(out)
    prompts = [p["prompt"] for p in task.load_problems(out / HELDOUT)[:CHECK_PROMPTS]]
    info.update(check_greedy(out, prompts))
    return finish(out, info)


def build_cli(out: str, dtype: str = "float32") -> int:
    info = build(out, dtype)
    print(json.dumps({k: v for k, v in info.items() if k != "source"}))
    return 0
