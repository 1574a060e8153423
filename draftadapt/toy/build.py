"""Build the toy target: train a tiny model from scratch on the toy task and save it.

    draftadapt toy build --out /tmp/toy_llama [--arch llama|qwen3|qwen2] [--seed 0] [--steps N] [--mtp N [--mtp-weight W]]

trains for a few minutes on 2 CPU cores, evaluates accuracy at temperature 1 on the
held-out prompts, writes an HF model directory (model, tokenizer, generation_config,
heldout.jsonl, toy.json) and prints as its last line one JSON object such as
``{"accuracy": 0.41, "params": 5147904, "seconds": 170.2, "arch": "llama", "out": ...}``.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from draftadapt.progress import progress
from draftadapt.toy import task
from draftadapt.toy.model import ToyModelConfig, build_model
from draftadapt.toy.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

HELDOUT_SEED_OFFSET = 1_000_003  # held-out problems come from a stream training never draws


@dataclass
class ToyTrainConfig:
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    # A fixed schedule, so one seed always gives the same target (the demo's numbers used to move
    # with how far a time-budgeted build got: 297-308 of 330 steps on this VM). ~0.8 s a step on
    # 2 cores: ~4 min.
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bucket: int = 8  # draw bucket * batch_size problems, sort by length: little padding
    # > 0: stop training after this many seconds (a guard for very slow machines; the model then
    # depends on the machine's speed). 0 = always run ``steps``.
    max_train_seconds: float = 0.0
    slip: float = 0.12  # share of worked steps written wrong in the training data (see task.make_problem)
    # Share of training responses in the "verbose" style (the demo's RL reward prefers it). Half:
    # the target learns to write both styles equally well. (0.08 left it sloppy at verbose: the
    # policy lost accuracy while RL moved it there, 0.45 -> 0.33.)
    verbose_share: float = 0.5
    # Then a short "SFT" stage on terse responses only, at the final learning rate, until the
    # policy picks the verbose style with probability <= settle_verbose_prob (measured exactly at
    # the token that decides it, on held-out prompts). The policy can still write verbose answers
    # (as accurately) but seldom does, so a draft pretrained on its samples has seen few of them;
    # RL that rewards verbose moves the policy onto text its draft barely knows. Measured: an
    # Eagle-3 head pretrained with 0% verbose fell from 3.58 to 2.30 on verbose text, one with 15%
    # only to 3.45. 0 skips the stage.
    settle_verbose_prob: float = 0.04
    settle_max_steps: int = 80
    settle_check_every: int = 2
    heldout: int = 256
    max_new_tokens: int = 96  # the longest response is about 75 characters
    eval_every: int = 0  # > 0: print held-out accuracy every this many steps (tuning)
    threads: int = 0  # 0 = auto: 2, or 1 when other processes already keep a core busy
    # ``--mtp N`` only: the weight of the MTP layer's loss beside the LM's (DeepSeek-V3's lambda;
    # toy/mtp.py, docs/design.md "MTP").
    mtp_weight: float = 1.0


def verbose_probability(model: PreTrainedModel, tok: PreTrainedTokenizerFast, problems: list[dict]) -> float:
    """Mean probability that the policy answers in the verbose style: the token after the first
    countdown label (``"4:"``) is a space (verbose) or a digit (terse)."""
    space = tok(" ", add_special_tokens=False).input_ids[0]  # by encoding: the vocabulary writes it "Ġ"
    prompts = [p["prompt"] + f"{task.parse_prompt(p['prompt'])[2]}:" for p in problems]
    enc = tok(prompts, return_tensors="pt", padding=True)
    pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=pos).logits
    model.train(was_training)
    return float(torch.softmax(logits[:, -1].float(), dim=-1)[:, space].mean())


def encode_example(tok: PreTrainedTokenizerFast, problem: dict) -> tuple[list[int], int]:
    """Token ids of ``<s> prompt response </s>`` and the length of the ``<s> prompt`` part."""
    prompt_ids = tok(problem["prompt"]).input_ids
    response_ids = tok(problem["response"], add_special_tokens=False).input_ids
    return prompt_ids + response_ids + [EOS_ID], len(prompt_ids)


def make_batch(examples: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels are -100 except on response tokens and the final ``</s>``."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    mask = torch.zeros_like(input_ids)
    for i, (ids, n_prompt) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = input_ids[i, n_prompt : len(ids)]
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def batches(tok: PreTrainedTokenizerFast, rng: random.Random, cfg: ToyTrainConfig):
    """Endless training batches of fresh problems, grouped by length to save padding."""
    while True:
        pool = [encode_example(tok, task.make_problem(rng, style=_draw_style(rng, cfg), slip=cfg.slip))
                for _ in range(cfg.bucket * cfg.batch_size)]
        pool.sort(key=lambda e: len(e[0]))
        chunks = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        rng.shuffle(chunks)
        yield from (make_batch(c) for c in chunks)


def _draw_style(rng: random.Random, cfg: ToyTrainConfig) -> str:
    return "verbose" if rng.random() < cfg.verbose_share else "terse"


def lr_at(step: int, cfg: ToyTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    prompts: list[str],
    temperature: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
    batch_size: int = 128,
) -> list[str]:
    """Completions (text after the prompt, without ``</s>``) sampled from the full
    distribution at ``temperature`` (0 = greedy); plain ancestral sampling, no top-k/p."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tok(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        ids, mask = enc.input_ids, enc.attention_mask  # left-padded: [B, T]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        past, new = None, []
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        step_ids, step_pos = ids, pos
        for _ in range(max_new_tokens):
            o = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                      past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1, :].float()  # [B, V]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
            new.append(nxt)
            done |= nxt == EOS_ID
            if done.all():
                break
            step_ids = nxt[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=-1)
        gen_ids = torch.stack(new, dim=1).tolist()
        for row in gen_ids:
            if EOS_ID in row:
                row = row[: row.index(EOS_ID)]
            out.append(tok.decode(row, skip_special_tokens=True))
    return out


def evaluate(model, tok, problems: list[dict], temperature: float, max_new_tokens: int, seed: int) -> dict:
    """Accuracy (reward mean) and how often each style was chosen."""
    completions = sample(model, tok, [p["prompt"] for p in problems], temperature, max_new_tokens, seed)
    rewards = [task.reward(p, c) for p, c in zip(problems, completions)]
    verbose = sum(task.style_of(c) == "verbose" for c in completions)
    return {
        "accuracy": sum(rewards) / len(rewards),
        "verbose_frac": verbose / len(completions),
        "mean_chars": sum(len(c) for c in completions) / len(completions),
        "examples": [p["prompt"] + c for p, c in zip(problems[:3], completions[:3])],
    }


def train(model: PreTrainedModel, tok: PreTrainedTokenizerFast, cfg: ToyTrainConfig, seed: int,
          heldout: list[dict] | None = None) -> dict:
    """AdamW on response tokens of fresh problems; returns a short training summary."""
    rng = random.Random(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8,
    )
    model.train()
    t0, loss_ema, step = time.time(), None, 0
    bar = progress(total=cfg.steps, desc="toy train", unit="step")
    for step, batch in zip(range(cfg.steps), batches(tok, rng, cfg)):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        bar.update()
        if cfg.eval_every and heldout and (step + 1) % cfg.eval_every == 0:
            ev = evaluate(model, tok, heldout[:128], 1.0, cfg.max_new_tokens, seed)
            greedy = evaluate(model, tok, heldout[:128], 0.0, cfg.max_new_tokens, seed)
            tqdm.write(f"step {step + 1} t={time.time() - t0:.0f}s loss={loss_ema:.3f} "
                       f"acc@1={ev['accuracy']:.3f} acc@0={greedy['accuracy']:.3f} "
                       f"verbose={ev['verbose_frac']:.2f} {ev['examples'][0]!r}", file=sys.stderr)
            model.train()
        if cfg.max_train_seconds and time.time() - t0 > cfg.max_train_seconds:
            tqdm.write(f"toy train: stopping at step {step + 1}/{cfg.steps}: "
                       f"over the {cfg.max_train_seconds:.0f} s budget (busy machine?)", file=sys.stderr)
            break
    bar.close()
    model.eval()
    return {"steps": step + 1, "final_loss": loss_ema, "train_seconds": time.time() - t0}


def settle_style(model: PreTrainedModel, tok: PreTrainedTokenizerFast, cfg: ToyTrainConfig, seed: int,
                 heldout: list[dict]) -> dict:
    """The SFT stage (see ``ToyTrainConfig.settle_verbose_prob``): terse-only batches at the final
    learning rate until the verbose style's probability is at most the target."""
    before = verbose_probability(model, tok, heldout)
    if cfg.settle_verbose_prob <= 0:
        return {"settle_steps": 0, "verbose_prob": round(before, 4)}
    rng = random.Random(seed + 1)
    lr = cfg.lr * cfg.min_lr_ratio
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    model.train()
    prob, step = before, 0
    terse = replace(cfg, verbose_share=0.0)
    for step, batch in zip(range(cfg.settle_max_steps), batches(tok, rng, terse)):
        if step % cfg.settle_check_every == 0:
            prob = verbose_probability(model, tok, heldout)
            if prob <= cfg.settle_verbose_prob:
                break
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        prob = verbose_probability(model, tok, heldout)
    model.eval()
    tqdm.write(f"toy settle: verbose style {before:.3f} -> {prob:.3f} in {step} terse steps", file=sys.stderr)
    return {"settle_steps": step, "verbose_prob": round(prob, 4)}


def save(out: Path, model: PreTrainedModel, tok: PreTrainedTokenizerFast, heldout: list[dict],
         meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Only token ids: sampling fields here would become vLLM's default sampling params.
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    task.write_heldout(out / "heldout.jsonl", heldout)
    (out / "toy.json").write_text(json.dumps(meta, indent=2) + "\n")


def pick_threads(requested: int) -> int:
    """Torch threads for training: ``requested``, or (0 = auto) every core up to 4 (a
    5M-parameter model gains nothing from more). Not guessed from the load average: right
    after another job (pip, a previous run) the 1-minute average stays high for a while and
    a build that took one thread on an idle 2-core machine ran 1.7x slower (1.25 s a step
    instead of 0.74 s). On a machine shared with other trainers pass ``threads=1``: two
    OpenMP threads spinning on a busy core ran 5-6x slower than one here."""
    if requested > 0:
        return requested
    return min(4, os.cpu_count() or 1)


def build(out: str, arch: str = "llama", seed: int = 0, steps: int | None = None,
          cfg: ToyTrainConfig | None = None, mtp: int = 0) -> dict:
    """Train, evaluate and save a toy target in ``out``; returns the summary printed last.
    ``mtp`` > 0: a Qwen2 body with that many MTP layers, trained jointly (toy/mtp.py)."""
    if mtp and arch != "qwen2":
        raise ValueError(f"--mtp {mtp} with --arch {arch}: vLLM serves MTP layers on its MiMo path, a "
                         "Qwen2 body; use --arch qwen2 (the default with --mtp)")
    t0 = time.time()
    cfg = cfg or ToyTrainConfig()
    cfg.model.arch = arch
    if steps is not None:
        cfg.steps = steps
    threads = pick_threads(cfg.threads)
    torch.set_num_threads(threads)
    tok = build_tokenizer()
    model = build_model(cfg.model, seed=seed)
    params = sum(p.numel() for p in model.parameters())
    if mtp:
        from draftadapt.toy.mtp import JointMTP

        model = JointMTP(model, mtp, seed, weight=cfg.mtp_weight)
    heldout = task.sample_problems(cfg.heldout, seed + HELDOUT_SEED_OFFSET)
    summary = train(model, tok, cfg, seed, heldout)
    summary.update(settle_style(model, tok, cfg, seed, heldout))
    ev = evaluate(model, tok, heldout, 1.0, cfg.max_new_tokens, seed)
    result = {
        "accuracy": round(ev["accuracy"], 4),
        "params": params,
        "seconds": 0.0,
        "arch": arch,
        "seed": seed,
        "steps": summary["steps"],
        "final_loss": round(summary["final_loss"], 4),
        "verbose_frac": round(ev["verbose_frac"], 4),
        "verbose_prob": summary["verbose_prob"],
        "settle_steps": summary["settle_steps"],
        "mean_response_chars": round(ev["mean_chars"], 1),
        "out": str(Path(out).resolve()),
    }
    if mtp:
        result["mtp_layers"] = mtp
    meta = {
        "task": "repeated +1/-1 from a start in 0-99, worked step by step with countdown labels, "
                "final answer after '#'",
        "styles": list(task.STYLES),
        "reward": "draftadapt.toy.task.reward: 1.0 iff the completion ends in '#<correct answer>'",
        "heldout_seed": seed + HELDOUT_SEED_OFFSET,
        "train": {k: v for k, v in asdict(cfg).items() if k != "model"},
        "model": asdict(cfg.model),
        "eval_temperature": 1.0,
        **{k: result[k] for k in ("accuracy", "params", "arch", "seed", "steps", "final_loss",
                                  "verbose_frac", "verbose_prob", "settle_steps", "mean_response_chars")},
    }
    if mtp:
        from draftadapt.toy.mtp import save_mtp

        meta["mtp_layers"] = mtp
        save(Path(out), model.lm, tok, heldout, meta)
        save_mtp(Path(out), model.head)
    else:
        save(Path(out), model, tok, heldout, meta)
    result["seconds"] = round(time.time() - t0, 1)
    return result


def build_cli(out: str, arch: str | None = None, seed: int = 0, steps: int | None = None, mtp: int = 0,
              mtp_weight: float | None = None) -> int:
    cfg = ToyTrainConfig() if mtp_weight is None else ToyTrainConfig(mtp_weight=mtp_weight)
    result = build(out, arch=arch or ("qwen2" if mtp else "llama"), seed=seed, steps=steps, cfg=cfg, mtp=mtp)
    print(json.dumps(result), flush=True)
    return 0
