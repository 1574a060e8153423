"""MTP drafts (drafts/mtp.py, MTPMethod, toy/mtp.py) on tiny models built from config (no engine)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftadapt.capture.hidden import CapturedBatch
from draftadapt.drafts.formats import DraftFormatError, check_draft_for_target, detect_format, read_hf_config
from draftadapt.drafts.mtp import PREFIX, MTPHead, head_from_target
from draftadapt.toy.model import ToyModelConfig, build_model
from draftadapt.toy.mtp import JointMTP, save_mtp
from draftadapt.toy.tokenizer import build_tokenizer
from draftadapt.train.methods import MTP, MTPMethod, method_for, method_of_dir
from draftadapt.train.trainer import DraftTrainer, TrainConfig

# what vLLM's MiMoMTP.load_weights resolves for layer 0 (checkpoint names, 0-indexed, no mtp_block.)
VLLM_MTP_NAMES = {PREFIX + "0." + n for n in (
    "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}


def make_mtp_target(path, layers=2, hidden=64, mtp=1, seed=0):
    cfg = ToyModelConfig(arch="qwen2", num_layers=layers, hidden_size=hidden, num_heads=2, num_kv_heads=2,
                         intermediate_size=128)
    joint = JointMTP(build_model(cfg, seed=seed), mtp, seed)
    joint.lm.save_pretrained(str(path))
    build_tokenizer().save_pretrained(str(path))
    save_mtp(path, joint.head)
    return joint


@pytest.fixture()
def target(tmp_path):
    make_mtp_target(tmp_path / "t")
    return tmp_path / "t"


def test_target_layout_is_what_vllm_loads(target):
    cfg = read_hf_config(target)
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["model_type"] == "qwen2"
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:
        assert {k for k in f.keys() if k.startswith(PREFIX)} == VLLM_MTP_NAMES


def test_hf_policy_loads_without_the_mtp_layers(target):
    """The policy side is a plain Qwen2ForCausalLM: the MTP tensors are dropped, so RL gradients
    have nothing of them to reach."""
    policy = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    assert type(policy).__name__ == "Qwen2ForCausalLM"
    assert not any("mtp" in n for n, _ in policy.named_parameters())
    assert not any("mtp" in n for n in policy.state_dict())


def test_step0_matches_a_transformers_qwen2_layer(target):
    """The MTP layer equals vLLM's MiMo layer written with transformers' own Qwen2 decoder layer:
    norms, input_proj([hidden ; embedding]), the block, final_layernorm, zero embedding at 0."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    head = head_from_target(target)
    layer = head.layers[0]
    hf = Qwen2Config(**{k: v for k, v in read_hf_config(target).items() if k != "architectures"})
    hf._attn_implementation = "sdpa"
    block = Qwen2DecoderLayer(hf, 0)
    block.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if k.startswith(("self_attn.", "mlp.", "input_layernorm", "post_attention"))})
    g = torch.Generator().manual_seed(0)
    b, t, h = 2, 7, head.cfg.hidden_size
    hidden = torch.randn(b, t, h, generator=g)
    ids = torch.randint(4, 30, (b, t), generator=g)
    pos = torch.arange(t).expand(b, t)
    emb = head.embed_tokens(ids)
    emb[:, 0] = 0
    x = layer.input_proj(torch.cat([layer.hidden_layernorm(hidden), layer.token_layernorm(emb)], -1))
    rot = Qwen2RotaryEmbedding(hf)(x, pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    ref = layer.final_layernorm(block(x, attention_mask=mask, position_ids=pos, position_embeddings=rot))
    ours = head.unroll(ids, hidden, 1)[0]
    torch.testing.assert_close(ours, head.lm_head(ref), atol=1e-5, rtol=1e-5)


def test_method_init_export_load_round_trip(target, tmp_path):
    assert method_for("mtp") is MTP and isinstance(MTP, MTPMethod)
    head = MTP.init(target)
    assert method_for(head) is MTP and method_for(MTP.wrap(head, 2)) is MTP
    with torch.no_grad():
        head.layers[0].input_proj.weight.mul_(1.5)
    out = MTP.export(head, tmp_path / "d", target, meta={"version": 3})
    assert detect_format(read_hf_config(out)) == "mtp" and method_of_dir(out) is MTP
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # only the MTP layers: embed/lm_head are the target's
        assert set(f.keys()) == VLLM_MTP_NAMES
    assert json.loads((out / "draftadapt.json").read_text())["version"] == 3
    check_draft_for_target(out, target)
    back = MTP.load(out, target)
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    assert MTP.speculative_config(out, 3, 256) == {"method": "mtp", "num_speculative_tokens": 3}


def test_export_refuses_another_target(target, tmp_path):
    other = tmp_path / "o"
    make_mtp_target(other, hidden=32)
    with pytest.raises(DraftFormatError, match="does not fit"):
        MTP.export(MTP.init(target), tmp_path / "d", other)
    with pytest.raises(ValueError, match="MiMoForCausalLM"):
        from draftadapt.toy.model import build_model as bm

        plain = tmp_path / "plain"
        bm(ToyModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)).save_pretrained(str(plain))
        head_from_target(plain)


def test_training_moves_only_the_mtp_layers_and_never_the_policy(target):
    """The draft trainer steps the MTP layers on the policy's captured hidden states; the policy
    gets no gradient and its weights stay; the frozen embed/lm_head copies stay too."""
    policy = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    head = MTP.init(target)
    MTP.refresh_shared(head, policy)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    policy_before = {k: v.clone() for k, v in policy.state_dict().items()}
    capture = MTP.target_capture(policy, head, 1.0)
    assert capture.aux_layer_ids == [policy.config.num_hidden_layers]
    ids = torch.randint(4, 30, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    logp, aux = capture(ids, mask)
    batch = CapturedBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.bool(), target_logp=logp, aux=aux)
    trainer = DraftTrainer(head, "mtp", TrainConfig(ttt_steps=3, lr=1e-2, warmup_steps=0, threads=1))
    trainer.train_step(batch)
    after = trainer.draft.state_dict()
    assert not torch.equal(after["layers.0.input_proj.weight"],
                           before["layers.0.input_proj.weight"])
    for k in ("embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(after[k], before[k]), k
    assert all(p.grad is None for p in policy.parameters())
    for k, v in policy.state_dict().items():
        assert torch.equal(v, policy_before[k]), k


def test_joint_toy_loss_trains_body_and_mtp(tmp_path):
    cfg = ToyModelConfig(arch="qwen2", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2,
                         intermediate_size=64)
    joint = JointMTP(build_model(cfg, seed=0), 1, 0)
    ids = torch.randint(4, 30, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    plain = joint.lm(input_ids=ids, labels=labels).loss
    both = joint(input_ids=ids, labels=labels).loss
    assert both > plain
    both.backward()
    assert joint.head.layers[0].input_proj.weight.grad is not None
    assert joint.lm.model.layers[0].mlp.down_proj.weight.grad is not None
    with pytest.raises(ValueError, match="qwen2"):
        from draftadapt.toy.build import build

        build(str(tmp_path / "x"), arch="llama", mtp=1)


def test_joint_toy_mtp_weight_scales_only_the_mtp_loss():
    """ToyTrainConfig.mtp_weight (``toy build --mtp-weight``) weighs the MTP layer's loss beside
    the LM's: loss = LM + weight * MTP, and 0 trains the body alone (no gradient to the layer)."""
    cfg = ToyModelConfig(arch="qwen2", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2,
                         intermediate_size=64)
    ids = torch.randint(4, 30, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    losses = {}
    for w in (0.0, 0.3, 1.0):
        joint = JointMTP(build_model(cfg, seed=0), 1, 0, weight=w)
        losses[w] = joint(input_ids=ids, labels=labels).loss
        plain = joint.lm(input_ids=ids, labels=labels).loss
        if w == 0.0:
            torch.testing.assert_close(losses[w], plain)
            losses[w].backward()
            assert not joint.head.layers[0].input_proj.weight.grad.any()
    mtp = losses[1.0] - losses[0.0]
    assert float(mtp) > 1.0  # three unrolled steps of CE near log(vocab) at init, weights 0.8^j
    torch.testing.assert_close(losses[0.3], losses[0.0] + 0.3 * mtp, rtol=1e-5, atol=1e-5)
    from draftadapt.toy.build import ToyTrainConfig

    assert ToyTrainConfig().mtp_weight == pytest.approx(1.0)


def test_a_saved_policy_gets_the_targets_mtp_layers_back(target, tmp_path):
    """The demo saves its final policy with save_pretrained (a plain Qwen2 model): carrying the
    target's MTP layers over makes it an MTP target vLLM serves with method="mtp" again."""
    from draftadapt.toy.mtp import carry_mtp_layers

    policy = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    out = tmp_path / "final"
    policy.save_pretrained(str(out))
    build_tokenizer().save_pretrained(str(out))
    assert not mtp_tensors(out) and read_hf_config(out)["architectures"] == ["Qwen2ForCausalLM"]
    carry_mtp_layers(target, out)
    assert read_hf_config(out)["architectures"] == ["MiMoForCausalLM"] and mtp_tensors(out) == VLLM_MTP_NAMES
    for (n, a), (_, b) in zip(head_from_target(target).state_dict().items(), head_from_target(out).state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    plain = tmp_path / "plain"
    policy.save_pretrained(str(plain))
    before = (plain / "model.safetensors").read_bytes()
    carry_mtp_layers(plain, plain)  # a target without MTP layers: nothing happens
    assert (plain / "model.safetensors").read_bytes() == before


def mtp_tensors(model_dir) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k for k in f.keys() if k.startswith(PREFIX)}
