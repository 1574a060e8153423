"""The per-method training strategies: what differs between an Eagle-3 head, a small draft LM and
MTP layers, one class each.

    method = method_for("eagle3")                  # a name, a draft module or a method
    draft = method.load(draft_dir, target_dir)     # or .init(...) / .build(...) for a new one
    capture = method.target_capture(policy, draft, temperature)   # aux layers, draft vocabulary
    forward = method.wrap(draft, ttt_steps)        # what the trainer steps (TTT unroll or plain LM)
    method.export(draft, out_dir, target_dir)      # a draft directory vLLM serves

Every question whose answer depends on the method (how a draft is made, loaded, exported,
captured for, trained and scored) is answered here and nowhere else; how it is served (its name,
layouts, vLLM's ``speculative_config``) is the torch-free ``drafts/serving.py``, which each class
here extends, so an engine needs no training code (docs/design.md, "Draft methods"). Plain
classes, no registry: the third method (MTP) is the third class and a line in :func:`method_for`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from draftadapt.capture.hidden import TargetCapture
from draftadapt.drafts.eagle3 import Eagle3Head
from draftadapt.drafts.formats import detect_format, export_eagle3, export_mtp, load_eagle3, load_mtp, read_hf_config
from draftadapt.drafts.mtp import MTPHead, head_from_target
from draftadapt.drafts.serving import (METHODS, DraftFormatError, DraftLMServing, Eagle3Serving, MethodServing, MTPServing,
                                       serving_for, serving_of_format)
from draftadapt.drafts.vocab import draft_to_target_ids
from draftadapt.train import losses
from draftadapt.train.forward import DraftLMForward, Eagle3TTT, lm_step_logits


class Eagle3Method(Eagle3Serving):
    """An Eagle-3 head on the target's aux hidden states (vLLM ``method="eagle3"``)."""

    wrapper_prefix = "head."  # the draft's parameter names inside its training wrapper
    packs = True  # trains on packed batches (CapturedBatch.packed)

    # ------------------------------------------------------------------ making and keeping drafts

    def init(self, target: str | Path, seed: int = 0, source: str | Path | None = None,
             draft_vocab: int | None = None) -> Eagle3Head:
        """``draft init``: a fresh head for ``target`` (or ``source``, an existing head, imported)."""
        if source is not None:
            return load_eagle3(source, target)
        from transformers import AutoModelForCausalLM

        from draftadapt.drafts.eagle3 import init_from_target

        model = AutoModelForCausalLM.from_pretrained(str(target))
        return init_from_target(model, None, draft_vocab, None, seed)

    def build(self, target: Path, target_model: nn.Module, cfg, train_seqs) -> Eagle3Head:
        """Pretraining's fresh head (``cfg``: pretrain.DraftConfig): aux layers, a draft vocabulary
        of the most frequent response tokens, an MLP width."""
        from draftadapt.data.prompts import token_counts
        from draftadapt.drafts.eagle3 import init_from_target, with_intermediate_size, with_layout

        counts = token_counts(train_seqs, target_model.config.vocab_size) if cfg.draft_vocab else None
        head = init_from_target(target_model, cfg.aux_layer_ids or None, cfg.draft_vocab or None, counts, cfg.seed)
        if cfg.intermediate_size:
            head = with_intermediate_size(head, cfg.intermediate_size, cfg.seed)
        head = with_layout(head, cfg.seed, norm_before_residual=cfg.norm_before_residual,
                           norm_before_fc=cfg.norm_before_fc, norm_output=cfg.norm_output)
        if cfg.lm_head_from_target:
            with torch.no_grad():
                rows = target_model.get_output_embeddings().weight[self.vocab_ids(head)]  # [Vd, H]
                head.lm_head.weight.copy_(rows.float())
        return head

    def load(self, draft_dir: str | Path, target_dir: str | Path) -> Eagle3Head:
        return load_eagle3(draft_dir, target_dir)

    def export(self, draft: Eagle3Head, out: str | Path, target: str | Path, fmt: str | None = "speculators",
               num_speculative_tokens: int = 3, meta: dict | None = None) -> Path:
        """Write ``draft`` as a draft directory vLLM loads, in layout ``fmt`` (None: speculators)."""
        return export_eagle3(draft, out, target, fmt=fmt or "speculators",
                             num_speculative_tokens=num_speculative_tokens, meta=meta)

    # ------------------------------------------------------------------ what it learns from

    def vocab_ids(self, draft: Eagle3Head) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        return draft_to_target_ids(draft.d2t.cpu())

    def target_capture(self, policy: nn.Module, draft: Eagle3Head, temperature: float) -> TargetCapture:
        """What the policy's forward must give this draft: its aux layers and its vocabulary's log-probs."""
        return TargetCapture(policy, list(draft.cfg.aux_layer_ids), self.vocab_ids(draft), temperature=temperature)

    def shared_policy_modules(self, draft: Eagle3Head) -> tuple[str, ...]:
        """The policy modules :meth:`refresh_shared` reads (by HF accessor), which a trainer that
        sends no weights hands over instead (verl's actor)."""
        return ("input_embeddings",) if draft.cfg.share_embeddings else ()

    def refresh_shared(self, draft: Eagle3Head, policy: nn.Module) -> None:
        """A head that shares the target's embed_tokens sees the policy's current ones (as in vLLM)."""
        if draft.cfg.share_embeddings:
            with torch.no_grad():
                draft.embed_tokens.weight.copy_(policy.get_input_embeddings().weight)

    # ------------------------------------------------------------------ training and scoring

    def freeze_lm_head(self, draft: Eagle3Head) -> None:
        """``train.freeze_lm_head``: lm_head stays as it is (speculators' trainer keeps it frozen
        at the target's rows; ``draft.lm_head_from_target`` puts them there)."""
        draft.lm_head.weight.requires_grad_(False)

    def wrap(self, draft: nn.Module, ttt_steps: int = 3, feed: str = "data", pad_id: int = 0) -> Eagle3TTT:
        if not isinstance(draft, Eagle3Head):
            raise TypeError(f"method 'eagle3' trains an Eagle3Head, got {type(draft).__name__}")
        return Eagle3TTT(draft, ttt_steps, feed, pad_id)

    def unwrap(self, module: Eagle3TTT) -> Eagle3Head:
        return module.head

    def step_logits(self, model: nn.Module, batch, k: int) -> list[torch.Tensor]:
        """The wrapped forward (or its DDP / DeepSpeed wrapper) on a CapturedBatch -> k x [B, T, Vd]."""
        return model(batch.input_ids, batch.aux, k)

    def loss(self, model: nn.Module, batch, cfg, weights: list[float], labels: torch.Tensor | None, draw_slots,
             chunk: int = 0):
        """(loss, per-step losses, per-step accuracies, per-step draft argmax [B, T] for the simulated
        acceptance or [] when TTT steps >= 1 ran at ``draw_slots(loss_mask)`` only, per-sequence
        loss [B]). ``chunk`` > 0: lm_head and the loss run that many tokens at a time
        (``losses.ttt_loss_chunked``); 0: the logits of every step at once (``losses.ttt_loss``)."""
        slots, slot_ok = draw_slots(batch.loss_mask)
        args = (batch.target_logp, batch.loss_mask, weights, cfg.loss, labels, slots, slot_ok, batch.segments,
                batch.seqs)
        if chunk:
            feats = model(batch.input_ids, batch.aux, cfg.ttt_steps, slots, batch.segments, features=True)
            loss, per_step, accs, rows, steps = losses.ttt_loss_chunked(feats, self.unwrap(_bare(model)).lm_head.weight,
                                                                        *args, chunk=chunk)
        else:
            logits = model(batch.input_ids, batch.aux, cfg.ttt_steps, slots, batch.segments)
            loss, per_step, accs, rows = losses.ttt_loss(logits, *args)
            steps = [s.detach().argmax(-1) for s in logits]
        if slots is not None or batch.segments is not None:
            steps = []  # not every position, or packed rows: no simulated acceptance on this batch
        return loss, per_step, accs, steps, rows


class DraftLMMethod(DraftLMServing):
    """A small draft LM sharing the target's tokenizer (vLLM ``method="draft_model"``)."""

    wrapper_prefix = "model."
    packs = False  # an HF model's rows are one sequence each

    def init(self, target: str | Path, seed: int = 0, source: str | Path | None = None,
             draft_vocab: int | None = None) -> nn.Module:
        if source is not None:
            raise DraftFormatError("--from imports Eagle-3 heads; a draft LM is an HF model dir already")
        from draftadapt.drafts.small_lm import build_small_lm

        return build_small_lm(target, seed=seed)

    def build(self, target: Path, target_model: nn.Module, cfg, train_seqs) -> nn.Module:
        from draftadapt.drafts.small_lm import build_small_lm

        model = build_small_lm(target, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seed)
        with torch.no_grad():  # start from the target's token geometry, as the Eagle-3 head does
            emb = target_model.get_input_embeddings().weight
            if emb.shape == model.get_input_embeddings().weight.shape:
                model.get_input_embeddings().weight.copy_(emb)
        return model

    def load(self, draft_dir: str | Path, target_dir: str | Path | None = None) -> nn.Module:
        from draftadapt.drafts.small_lm import load_small_lm

        return load_small_lm(draft_dir)

    def export(self, draft: nn.Module, out: str | Path, target: str | Path, fmt: str | None = None,
               num_speculative_tokens: int = 3, meta: dict | None = None) -> Path:
        """An HF model directory with the target's tokenizer (``fmt`` is Eagle-3's; ignored here)."""
        from draftadapt.drafts.small_lm import export_small_lm

        return export_small_lm(draft, out, target, meta=meta)

    def vocab_ids(self, draft: nn.Module) -> torch.Tensor:
        return torch.arange(draft.config.vocab_size)  # the target's vocabulary

    def target_capture(self, policy: nn.Module, draft: nn.Module, temperature: float) -> TargetCapture:
        return TargetCapture(policy, None, None, temperature=temperature)

    def shared_policy_modules(self, draft: nn.Module) -> tuple[str, ...]:
        return ()

    def refresh_shared(self, draft: nn.Module, policy: nn.Module) -> None:
        pass  # its embeddings are its own

    def freeze_lm_head(self, draft: nn.Module) -> None:
        raise ValueError("train.freeze_lm_head keeps an Eagle-3 head's lm_head at its start; a draft LM's output "
                         "layer is its own (often tied to its embeddings): set train.freeze_lm_head=false")

    def wrap(self, draft: nn.Module, ttt_steps: int = 3, feed: str = "data", pad_id: int = 0) -> DraftLMForward:
        return DraftLMForward(draft)

    def unwrap(self, module: DraftLMForward) -> nn.Module:
        return module.model

    def step_logits(self, model: nn.Module, batch, k: int) -> list[torch.Tensor]:
        return lm_step_logits(model(batch.input_ids, batch.attention_mask), k)

    def loss(self, model: nn.Module, batch, cfg, weights: list[float], labels: torch.Tensor | None, draw_slots,
             chunk: int = 0):
        if batch.segments is not None:
            raise ValueError("a draft LM trains on one sequence a row; pass the batch unpacked")
        logits = model(batch.input_ids, batch.attention_mask)
        loss, acc, rows = losses.distill_loss(logits, batch.target_logp, batch.loss_mask, cfg.loss, labels)
        return loss, [loss.detach()], [acc], [s.argmax(-1) for s in lm_step_logits(logits.detach(), cfg.ttt_steps)], rows


class MTPMethod(MTPServing):
    """The target's own MTP layers (vLLM ``method="mtp"``, MiMo layout; docs/design.md, "MTP").

    Trained like an Eagle-3 head (the same TTT unroll and losses) on one hidden state, the body's
    pre-norm residual stream at layer L, over the full vocabulary through the policy's lm_head.
    """

    wrapper_prefix = "head."

    def init(self, target: str | Path, seed: int = 0, source: str | Path | None = None,
             draft_vocab: int | None = None) -> MTPHead:
        """``draft init``: the target's own MTP layers (``source``: an MTP draft dir's instead)."""
        if draft_vocab:
            raise DraftFormatError("an MTP draft predicts over the target's full vocabulary; drop --draft-vocab")
        return load_mtp(source if source is not None else target, target)

    def build(self, target: Path, target_model: nn.Module, cfg, train_seqs) -> MTPHead:
        """Pretraining's fresh MTP layers (seed ``cfg.seed``), the target's embed_tokens and lm_head."""
        head = head_from_target(target, fresh_seed=cfg.seed)
        self.refresh_shared(head, target_model)
        return head

    def load(self, draft_dir: str | Path, target_dir: str | Path) -> MTPHead:
        return load_mtp(draft_dir, target_dir)

    def export(self, draft: MTPHead, out: str | Path, target: str | Path, fmt: str | None = None,
               num_speculative_tokens: int = 3, meta: dict | None = None) -> Path:
        """Only the ``model.mtp_layers.*`` tensors (``fmt`` is Eagle-3's; ignored here)."""
        return export_mtp(draft, out, target, meta=meta)

    def vocab_ids(self, draft: MTPHead) -> torch.Tensor:
        return torch.arange(draft.cfg.vocab_size)

    def target_capture(self, policy: nn.Module, draft: MTPHead, temperature: float) -> TargetCapture:
        return TargetCapture(policy, list(draft.cfg.aux_layer_ids), None, temperature=temperature)

    def shared_policy_modules(self, draft: MTPHead) -> tuple[str, ...]:
        return ("input_embeddings", "output_embeddings")

    def refresh_shared(self, draft: MTPHead, policy: nn.Module) -> None:
        """vLLM's drafter uses the policy's embed_tokens and lm_head: so does the head, copied
        (no autograd path from the draft's loss into the policy)."""
        draft.copy_shared(policy.get_input_embeddings().weight.detach().float(),
                          policy.get_output_embeddings().weight.detach().float())

    def freeze_lm_head(self, draft: MTPHead) -> None:
        pass  # the policy's lm_head, frozen always

    def wrap(self, draft: nn.Module, ttt_steps: int = 3, feed: str = "data", pad_id: int = 0) -> Eagle3TTT:
        if not isinstance(draft, MTPHead):
            raise TypeError(f"method 'mtp' trains an MTPHead, got {type(draft).__name__}")
        return Eagle3TTT(draft, ttt_steps, feed, pad_id)

    def unwrap(self, module: Eagle3TTT) -> MTPHead:
        return module.head

    # the same unrolled forward and TTT loss as an Eagle-3 head
    step_logits = Eagle3Method.step_logits
    loss = Eagle3Method.loss
    packs = Eagle3Method.packs


def _bare(model: nn.Module) -> nn.Module:
    """The wrapped forward inside a DDP / DeepSpeed wrapper (which keep it at ``.module``)."""
    return getattr(model, "module", model)


EAGLE3 = Eagle3Method()
DRAFT_LM = DraftLMMethod()
MTP = MTPMethod()
DraftMethod = Eagle3Method | DraftLMMethod | MTPMethod


def method_for(what: str | nn.Module | DraftMethod | MethodServing) -> DraftMethod:
    """The method of a name ("eagle3", "draft_model"), of its serving facts (``drafts.serving``), of a
    draft module (bare or wrapped for training), or a method itself."""
    if isinstance(what, (Eagle3Method, DraftLMMethod, MTPMethod)):
        return what
    if isinstance(what, str):
        what = serving_for(what)  # an unknown name is refused there
    if isinstance(what, (Eagle3Serving, DraftLMServing, MTPServing)):
        return next(m for m in (EAGLE3, DRAFT_LM, MTP) if m.name == what.name)
    inner = _bare(what)
    if isinstance(getattr(inner, "head", inner), MTPHead):  # bare, or inside its TTT wrapper
        return MTP
    if isinstance(inner, (Eagle3Head, Eagle3TTT)):
        return EAGLE3
    if isinstance(inner, (PreTrainedModel, DraftLMForward)):
        return DRAFT_LM
    raise TypeError(f"no draft method for a {type(what).__name__}; pass an Eagle3Head, an HF draft LM, "
                    f"an MTPHead, one of them wrapped for training, or a method name ({', '.join(METHODS)})")


def method_of_format(fmt: str) -> DraftMethod:
    """The method that serves a checkpoint layout (``formats.detect_format``)."""
    return method_for(serving_of_format(fmt))


def method_of_dir(draft_dir: str | Path) -> DraftMethod:
    """The method of a draft directory, from its config."""
    return method_of_format(detect_format(read_hf_config(draft_dir)))
