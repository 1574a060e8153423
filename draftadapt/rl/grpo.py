"""The GRPO policy update of the demo's RL run (what an RL framework does anyway): group-normalised
advantages, REINFORCE on the sampled tokens, a KL penalty to the initial policy; its forward feeds
draftadapt's hand-over, so the adapter runs no forward of its own."""

from __future__ import annotations

import contextlib

import torch

from draftadapt.data.sequences import as_sequences, collate
from draftadapt.rl.config import GRPOConfig
from draftadapt.train.trainer import auto_precision


def policy_precision(policy, cfg: GRPOConfig) -> str:
    """grpo.precision with "auto" resolved for this policy on its device."""
    return cfg.precision if cfg.precision != "auto" else auto_precision(next(policy.parameters()).device, policy)


def token_logprobs(model, batch: dict, handover=None, index=None, temperature: float = 1.0) -> torch.Tensor:
    """log p_model(token u+1 | tokens <= u) for every slot: [B, T-1], of the distribution sampled
    at ``temperature`` (softmax(logits / T), as the engine samples; TRL's GRPO divides so too).
    With a draftadapt ``handover`` the forward's aux states and raw logits are also handed to the
    adapter (rows ``index`` of the step's rollouts; it applies its own temperature): the adapter
    then runs no forward of its own."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if handover is not None:
        handover.add(index, logits, batch["attention_mask"])
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)[:, :-1]
    return logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def sampler_logprobs(rollouts, shape) -> torch.Tensor:
    """The engine's log-prob of each response token, in ``token_logprobs``' slots ([B, T-1]: the
    slot before the token; 0 elsewhere)."""
    out = torch.zeros(shape)
    for b, rollout in enumerate(rollouts):
        start = len(rollout.prompt_token_ids) - 1
        out[b, start: start + len(rollout.logprobs)] = torch.tensor(rollout.logprobs)
    return out


def kl_to_reference(lp: torch.Tensor, ref_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens of the k3 estimator of KL(policy || reference), from the sampled
    tokens' log-probabilities under each; differentiable in ``lp``."""
    d = ref_lp - lp  # log(ref / policy) per token
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()


def grpo_update(policy, reference, opt, problems, rollouts, cfg: GRPOConfig, pad_id: int, step: int, score,
                handover=None, threads=None) -> dict:
    """One on-policy GRPO step: group-normalised advantages, REINFORCE on the sampled tokens
    (length-normalised per sequence), plus a per-token KL penalty to the initial policy.
    ``score(problem, text)``: the world's (reward, correct, styled) of one response.
    ``handover``: draftadapt's HandOver, fed from this update's own forward (no second pass).
    ``threads``: called before each micro-batch for the torch threads to run it with (the
    asynchronous loop takes the generation's core once it is done)."""
    scored = [score(prob, rollout.text) for prob, rollout in zip(problems, rollouts)]
    rewards = [rew for rew, _, _ in scored]
    R = torch.tensor(rewards).view(-1, cfg.group_size)  # [P, G]
    adv = ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-4)).view(-1)
    seqs = as_sequences(rollouts)
    n = len(seqs)
    n_tokens = sum(len(s.ids) - len(s.prompt_ids) for s in seqs)  # response tokens, for the KL mean
    policy.train()
    for g in opt.param_groups:
        g["lr"] = cfg.lr_at(step)
    opt.zero_grad(set_to_none=True)
    # Length-sorted micro-batches: the same loss and gradient as one padded batch (each term is a
    # sum over sequences scaled by the whole batch's counts), without padding every sequence to
    # the longest response of the step (verbose answers are ~2x the terse ones).
    order = sorted(range(n), key=lambda i: len(seqs[i].ids))
    pg_sum = kl_sum = 0.0
    # the sampler's log-probs come with off-policy rollouts only (the asynchronous loop asks for them)
    off_policy = cfg.off_policy_clip > 0 and all(getattr(rollout, "logprobs", None) is not None for rollout in rollouts)
    autocast = (torch.autocast(next(policy.parameters()).device.type, dtype=torch.bfloat16)
                if policy_precision(policy, cfg) == "bf16" else contextlib.nullcontext())
    for lo in range(0, n, cfg.micro_batch):
        if threads is not None:
            torch.set_num_threads(threads())
        idx = order[lo: lo + cfg.micro_batch]
        batch = collate([seqs[i] for i in idx], pad_id)
        mask = batch["loss_mask"][:, :-1].float()  # slots whose next token is a response token
        with autocast:
            lp = token_logprobs(policy, batch, handover, idx, cfg.temperature)
        weight = mask
        if off_policy:
            weight = mask * torch.exp(lp.detach() - sampler_logprobs([rollouts[i] for i in idx], lp.shape)).clamp(
                max=cfg.off_policy_clip)
        pg = -(adv[idx] * (weight * lp).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n
        loss = pg
        if cfg.kl_coef and mask.sum() > 0:
            with torch.no_grad(), autocast:
                ref_lp = token_logprobs(reference, batch, temperature=cfg.temperature)
            kl = kl_to_reference(lp, ref_lp, mask) * mask.sum() / max(n_tokens, 1)
            loss = loss + cfg.kl_coef * kl
            kl_sum += float(kl.detach())
        loss.backward()
        pg_sum += float(pg.detach())
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    policy.eval()
    correct = [c for _, c, _ in scored]
    styled = [s for _, _, s in scored]
    return {"rl/reward": float(R.mean()), "rl/accuracy": sum(correct) / len(correct),
            "rl/style_frac": sum(styled) / len(styled), "rl/loss": pg_sum + cfg.kl_coef * kl_sum, "rl/kl": kl_sum,
            # the mean reply length: two runs' step times differ as much by their trajectories
            # (how long the policy's replies became) as by their generation speed
            "rl/reply_tokens": n_tokens / max(n, 1)}
