"""The trainer on tiny models built from config: learning, incremental use, resume, scoring."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftadapt.capture.hidden import TargetCapture
from draftadapt.data.sequences import Sequence, collate, iter_batches
from draftadapt.drafts.eagle3 import init_from_target
from draftadapt.train.trainer import DraftTrainer, TrainConfig, lr_lambda, score_draft

V = 24

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py



def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peaked target: something a draft can learn in a few steps
        model.lm_head.weight.mul_(20.0)
    return model


def tiny_data(n: int = 32, seed: int = 0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    return [Sequence([1] + torch.randint(3, V, (3,), generator=g).tolist(),
                     torch.randint(3, V, (12,), generator=g).tolist()) for _ in range(n)]


def make_trainer(target, method="eagle3", seed=0, **kw):
    cfg = TrainConfig(batch_size=8, warmup_steps=2, lr=1e-2, seed=seed, **kw)
    if method == "eagle3":
        draft = init_from_target(target, [1, 2, 3], None, None, seed)
    else:
        from transformers import LlamaConfig as LC

        torch.manual_seed(seed)
        draft = LlamaForCausalLM(LC(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                    max_position_embeddings=64))
    return DraftTrainer(draft, method, cfg, total_steps=40)


def captured(target, seqs, aux=(1, 2, 3), epoch=0):
    cap = TargetCapture(target, list(aux) if aux else None)
    return [cap.capture(b) for b in iter_batches(seqs, 8, 0, seed=0, epoch=epoch)]


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_a_few_steps_reduce_loss(method):
    target = tiny_target()
    batches = captured(target, tiny_data(), aux=(1, 2, 3) if method == "eagle3" else None)
    tr = make_trainer(target, method)
    first = tr.train_steps(batches)["train/loss"]
    for _ in range(4):
        last = tr.train_steps(batches)  # repeated calls keep the optimizer state
    assert tr.step == 5 * len(batches)
    assert last["train/loss"] < 0.85 * first
    assert {"train/loss", "train/acc_pos_0", "accept/simulated_length", "accept/pos_0", "train/lr"} <= set(last)


def test_ce_loss_option_trains():
    target = tiny_target()
    batches = captured(target, tiny_data())
    tr = make_trainer(target, loss="ce")
    first = tr.train_steps(batches)["train/loss"]
    for _ in range(3):
        last = tr.train_steps(batches)["train/loss"]
    assert last < first


def test_ttt_slots_train_the_later_steps_and_raise_the_score():
    """train.ttt_slots < 1: steps >= 1 run at a quarter of the loss positions; the later steps'
    losses still fall and the simulated acceptance (all positions, scored separately) rises."""
    target = tiny_target()
    batches = captured(target, tiny_data())
    tr = make_trainer(target, ttt_slots=0.25)
    before = tr.score(batches)[1].length
    first = tr.train_steps(batches)
    for _ in range(5):
        last = tr.train_steps(batches)
    assert "accept/simulated_length" not in last  # not every position ran: no per-batch simulation
    for i in (1, 2):
        assert last[f"train/loss_pos_{i}"] < 0.85 * first[f"train/loss_pos_{i}"], i
    after = tr.score(batches)[1].length
    assert after > before + 0.1, (before, after)


def test_ttt_slots_out_of_range_is_a_config_error():
    from draftadapt.config import ConfigError

    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="ttt_slots"):
            TrainConfig(ttt_slots=bad).validate()


def test_resume_from_checkpoint_continues_identically(tmp_path):
    target = tiny_target()
    batches = captured(target, tiny_data())
    more = captured(target, tiny_data(), epoch=1)

    straight = make_trainer(target)
    straight.train_steps(batches)
    straight.train_steps(more)
    ref = {k: v.clone() for k, v in straight.draft.state_dict().items()}

    first = make_trainer(target)
    first.train_steps(batches)
    first.save_checkpoint(tmp_path / "ckpt", {"epoch": 1, "batch": 0})
    first.train_steps(more[:1])  # diverge a little after the checkpoint: the reload must undo it

    resumed = make_trainer(target, seed=123)  # different init: everything must come from the checkpoint
    state = resumed.load_checkpoint(tmp_path / "ckpt")
    assert state["epoch"] == 1 and resumed.step == len(batches)
    resumed.train_steps(more)
    for k, v in resumed.draft.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()


def test_checkpoint_of_other_method_is_refused(tmp_path):
    target = tiny_target()
    tr = make_trainer(target)
    tr.save_checkpoint(tmp_path / "c")
    other = make_trainer(target, "draft_model")
    with pytest.raises(ValueError, match="eagle3 checkpoint"):
        other.load_checkpoint(tmp_path / "c")
    with pytest.raises(FileNotFoundError):
        tr.load_checkpoint(tmp_path / "missing")


def test_score_improves_with_training_and_export_copy():
    target = tiny_target()
    data = tiny_data(48)
    train, held = data[:32], data[32:]
    batches = captured(target, train)
    held_b = [TargetCapture(target, [1, 2, 3]).capture(collate(held, 0))]
    tr = make_trainer(target)
    before, _ = tr.score(held_b, k=3)
    for _ in range(8):
        tr.train_steps(batches)
    after, uniform = tr.score(held_b, k=3)
    # Measured on this tiny target (fixed seed): 1.051 before, 1.261 after 8 passes. Half that gain
    # is the bar: float-order noise (~0.002, below) cannot fail it, a trainer that learns nothing
    # cannot pass it.
    assert after.length - before.length > 0.1, (before.length, after.length)
    assert len(after.per_position) == 3 and uniform.drafts >= after.drafts
    # the standalone scorer on the exported copy agrees with the trainer's. Not bit for bit: the
    # bare head and the trainer's wrapped one order their float sums differently, and with vLLM's
    # thread binding in the process (the full suite) a near-tie of the greedy draft flips now and
    # then (seen: 1.2743 vs 1.2728). Exporting the wrong weights moves it by > 0.1.
    again, _ = score_draft(tr.export_draft(), held_b, 3)
    assert again.length == pytest.approx(after.length, abs=0.01)


def test_lr_schedule():
    cfg = TrainConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    f = lr_lambda(cfg, 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(110) == pytest.approx(0.1)
    g = lr_lambda(TrainConfig(warmup_steps=0, schedule="constant"), None)
    assert g(0) == g(1000) == 1.0


def test_reduced_draft_vocabulary_trains_and_scores():
    from draftadapt.data.prompts import token_counts
    from draftadapt.drafts.vocab import draft_to_target_ids

    target = tiny_target()
    data = tiny_data(32)
    head = init_from_target(target, [1, 2, 3], 12, token_counts(data, V), 0)
    ids = draft_to_target_ids(head.d2t)
    cap = TargetCapture(target, [1, 2, 3], ids)
    batches = [cap.capture(b) for b in iter_batches(data, 8, 0, seed=0, epoch=0)]
    assert batches[0].target_logp.shape[-1] == 12
    for loss in ("kl", "ce"):
        tr = DraftTrainer(init_from_target(target, [1, 2, 3], 12, token_counts(data, V), 0), "eagle3",
                          TrainConfig(batch_size=8, warmup_steps=1, loss=loss), total_steps=8)
        untrained, _ = tr.score(batches, k=3)
        first = tr.train_steps(batches)["train/loss"]
        last = tr.train_steps(batches)["train/loss"]
        assert last < first
        visited, _ = tr.score(batches, k=3)
        if loss == "kl":
            # measured (fixed seed): 1.072 untrained, 1.125 after two passes; half the gain is the bar
            assert visited.length - untrained.length > 0.025, (untrained.length, visited.length)
        else:
            # ce on the sampled tokens does not move this tiny head's score in two passes (measured
            # 1.072 -> 1.068): only that it scores, i.e. some proposal is accepted
            assert visited.length > 1.0, visited.length


def test_speculators_norms_added_to_a_head_keep_its_weights():
    """pretrain's draft.norm_* (speculators' default Eagle-3 layout): the same tensors, plus
    input_norm at one, the shared embeddings still frozen; no change returns the head itself."""
    from draftadapt.drafts.eagle3 import with_layout

    head = init_from_target(tiny_target(), [1, 2, 3], None, None, 0)
    normed = with_layout(head, 0, norm_before_residual=True, norm_before_fc=True, norm_output=True)
    assert (normed.cfg.norm_before_residual, normed.cfg.norm_before_fc, normed.cfg.norm_output) == (True, True, True)
    own = normed.state_dict()
    assert set(own) - set(head.state_dict()) == {"input_norm.weight"}
    assert torch.equal(own["input_norm.weight"], torch.ones(3 * 32))
    for name, tensor in head.state_dict().items():
        assert torch.equal(own[name], tensor), name
    assert not normed.embed_tokens.weight.requires_grad and normed.fc.weight.requires_grad
    assert with_layout(head, 0, norm_output=False) is head


def test_narrower_mlp_keeps_everything_else(tmp_path):
    from draftadapt.drafts.eagle3 import with_intermediate_size

    target = tiny_target()
    head = init_from_target(target, [1, 2, 3], None, None, 0)
    small = with_intermediate_size(head, 16, seed=0)
    assert small.cfg.intermediate_size == 16 and small.layers[0].mlp.up_proj.weight.shape == (16, 32)
    torch.testing.assert_close(small.fc.weight, head.fc.weight)
    torch.testing.assert_close(small.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight)
    assert small.embed_tokens.weight.requires_grad == head.embed_tokens.weight.requires_grad
    assert with_intermediate_size(head, head.cfg.intermediate_size, 0) is head
    batches = captured(target, tiny_data())
    tr = DraftTrainer(small, "eagle3", TrainConfig(batch_size=8, warmup_steps=1), total_steps=8)
    assert tr.train_steps(batches)["train/loss"] > 0


def test_the_optimizer_is_adamw_fused_and_steps_as_torchs_default_does(monkeypatch):
    """train's AdamW runs fused (one kernel over every parameter; ~6x faster a step on CPU at 1b
    widths): the same update as torch's default loop, within float32 rounding."""
    target = tiny_target()
    batches = captured(target, tiny_data())
    tr = make_trainer(target)
    real = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, fused=None, **kw: real(*a, **kw))
    ref = make_trainer(target)  # the same trainer with torch's default AdamW
    monkeypatch.undo()
    assert tr.optimizer.defaults["fused"] is True and not ref.optimizer.defaults["fused"]
    for _ in range(3):
        tr.train_steps(batches)
        ref.train_steps(batches)
    for (name, a), b in zip(tr.draft.state_dict().items(), ref.draft.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def test_auto_precision_is_bf16_on_cpu_only_where_bf16_hardware_makes_a_wide_draft_faster(monkeypatch):
    """train.precision=auto on a CPU: bf16 with AMX-BF16 or avx512_bf16 for a draft at least 512
    wide (measured: 0.51-0.77x the float32 step at 576 and 2048 on a Xeon with AMX, 0.54-0.59x on an
    EPYC with avx512_bf16; 1.06-1.34x at the toy's 128), float32 otherwise."""
    from draftadapt.train import trainer as trainer_mod
    from draftadapt.precision import BF16_CPU_MIN_WIDTH
    from draftadapt.train.trainer import auto_precision, draft_width

    narrow = init_from_target(tiny_target(), [1, 2, 3], None, None, 0)
    assert draft_width(narrow) == 32
    wide = torch.nn.Sequential(torch.nn.Linear(3 * 576, 576), torch.nn.Linear(576, 8192))
    assert draft_width(wide) == 576 >= BF16_CPU_MIN_WIDTH
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for amx, avx512_bf16 in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(trainer_mod.torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(trainer_mod.torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert auto_precision(cpu, wide) == ("bf16" if amx or avx512_bf16 else "fp32")
        assert auto_precision(cpu, narrow) == "fp32"
        assert auto_precision(cuda, narrow) == "bf16"
