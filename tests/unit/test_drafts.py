"""Eagle-3 head and draft formats, on tiny models built from config (no engine)."""

import json

import pytest
import torch

from draftadapt.drafts.eagle3 import default_aux_layers, init_from_target
from draftadapt.drafts.formats import (
    DraftFormatError,
    check_draft_for_target,
    check_identity,
    export_eagle3,
    load_eagle3,
    target_fingerprint,
)
from draftadapt.draft_init import init_draft
from draftadapt.toy.model import ToyModelConfig, build_model
from draftadapt.toy.tokenizer import build_tokenizer

# vLLM's Eagle3LlamaForCausalLM.load_weights adds "model." to every name but lm_head, maps
# d2t -> draft_id_to_target_id and ignores t2d; these are the names it resolves.
VLLM_EAGLE3_NAMES = {
    "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
}


def make_target(path, layers=4, hidden=64, max_pos=256, arch="llama"):
    cfg = ToyModelConfig(arch=arch, num_layers=layers, hidden_size=hidden, num_heads=2, num_kv_heads=2,
                         intermediate_size=128, max_position_embeddings=max_pos)
    model = build_model(cfg, seed=0)
    model.save_pretrained(str(path))
    build_tokenizer().save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    return path, make_target(path)


def test_default_aux_layers_are_distinct():
    for L in range(3, 40):
        ids = default_aux_layers(L)
        assert len(set(ids)) == 3 and all(0 <= i < L for i in ids), (L, ids)
    assert default_aux_layers(32) == [2, 16, 29]  # vLLM's default where it is valid


def test_head_names_and_shapes_match_vllm(target):
    path, model = target
    head = init_from_target(model, None, 40, None, seed=0)
    names = set(head.state_dict())
    assert names == VLLM_EAGLE3_NAMES
    sd = head.state_dict()
    assert sd["fc.weight"].shape == (64, 3 * 64)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * 64)  # attention input [emb ; hidden]
    assert sd["lm_head.weight"].shape == (40, 64)
    assert torch.equal(sd["embed_tokens.weight"], model.get_input_embeddings().weight)  # not random


def test_unroll_step0_is_the_causal_forward(target):
    _, model = target
    head = init_from_target(model, [1, 2, 3], None, None, seed=0)
    torch.manual_seed(0)
    ids = torch.randint(4, 30, (2, 9))
    aux = torch.randn(2, 9, 3 * 64)
    with torch.no_grad():
        out = head.unroll(ids, aux, steps=3)
        ref = head.logits(head(ids, head.combine(aux)))
    assert len(out) == 3 and out[0].shape == (2, 9, 64)
    torch.testing.assert_close(out[0], ref)
    # step j at index t sees only step-0 keys <= t: changing a later position leaves earlier ones alone
    ids2 = ids.clone()
    ids2[:, -1] = 5
    with torch.no_grad():
        out2 = head.unroll(ids2, aux, steps=3)
    for j in range(3):
        torch.testing.assert_close(out2[j][:, :-1], out[j][:, :-1])


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_export_import_round_trip(target, tmp_path, fmt):
    path, model = target
    head = init_from_target(model, [1, 2, 3], 40, torch.arange(64.0), seed=1)
    out = export_eagle3(head, tmp_path / fmt, path, fmt=fmt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 40 and cfg["norm_before_residual"] is False
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    assert layer["max_position_embeddings"] == 256
    meta = json.loads((out / "draftadapt.json").read_text())
    # the head uses the target's own embeddings: written as shared, not exported (a swap can
    # never write into the policy's module)
    assert meta["shared_modules"] == ["embed_tokens"] and cfg["shared_modules"] == ["embed_tokens"]
    assert meta["target"] == target_fingerprint(path)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any("embed_tokens" in n for n in names)
    back = load_eagle3(out, path)
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    check_draft_for_target(out, path)


def test_foreign_eagle_checkpoint_without_embeddings_gets_the_targets(target, tmp_path):
    path, model = target
    head = init_from_target(model, [1, 2, 3], 40, None, seed=1)
    out = export_eagle3(head, tmp_path / "e", path, fmt="eagle")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in sd  # shared with the target, as other tools ship it too
    save_file(sd, str(out / "model.safetensors"))
    (out / "draftadapt.json").unlink()
    back = load_eagle3(out, path)
    assert torch.equal(back.embed_tokens.weight, model.get_input_embeddings().weight)
    assert back.cfg.share_embeddings and not back.embed_tokens.weight.requires_grad
    # an own, distinct copy is exported and kept
    own = init_from_target(model, [1, 2, 3], 40, None, seed=2)
    own.cfg.share_embeddings = False
    with torch.no_grad():
        own.embed_tokens.weight.add_(0.01)
    d = export_eagle3(own, tmp_path / "own", path)
    assert json.loads((d / "draftadapt.json").read_text())["shared_modules"] == []
    assert not load_eagle3(d, path).cfg.share_embeddings
    with pytest.raises(DraftFormatError, match="embed_tokens"):
        load_eagle3(out, None)


def test_unfit_drafts_are_refused_with_a_reason(target, tmp_path):
    path, model = target
    head = init_from_target(model, [1, 2, 3], 40, None, seed=1)
    # max positions below the target's
    head.cfg.max_position_embeddings = 128
    with pytest.raises(DraftFormatError, match="max_position_embeddings 128 is below"):
        export_eagle3(head, tmp_path / "short", path)
    head.cfg.max_position_embeddings = 256
    # aux layers beyond the target's depth
    head.cfg.aux_layer_ids = [1, 2, 9]
    with pytest.raises(DraftFormatError, match="aux layer ids"):
        export_eagle3(head, tmp_path / "aux", path)
    head.cfg.aux_layer_ids = [1, 2, 3]
    # a draft for another target (other hidden size and depth)
    other = tmp_path / "other"
    make_target(other, layers=5, hidden=32)
    d = init_draft(other, "eagle3", tmp_path / "d_other")
    with pytest.raises(DraftFormatError, match="another target"):
        check_draft_for_target(d, path)
    # truncated weights
    good = export_eagle3(head, tmp_path / "good", path)
    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(DraftFormatError, match="sha256"):
        check_draft_for_target(good, path)
    # missing tokenizer on the target side
    notok = tmp_path / "notok"
    model.save_pretrained(str(notok))
    with pytest.raises(DraftFormatError, match="tokenizer"):
        check_draft_for_target(d, notok)


def test_small_lm_draft(target, tmp_path):
    path, _ = target
    d = init_draft(path, "draft_model", tmp_path / "lm")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == 64 and cfg["max_position_embeddings"] == 256
    assert (d / "tokenizer.json").is_file()
    assert check_draft_for_target(d, path)["method"] == "draft_model"


def test_qwen3_target_gets_a_llama_type_head(tmp_path):
    path = tmp_path / "q"
    make_target(path, arch="qwen3")
    d = init_draft(path, "eagle3", tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert load_eagle3(d, path).cfg.target_model_type == "qwen3"


def test_one_identity_check_names_each_field_and_the_fix():
    """formats.check_identity is the draft/target identity check of the loader, the publisher
    and the engine's swap: each differing field with both values, then the caller's fix."""
    fp = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 64, "tokenizer_sha256": "t"}
    check_identity({**fp}, fp, "d was exported", "re-export it")
    check_identity({"hidden_size": 64}, fp, "d was exported", "re-export it")  # unrecorded fields are skipped
    with pytest.raises(DraftFormatError, match=r"^d was exported for another target \(hidden_size: draft 32 vs "
                                               r"target 64, vocab_size: draft 60 vs target 64\); re-export it$"):
        check_identity({**fp, "hidden_size": 32, "vocab_size": 60}, fp, "d was exported", "re-export it")

    class Refused(RuntimeError):
        pass

    with pytest.raises(Refused, match=r"model_type: draft None vs target 'llama'.*; not swapped"):
        check_identity({"hidden_size": 64}, fp, "d was built", "not swapped", require=True, error=Refused)


def test_speculators_norm_variants_export_serve_names_and_round_trip(target, tmp_path):
    """norm_before_fc, fc_norm and norm_output (speculators trains the first and last by default):
    written explicitly, their tensors under vLLM's names, read back as written, and norm_output
    changes what steps >= 1 read (a loader that dropped it would train another model)."""
    import dataclasses

    path, model = target
    base = init_from_target(model, [1, 2, 3], 40, None, seed=1)
    for flags, extra in (({"norm_before_fc": True, "norm_output": True}, {"input_norm.weight"}),
                         ({"fc_norm": True}, {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"})):
        head = type(base)(dataclasses.replace(base.cfg, **flags))
        head.load_state_dict({**head.state_dict(), **base.state_dict()})
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "input_norm" in name or "fc_norm" in name:
                    p.uniform_(0.5, 1.5)
        assert set(head.state_dict()) == VLLM_EAGLE3_NAMES | extra
        out = export_eagle3(head, tmp_path / "_".join(flags), path)
        cfg = json.loads((out / "config.json").read_text())
        assert {k: cfg[k] for k in ("norm_before_fc", "fc_norm", "norm_output")} == {
            k: flags.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output")}
        back = load_eagle3(out, path)
        assert back.cfg == head.cfg
        for k, v in head.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k
    torch.manual_seed(0)
    ids, aux = torch.randint(4, 30, (1, 9)), torch.randn(1, 9, 3 * 64)
    normed = type(base)(dataclasses.replace(base.cfg, norm_output=True))
    normed.load_state_dict(base.state_dict())
    with torch.no_grad():
        a, b = base.unroll(ids, aux, 2), normed.unroll(ids, aux, 2)
    torch.testing.assert_close(a[0], b[0])  # step 0 reads the target's features either way
    assert not torch.allclose(a[1], b[1])
    with pytest.raises(ValueError, match="exclude each other"):
        type(base)(dataclasses.replace(base.cfg, norm_before_fc=True, fc_norm=True))


@pytest.mark.parametrize("change, match", [
    ({"num_hidden_layers": 2}, "2 decoder layers"),
    ({"model_type": "qwen3"}, "qwen3 decoder layer"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}}, "RoPE type 'llama3'"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 128}, "sliding-window attention over 128"),
    ({"mlp_bias": True}, "biases"),
])
def test_a_head_draftadapt_cannot_be_is_refused_naming_the_option(target, tmp_path, change, match):
    """A speculators config draftadapt's head would silently differ from is refused at import."""
    path, model = target
    out = export_eagle3(init_from_target(model, [1, 2, 3], 40, None, seed=1), tmp_path / "d", path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformer_layer_config"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftFormatError, match=match):
        load_eagle3(out, path)


def test_a_sliding_window_wider_than_the_targets_context_is_full_attention(target, tmp_path):
    """speculators' default: every draft layer slides over 2048 positions; on a target of 256 that
    is full attention, so the head imports."""
    path, model = target
    out = export_eagle3(init_from_target(model, [1, 2, 3], 40, None, seed=1), tmp_path / "d", path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=2048,
                                           use_sliding_window=True)
    (out / "config.json").write_text(json.dumps(cfg))
    load_eagle3(out, path)
