"""speculators interop, checked with speculators' own code (docs/design.md, "speculators"):

- a draftadapt Eagle-3 export loads with speculators' ``Eagle3DraftModel.from_pretrained`` and its
  forward gives draftadapt's logits at every TTT step;
- a draft speculators made (its config and model classes, its training defaults, a short run of
  its own loss, its ``save_pretrained``) imports with ``draftadapt draft init --from``, serves in
  vLLM, adapts online (a DraftAdapter round and a swap), and what draftadapt publishes loads back
  in speculators and trains there;
- an original-EAGLE checkpoint converted by speculators' converter imports as the same head.

speculators runs with eager attention: its default, flex attention, is compiled for GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftadapt.adapter import AdapterConfig, DraftAdapter, ScheduleConfig, ValidateConfig
from draftadapt.drafts.eagle3 import default_aux_layers, init_from_target
from draftadapt.drafts.formats import WEIGHTS_FILE, export_eagle3, load_eagle3
from draftadapt.draft_init import init_draft
from draftadapt.train.trainer import TrainConfig

from .conftest import REPO, start_engine, stop_engine, toy_prompts

pytest.importorskip("speculators", reason="installed by scripts/setup.sh (pip install --no-deps speculators==0.9.0)")

pytestmark = pytest.mark.integration

# float32 on both sides; measured 2.4e-6 at most on logits up to 6 (docs/design.md, "speculators")
ATOL = RTOL = 1e-5
TTT_STEPS = 3
DRAFT_VOCAB = 40


# --------------------------------------------------------------------------- speculators' side

def speculators_model(draft_dir: Path):
    """``draft_dir`` through speculators' own loader, with eager attention."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=cfg).eval()
    with safe_open(str(draft_dir / WEIGHTS_FILE), "pt") as f:
        own_embeddings = "embed_tokens.weight" in f.keys()
    if not own_embeddings:
        # speculators 0.9.0 under transformers 5.19: a checkpoint without embed_tokens (vLLM shares
        # the target's) leaves them torch.empty, not the NaN its load_verifier_weights looks for,
        # so the verifier's are never copied in. Mark them unloaded and ask again.
        model.embed_tokens.weight.data.fill_(float("nan"))
        model.load_verifier_weights()
    return model


def speculators_logits(model, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """speculators' forward over ids [1, T] (token t+1 at t) and aux [1, T, 3H] -> its lm_head
    output at each TTT step (teacher-forced: step j reads the true token t+j+1)."""
    out = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: out.append(o.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids),
                  position_ids=torch.arange(ids.shape[1])[None], ttt_steps=TTT_STEPS)
    finally:
        hook.remove()
    return out


def draftadapt_logits(head, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """draftadapt's TTT unroll on the same inputs, fed the same true tokens."""
    def teacher(j, _logits):
        return torch.cat([ids[:, 1 + j:], ids.new_zeros(1, 1 + j)], dim=-1)

    with torch.no_grad():
        return head.unroll(ids, aux, TTT_STEPS, feed_ids=teacher)


def assert_same_logits(head, model, ids, aux) -> None:
    theirs, ours = speculators_logits(model, ids, aux), draftadapt_logits(head, ids, aux)
    assert len(theirs) == len(ours) == TTT_STEPS
    for j, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, j=j: f"TTT step {j}: {m}")


# --------------------------------------------------------------------------- the target's features

class Features:
    """The toy target's aux hidden states and last-layer output over toy-task sequences, laid out
    as speculators' trainer reads them (speculators.models.eagle3.data.shift_batch)."""

    def __init__(self, target: Path, aux_ids: list[int]):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(target))
        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.aux_ids = aux_ids

    def sequences(self, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        from draftadapt.toy.task import sample_problems

        rows = []
        for p in sample_problems(n, seed):
            prompt = self.tok(p["prompt"]).input_ids
            response = self.tok(p["response"], add_special_tokens=False).input_ids + [self.tok.eos_token_id]
            rows.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
        return rows

    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> aux [1, T, 3H] (the residual stream after each aux layer), last [1, T, H] (the last
        layer's output, before the final norm)."""
        last = []
        hook = self.model.model.layers[-1].register_forward_hook(
            lambda _m, _i, o: last.append(o[0] if isinstance(o, tuple) else o))
        try:
            with torch.no_grad():
                out = self.model(torch.tensor(ids)[None], output_hidden_states=True)
        finally:
            hook.remove()
        return torch.cat([out.hidden_states[k] for k in self.aux_ids], dim=-1), last[0]

    def one(self, seed: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence as both models read it: ids [1, T-1] (token t+1 at t), aux [1, T-1, 3H]."""
        ids, _ = self.sequences(1, seed)[0]
        aux, _ = self.forward(ids)
        return torch.tensor(ids)[None, 1:], aux[:, :-1]

    def packed(self, n: int, seed: int) -> dict[str, torch.Tensor]:
        """``n`` sequences packed into one row, each shifted as shift_batch does, for
        Eagle3DraftModel.forward's loss."""
        parts = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask",
                                 "document_ids", "position_ids")}
        for doc, (ids, mask) in enumerate(self.sequences(n, seed)):
            aux, last = self.forward(ids)
            t = len(ids) - 1
            parts["input_ids"].append(torch.tensor(ids[1:]))
            parts["hidden_states"].append(aux[0, :-1])
            parts["verifier_last_hidden_states"].append(last[0, 1:])
            parts["loss_mask"].append(torch.tensor(mask[1:], dtype=torch.bool))
            parts["document_ids"].append(torch.full((t,), doc))
            parts["position_ids"].append(torch.arange(1, t + 1))  # shift_batch: positions start at 1
        return {k: torch.cat(v)[None] for k, v in parts.items()}


def speculators_train(model, batches: list[dict], steps: int, lr: float = 3e-3) -> dict[str, float]:
    """A short run of speculators' own Eagle-3 loss (KL to the verifier over the draft vocabulary,
    TTT_STEPS deep) -> its last step's per-step accuracies."""
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config("kl_div", "eager")  # "fused" is a Triton kernel: GPU only
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the adapter's TrainConfig(threads=1): two spinning threads on a shared box crawl
    try:
        for step in range(steps):
            _, loss, metrics = model(**batches[step % len(batches)], ttt_steps=TTT_STEPS, loss_config=loss_config)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    assert torch.isfinite(loss), loss
    return {f"acc_{j}": float(metrics[f"full_acc_{j}_sum"] / metrics[f"full_acc_{j}_total"]) for j in range(TTT_STEPS)}


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def aux_ids(toy_target) -> list[int]:
    from transformers import AutoConfig

    return default_aux_layers(AutoConfig.from_pretrained(str(toy_target)).num_hidden_layers)


@pytest.fixture(scope="module")
def features(toy_target, aux_ids) -> Features:
    return Features(toy_target, aux_ids)


@pytest.fixture(scope="module")
def speculators_draft(toy_target, aux_ids, features, tmp_path_factory) -> Path:
    """A draft made the way speculators' trainer makes one: its draft-layer config
    (create_transformer_layer_config: llama, 1 layer, sliding window 2048), its vocabulary mapping
    from token counts, its training defaults for Eagle-3 (norm_before_residual, norm_before_fc and
    norm_output on), 60 steps of its loss on the target's own features, its save_pretrained."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    torch.manual_seed(0)
    layer = create_transformer_layer_config(verifier_name_or_path=str(toy_target), num_layers=1, draft_arch="llama",
                                            hidden_act=None, sliding_window=2048, full_attention_indices=[])
    batches = [features.packed(16, seed) for seed in range(4)]
    counts = Counter(batches[0]["input_ids"][batches[0]["loss_mask"]].tolist())
    d2t, t2d = build_vocab_mappings_from_distribution(dict(counts), DRAFT_VOCAB, layer.vocab_size)
    model = Eagle3DraftModel.from_training_args(
        layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(toy_target), draft_vocab_size=DRAFT_VOCAB,
        target_layer_ids=aux_ids, ttt_steps=TTT_STEPS, draft_attn_impl="eager",
        norm_before_residual=True, norm_before_fc=True, norm_output=True)
    acc = speculators_train(model, batches, steps=60)
    assert acc["acc_0"] > 0.5, acc  # it learned something: a random head is at 1/40
    out = tmp_path_factory.mktemp("speculators") / "draft"
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def imported(toy_target, speculators_draft, tmp_path_factory) -> Path:
    """``draftadapt draft init --from`` the speculators draft, as a user runs it."""
    out = tmp_path_factory.mktemp("imported") / "draft0"
    proc = subprocess.run([sys.executable, "-m", "draftadapt.cli", "draft", "init", "--target", str(toy_target),
                           "--method", "eagle3", "--from", str(speculators_draft), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["method"] == "eagle3" and line["format"] == "speculators"
    return out


@pytest.fixture(scope="module")
def engine(toy_target, imported):
    eng = start_engine(toy_target, imported, method="eagle3", k=3)
    yield eng
    stop_engine(eng)


# --------------------------------------------------------------------------- tests

@pytest.mark.parametrize("variant", [{}, {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
                                     {"fc_norm": True}])
def test_draftadapt_export_loads_in_speculators_with_the_same_logits(toy_target, features, tmp_path, variant):
    """draftadapt's export (the original EAGLE-3 head, and speculators' variants) through
    Eagle3DraftModel.from_pretrained: the same logits at every TTT step on the target's features."""
    import dataclasses

    from draftadapt.drafts.eagle3 import Eagle3Head

    fresh = load_eagle3(init_draft(toy_target, "eagle3", tmp_path / "fresh", seed=3, draft_vocab=DRAFT_VOCAB),
                        toy_target)
    head = Eagle3Head(dataclasses.replace(fresh.cfg, **variant))
    head.load_state_dict(fresh.state_dict(), strict=False)
    with torch.no_grad():  # weights large enough that every module moves the logits
        g = torch.Generator().manual_seed(1)
        for name, p in head.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    out = export_eagle3(head, tmp_path / "export", toy_target)
    model = speculators_model(out)
    assert model.config.eagle_aux_hidden_state_layer_ids == list(head.cfg.aux_layer_ids)
    assert torch.equal(model.embed_tokens.weight, head.embed_tokens.weight)  # the target's, shared
    ids, aux = features.one()
    assert_same_logits(head.eval(), model, ids, aux)


def test_speculators_draft_imports_serves_and_adapts(toy_target, speculators_draft, imported, engine, features,
                                                     tmp_path):
    """A draft speculators made and trained: imported with `draft init --from`, it is the same model
    (logits), serves in vLLM above an acceptance length of 1, adapts in a DraftAdapter round that
    swaps into the engine, and the adapted draft loads back in speculators, same logits, and trains."""
    head = load_eagle3(imported, toy_target)
    assert (head.cfg.norm_before_residual, head.cfg.norm_before_fc, head.cfg.norm_output) == (True, True, True)
    assert head.cfg.draft_vocab_size == DRAFT_VOCAB and head.cfg.share_embeddings
    ids, aux = features.one()
    assert_same_logits(head.eval(), speculators_model(speculators_draft), ids, aux)

    prompts = toy_prompts(toy_target, 48)
    served = engine.generate(prompts[:16], temperature=1.0, max_tokens=64, seed=1).acceptance
    assert served.drafts > 0 and served.draft_tokens == 3 * served.drafts
    assert sum(served.accepted_per_pos) == served.accepted_tokens
    assert served.acceptance_length > 1.5, served  # a random head serves at about 1.0

    tc = TrainConfig(lr=1e-3, warmup_steps=0, schedule="constant", threads=1, batch_size=8)
    cfg = AdapterConfig(method="eagle3", k=3, train=tc,
                        schedule=ScheduleConfig(every_n_steps=1, drift_fraction=0.0, train_steps=4, min_sequences=8),
                        validation=ValidateConfig(margin=0.99))  # the path is under test here, not the gate
    adapter = DraftAdapter(toy_target, imported, tmp_path / "adapt", cfg)
    try:
        adapter.observe(engine.generate(prompts, temperature=1.0, max_tokens=64, seed=2).rollouts, policy_version=0)
        m = adapter.run_round()
        assert m["adapt/trained"] == 1.0 and m["adapt/published"] == 1.0, m
        res = adapter.swap(engine)
        assert res is not None and engine.draft_state()["checksum"] == res.checksum
        published = adapter.store.latest().path
    finally:
        adapter.close()
    after = engine.generate(prompts[:16], temperature=1.0, max_tokens=64, seed=1).acceptance
    assert after.drafts > 0 and after.acceptance_length > 1.5, after

    config = json.loads((published / "config.json").read_text())
    assert (config["norm_before_fc"], config["norm_output"], config["norm_before_residual"]) == (True, True, True)
    adapted = load_eagle3(published, toy_target)
    assert not torch.equal(adapted.fc.weight, head.fc.weight)  # it trained
    again = speculators_model(published)
    assert_same_logits(adapted.eval(), again, ids, aux)
    speculators_train(again, [features.packed(8, 7)], steps=2)  # and speculators can train it on


def test_eagle_checkpoint_converted_by_speculators_imports(toy_target, tmp_path):
    """An original-EAGLE checkpoint (draftadapt's `--format eagle` export, non-default aux layers)
    through speculators' convert_model, then `draft init --from`: the same head, bit for bit.
    The converter keeps the aux layer ids only when given them (docs/design.md, "speculators")."""
    from speculators.convert.entrypoints import convert_model
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(toy_target))
    aux = [1, 5, 10]
    head = init_from_target(target, aux, DRAFT_VOCAB, torch.arange(float(target.config.vocab_size)), seed=5)
    eagle = export_eagle3(head, tmp_path / "eagle", toy_target, fmt="eagle")
    assert json.loads((eagle / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    converted = tmp_path / "converted"
    convert_model(model=str(eagle), verifier=str(toy_target), algorithm="eagle3", output_path=str(converted),
                  validate_device="cpu", eagle_aux_hidden_state_layer_ids=aux,
                  norm_before_residual=head.cfg.norm_before_residual)
    config = json.loads((converted / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == aux
    back = load_eagle3(init_draft(toy_target, "eagle3", tmp_path / "imported", source=converted), toy_target)
    assert back.cfg == head.cfg
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
