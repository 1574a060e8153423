"""The toy GRPO update of draftadapt/rl/loop.py (pure logic on a tiny model; the demo's e2e test runs
it against real engines). The KL term once had its sign flipped and pushed the policy away from
the reference (KL 0.01 -> 1.9 in six steps, accuracy -> 0): these tests pin its direction."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from draftadapt.data.sequences import as_sequences, collate
from draftadapt.rl import grpo
from draftadapt.toy import task
from draftadapt.toy.world import ToyRL
from draftadapt.rl.config import GRPOConfig
from draftadapt.toy.model import ToyModelConfig, build_model
from draftadapt.toy.tokenizer import build_tokenizer


def _rollouts(tok, n: int, seed: int):
    problems = task.sample_problems(n, seed)
    out = []
    for p in problems:
        ids = tok(p["prompt"]).input_ids
        resp = tok(p["response"], add_special_tokens=False).input_ids
        out.append(SimpleNamespace(prompt_token_ids=ids, token_ids=resp, text=p["response"]))
    return problems, out


def _score(cfg):
    return lambda problem, text: ToyRL().score(problem, text, cfg)


def _kl(policy, reference, batch, mask) -> float:
    with torch.no_grad():
        return float(grpo.kl_to_reference(grpo.token_logprobs(policy, batch),
                                          grpo.token_logprobs(reference, batch), mask))


@pytest.mark.parametrize("kl_coef", [0.0, 1.0])
def test_kl_term_pulls_toward_the_reference(kl_coef):
    torch.manual_seed(0)
    tok = build_tokenizer()
    small = ToyModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)
    reference = build_model(small, seed=0).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # a policy that has drifted from the reference
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    problems, rollouts = _rollouts(tok, 8, seed=3)
    # every sample of a group gets the same reward: zero advantages, only the KL term acts
    cfg = GRPOConfig(group_size=4, kl_coef=kl_coef, style_bonus=0.0, lr=1e-2, warmup_steps=0)
    same = [problems[0]] * len(rollouts)  # one problem for all: rewards equal within each group
    rollouts = [SimpleNamespace(**{**vars(r), "text": "garbage"}) for r in rollouts]
    batch = collate(as_sequences(rollouts), 0)
    mask = batch["loss_mask"][:, :-1].float()
    before = _kl(policy, reference, batch, mask)
    opt = torch.optim.SGD(policy.parameters(), lr=cfg.lr)
    for step in range(5):
        out = grpo.grpo_update(policy, reference, opt, same, rollouts, cfg, 0, step, _score(cfg))
    after = _kl(policy, reference, batch, mask)
    assert out["rl/reward"] == 0.0
    if kl_coef:
        # measured: the KL falls by far more than this; a flipped sign makes it grow
        assert after < 0.9 * before, (before, after)
    else:
        assert after == pytest.approx(before, rel=1e-6)  # nothing else moves the policy


def test_warmup_ramps_the_learning_rate():
    cfg = GRPOConfig(lr=8e-4, warmup_steps=3)
    assert [cfg.lr_at(s) for s in range(5)] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 8e-4])


def test_micro_batches_give_the_update_of_one_batch():
    """Length-sorted micro-batches (no padding to the step's longest response) must change the
    speed only: the same loss, KL and parameters after the step as one padded batch."""
    tok = build_tokenizer()
    small = ToyModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)
    reference = build_model(small, seed=0).eval()
    start = copy.deepcopy(reference)
    with torch.no_grad():
        for p in start.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    problems, rollouts = _rollouts(tok, 12, seed=5)  # mixed styles: lengths differ
    assert len({len(r.token_ids) for r in rollouts}) > 3
    # rewards differ within groups (some responses wrong), so the policy-gradient term acts too
    rollouts = [r if i % 3 else SimpleNamespace(**{**vars(r), "text": "wrong"}) for i, r in enumerate(rollouts)]
    results = {}
    for micro in (len(rollouts), 5):
        policy = copy.deepcopy(start)
        cfg = GRPOConfig(group_size=4, kl_coef=0.5, style_bonus=0.5, lr=1e-2, warmup_steps=0, micro_batch=micro)
        out = grpo.grpo_update(policy, reference, torch.optim.SGD(policy.parameters(), lr=cfg.lr),
                                 problems, rollouts, cfg, 0, 0, _score(cfg))
        results[micro] = (out, torch.cat([p.detach().flatten() for p in policy.parameters()]))
    (one, w_one), (many, w_many) = results[len(rollouts)], results[5]
    moved = (w_one - torch.cat([p.detach().flatten() for p in start.parameters()])).abs().max()
    assert moved > 1e-4  # the step did something
    assert many["rl/loss"] == pytest.approx(one["rl/loss"], abs=1e-6)
    assert many["rl/kl"] == pytest.approx(one["rl/kl"], rel=1e-5)
    # float32 sums in another order: differences far below a thousandth of the step itself
    assert (w_many - w_one).abs().max() < 1e-3 * moved


def test_the_update_in_bf16_autocast_moves_the_policy_as_float32_does():
    """grpo.precision=bf16: the forwards under bf16 autocast, the weights and the step in float32.
    The update's direction is float32's (cosine > 0.99) and its loss within bf16's rounding; the
    toy itself stays float32 at "auto" (128 wide), and a bad value is refused by name."""
    from draftadapt.config import ConfigError
    from draftadapt.rl.config import DemoConfig

    tok = build_tokenizer()
    small = ToyModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)
    reference = build_model(small, seed=0).eval()
    problems, rollouts = _rollouts(tok, 12, seed=5)
    rollouts = [r if i % 3 else SimpleNamespace(**{**vars(r), "text": "wrong"}) for i, r in enumerate(rollouts)]
    start = torch.cat([p.detach().flatten() for p in reference.parameters()])
    moves, losses = {}, {}
    for precision in ("fp32", "bf16"):
        policy = copy.deepcopy(reference)
        cfg = GRPOConfig(group_size=4, kl_coef=0.5, style_bonus=0.5, lr=1e-2, warmup_steps=0, precision=precision)
        assert grpo.policy_precision(policy, cfg) == precision
        out = grpo.grpo_update(policy, reference, torch.optim.SGD(policy.parameters(), lr=cfg.lr),
                               problems, rollouts, cfg, 0, 0, _score(cfg))
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        moves[precision] = torch.cat([p.detach().flatten() for p in policy.parameters()]) - start
        losses[precision] = out["rl/loss"]
    cos = float(torch.nn.functional.cosine_similarity(moves["fp32"], moves["bf16"], dim=0))
    assert cos > 0.99, cos
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.02)
    assert losses["bf16"] != losses["fp32"]  # the forwards did run in bf16 (measured cosine 0.99999)
    assert grpo.policy_precision(reference, GRPOConfig()) == "fp32"
    with pytest.raises(ConfigError, match="grpo.precision"):
        DemoConfig(grpo=GRPOConfig(precision="fp16")).validate()


def test_log_probs_are_those_of_the_distribution_sampled_at_the_temperature():
    """At grpo.temperature T the update differentiates log softmax(logits / T), the distribution
    the engine sampled the tokens from (at T=1 the raw one); the async loop's importance weights,
    which read the engine's raw log-probs, are refused at T != 1."""
    from draftadapt.config import ConfigError, load_config
    from draftadapt.rl.config import DemoConfig

    tok = build_tokenizer()
    small = ToyModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)
    model = build_model(small, seed=0).eval()
    _, rollouts = _rollouts(tok, 4, seed=5)
    batch = collate(as_sequences(rollouts), 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        for t in (1.0, 0.7):
            want = torch.log_softmax(logits / t, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
            assert torch.allclose(grpo.token_logprobs(model, batch, temperature=t), want, atol=1e-6)
        mask = batch["loss_mask"][:, :-1]
        # sharper at 0.7: the likelier tokens' log-probs rise, so the two must differ where it counts
        assert not torch.allclose(grpo.token_logprobs(model, batch, temperature=0.7)[mask],
                                  grpo.token_logprobs(model, batch)[mask], atol=1e-3)
    with pytest.raises(ConfigError, match=r"async_lag=1 with grpo.temperature=0.7: .*set grpo.temperature=1 or "
                                          r"grpo.off_policy_clip=0"):
        load_config(DemoConfig, None, ["async_lag=1", "grpo.temperature=0.7"])
    load_config(DemoConfig, None, ["async_lag=1", "grpo.temperature=0.7", "grpo.off_policy_clip=0"])
