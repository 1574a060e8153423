"""Draft losses: pure functions on tensors, with shape comments. No model code here.

Slot convention for Eagle-3 (vLLM's alignment; see ``drafts/eagle3.py``): slot t of the head
consumes token t + 1 and the target's aux hidden state at position t; training-time-test step i
at slot t predicts token t + i + 2, whose target distribution is the target's output at position
t + i + 1. ``target_logp[:, u]`` is log p(token u + 1 | tokens <= u) at the draft vocabulary's
ids, and ``loss_mask[:, u]`` says whether token u + 1 is a response token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftadapt.metrics.acceptance import shift_left


def forward_kl(draft_logits: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of KL(p || q), p the target restricted to the draft vocabulary.

    draft_logits: [..., Vd]; target_logp: [..., Vd] target log-probs at the draft vocab's ids
    (renormalised here, so KL = 0 exactly when the draft equals the restricted target);
    mask: [...] bool -> scalar.
    """
    return _masked_mean(_kl(draft_logits, target_logp), mask)


def _kl(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) at every position: [..., Vd], [..., Vd] -> [...]."""
    logp = torch.log_softmax(target_logp.float(), dim=-1)  # [..., Vd] restricted + renormalised
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)  # 0 log 0 = 0


def cross_entropy(draft_logits: torch.Tensor, target_draft_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -log q(sampled token); ids outside the draft vocab are -1 (skipped).

    draft_logits: [..., Vd]; target_draft_ids: [...] long draft ids or -1; mask: [...] bool -> scalar.
    """
    return _masked_mean(*_nll(draft_logits, target_draft_ids, mask))


def _nll(draft_logits: torch.Tensor, target_draft_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-log q(sampled token) at every position, and the mask less ids outside the draft vocab."""
    keep = mask & (target_draft_ids >= 0)
    nll = F.cross_entropy(
        draft_logits.float().reshape(-1, draft_logits.shape[-1]),
        target_draft_ids.clamp_min(0).reshape(-1),
        reduction="none",
    ).view(target_draft_ids.shape)
    return nll, keep


def _point_loss(kind: str, logits: torch.Tensor, target_logp: torch.Tensor, ids: torch.Tensor | None,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss at every position and the positions that count: [B, T] each."""
    if kind == "kl":
        return _kl(logits, target_logp), mask
    return _nll(logits, ids, mask)


def _check_kind(kind: str, ids: torch.Tensor | None, what: str) -> None:
    if kind not in ("kl", "ce"):
        raise ValueError(f"unknown draft loss {kind!r}; use 'kl' or 'ce'")
    if kind == "ce" and ids is None:
        raise ValueError(f"the 'ce' loss needs {what}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    # Sum over an empty mask is 0 with a zero gradient, not NaN: a batch whose sequences are all
    # shorter than the unroll depth must not poison the optimizer state.
    return (x * m).sum() / m.sum().clamp_min(1.0)


@torch.no_grad()
def row_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sequence, the mean of ``x`` over its masked positions: [B, T], [B, T] -> [B] (NaN where
    none: no loss was measured on that sequence)."""
    m = mask.to(x.dtype)
    n = m.sum(-1)
    return torch.where(n > 0, (x * m).sum(-1) / n.clamp_min(1.0), torch.full_like(n, float("nan")))


@torch.no_grad()
def segment_means(x: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`row_means` of a packed batch: per sequence ``segments`` names (0..n-1), the mean of
    ``x`` over its masked positions: [B, T] x 3 -> [n] (NaN where none)."""
    keep = mask & (segments >= 0)
    idx = segments[keep]
    total = x.new_zeros(n, dtype=torch.float32).index_add_(0, idx, x[keep].float())
    count = x.new_zeros(n, dtype=torch.float32).index_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))
    return torch.where(count > 0, total / count.clamp_min(1.0), torch.full_like(count, float("nan")))


def same_segment(segments: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] segment ids -> [B, T] bool: position t + n holds the same sequence as t (False past
    the row's end). A packed row's targets must not cross into the next sequence."""
    return shift_left(segments, n, -1) == segments


def ttt_targets(target_logp: torch.Tensor, loss_mask: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs and mask for TTT step ``step`` at every slot.

    target_logp: [B, T, Vd]; loss_mask: [B, T] -> ([B, T, Vd], [B, T]) shifted left by step + 1.
    """
    return shift_left(target_logp, step + 1, 0.0), shift_left(loss_mask, step + 1, False)


def step_mask(loss_mask: torch.Tensor, step: int, slots: torch.Tensor | None = None,
              slot_ok: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """The slots whose TTT step ``step`` has a target: [B, T] (``slots`` [B, M] for steps >= 1:
    [B, M]). The target of slot t at step i is token t + i + 2: inside the response, and inside the
    slot's own sequence when the batch is packed (``segments``)."""
    mask = shift_left(loss_mask, step + 1, False)
    if segments is not None:
        mask = mask & same_segment(segments, step + 1)
    if slots is not None and step > 0:
        mask = mask.gather(1, slots) & slot_ok
    return mask


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    step_weights: list[float],
    kind: str = "kl",
    target_draft_ids: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    slot_ok: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    seqs: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Eagle-3 training-time-test loss: a weighted sum over unrolled steps.

    step_logits: S tensors [B, T, Vd] from ``Eagle3Head.unroll`` (step i at slot t predicts token
    t + i + 2); target_logp: [B, T, Vd]; loss_mask: [B, T] bool; step_weights: S floats (EAGLE-3 /
    HASS use 0.8^i: later steps are harder and noisier); kind: "kl" (forward KL to the target
    distribution) or "ce" (cross-entropy on the sampled tokens, ``target_draft_ids`` [B, T] the
    draft id of token t + 1, -1 outside the draft vocab).
    ``slots`` [B, M] / ``slot_ok`` [B, M] bool: steps >= 1 ran at these positions only (their
    logits are [B, M, Vd]; ``slot_ok`` False marks filler slots), as ``Eagle3Head.unroll(slots=)``.
    ``segments`` [B, T] / ``seqs``: a packed batch (``CapturedBatch.packed``): a slot counts at a
    step only if its target lies in its own sequence, and the per-sequence losses are per segment.
    Returns (loss scalar, per-step losses, per-step top-1 agreement with the target's argmax,
    per-sequence loss of the first step [B or seqs], detached: what the replay buffer's priorities
    read).
    """
    _check_kind(kind, target_draft_ids, "target_draft_ids (the sampled tokens as draft ids)")
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    losses, accs, rows = [], [], None
    for i, logits in enumerate(step_logits):
        tgt, _ = ttt_targets(target_logp, loss_mask, i)
        mask = step_mask(loss_mask, i, slots, slot_ok, segments)
        ids = shift_left(target_draft_ids, i + 1, -1) if kind == "ce" else None
        if slots is not None and i > 0:
            tgt = tgt.gather(1, slots[..., None].expand(-1, -1, tgt.shape[-1]))
            ids = ids.gather(1, slots) if ids is not None else None
        point, counted = _point_loss(kind, logits, tgt, ids, mask)
        loss = _masked_mean(point, counted)
        if i == 0:
            rows = (row_means(point.detach(), counted) if segments is None
                    else segment_means(point.detach(), counted, segments, seqs))
        total = total + step_weights[i] * loss
        losses.append(loss.detach())
        accs.append(top1_agreement(logits, tgt, mask))
    return total, losses, accs, rows


class _ChunkedVocabLoss(torch.autograd.Function):
    """sum_n w_n * loss_n over rows n, loss_n the forward KL (or the CE) of the draft distribution
    softmax(h_n W^T) against row ``rows[n]`` of the target's log-probs, ``chunk`` rows at a time.

    A softmax loss differentiates to dL/dz = q - p (p the target distribution, renormalised over
    the draft vocabulary, q the draft's; a one-hot p for CE), so each chunk's gradients are formed in the forward, while its
    logits exist, and backward only scales them (the fused linear cross-entropy of Liger-Kernel):
    no [rows, Vd] tensor outlives its chunk and nothing is recomputed.
    h: [N, H]; weight: [Vd, H]; target_logp: [R, Vd]; rows: [N] long; labels: [N] draft ids (CE;
    -1 with w 0 where the token is outside the draft vocab) or None (KL); w: [N] float ->
    (loss scalar, per-row loss [N], draft argmax [N], target argmax [N]; the last three detached).
    """

    @staticmethod
    def forward(ctx, h, weight, target_logp, rows, labels, w, chunk: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = h.shape[0]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        point = torch.zeros(n, dtype=torch.float32, device=h.device)
        top = torch.zeros(n, dtype=torch.long, device=h.device)
        target_top = torch.zeros(n, dtype=torch.long, device=h.device)
        autocast = torch.is_autocast_enabled(h.device.type)
        # one cast for every chunk: under autocast F.linear and mm would each cast the weight again
        # (autocast caches casts only of weights that are trained), a [Vd, H] copy each time
        w_mm = weight.to(torch.get_autocast_dtype(h.device.type)) if autocast else weight
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            hc = h[s:e]
            # in place where it can be: about 3 [c, Vd] float32 tensors live at once
            z = F.linear(hc, w_mm).float()  # [c, Vd]
            top[s:e] = z.argmax(-1)
            logq = z.sub_(z.logsumexp(-1, keepdim=True))
            tgt = target_logp[rows[s:e]].float()  # [c, Vd], a copy (indexed)
            target_top[s:e] = tgt.argmax(-1)
            if labels is None:
                logp = tgt.sub_(tgt.logsumexp(-1, keepdim=True))  # restricted + renormalised, as _kl
                p = logp.exp()
                kl = logp.sub_(logq).mul_(p).masked_fill_(p == 0, 0.0)  # 0 log 0 = 0
                point[s:e] = kl.sum(-1)
                del kl, logp, tgt
                g = logq.exp_().sub_(p) if need_h or need_w else None  # dL/dz = q - p [c, Vd]
                del p
            else:
                del tgt
                lab = labels[s:e].clamp_min(0)[:, None]
                point[s:e] = -logq.gather(-1, lab).squeeze(-1)
                g = logq.exp_().scatter_add_(-1, lab, -torch.ones_like(lab, dtype=logq.dtype)) \
                    if need_h or need_w else None  # dL/dz = q - onehot
            if g is not None:
                wc = w[s:e, None].float()  # d(w * loss)/dz = w g: w scales the [c, H] sides, not g
                if need_h:
                    grad_h[s:e] = torch.mm(g, w_mm if autocast else weight.to(g.dtype)).mul_(wc)
                if need_w:
                    if autocast:  # the matmul in the autocast dtype, summed in float32
                        grad_w += torch.mm(g.t(), hc.to(g.dtype) * wc)
                    else:
                        grad_w.addmm_(g.t(), hc.to(g.dtype) * wc)
            del logq, g
        ctx.grads = (grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(point, top, target_top)
        return (point * w.float()).sum(), point, top, target_top

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("the chunked draft-vocab loss keeps its gradients for one backward; "
                               "run the forward again instead of backward(retain_graph=True)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss.float()).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None


def ttt_loss_chunked(
    step_features: list[torch.Tensor], lm_weight: torch.Tensor, target_logp: torch.Tensor, loss_mask: torch.Tensor,
    step_weights: list[float], kind: str = "kl", target_draft_ids: torch.Tensor | None = None,
    slots: torch.Tensor | None = None, slot_ok: torch.Tensor | None = None, segments: torch.Tensor | None = None,
    seqs: int = 0, chunk: int = 1024,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """:func:`ttt_loss` with lm_head applied inside the loss, ``chunk`` rows at a time: the same
    value and gradients (tests/unit/test_chunked_loss.py), without a [tokens, Vd] tensor per step.

    step_features: S tensors [B, T or M, H], what lm_head reads (``Eagle3Head.unroll(features=True)``);
    lm_weight: [Vd, H]. Only the slots with a target at a step are computed (the others weigh 0 in
    :func:`ttt_loss` too), and their target rows are read from ``target_logp`` [B, T, Vd] in place.
    Returns :func:`ttt_loss`'s four values and per step the draft's argmax [B, T or M] (0 where the
    step has no target), what the simulated acceptance reads.
    """
    _check_kind(kind, target_draft_ids, "target_draft_ids (the sampled tokens as draft ids)")
    b, t = loss_mask.shape
    dev = loss_mask.device
    flat_logp = target_logp.reshape(b * t, -1)
    feats, rows, labels, weights, where = [], [], [], [], []
    for i, feat in enumerate(step_features):
        mask = step_mask(loss_mask, i, slots, slot_ok, segments)  # [B, L]
        pos = slots if slots is not None and i > 0 else torch.arange(t, device=dev).expand(b, t)
        bi, li = mask.nonzero(as_tuple=True)
        src = bi * t + pos[bi, li] + i + 1  # the target row of slot (bi, li): token pos + i + 2
        lab = target_draft_ids.reshape(-1)[src] if kind == "ce" else None
        counted = lab >= 0 if lab is not None else torch.ones_like(bi, dtype=torch.bool)
        feats.append(feat[bi, li])
        rows.append(src)
        labels.append(lab)
        weights.append(counted.float() * step_weights[i] / counted.sum().clamp_min(1).float())
        where.append((mask, bi, li, counted))
    total, point, top, target_top = _ChunkedVocabLoss.apply(
        torch.cat(feats), lm_weight, flat_logp, torch.cat(rows), torch.cat(labels) if kind == "ce" else None,
        torch.cat(weights), chunk)
    sizes = [len(bi) for _, bi, _, _ in where]
    losses, accs, draft_ids, rows_out = [], [], [], None
    for i, (p, d, tt, (mask, bi, li, counted)) in enumerate(zip(point.split(sizes), top.split(sizes),
                                                                target_top.split(sizes), where)):
        c = counted.float()
        losses.append((p * c).sum() / c.sum().clamp_min(1.0))
        accs.append((d == tt).float().sum() / max(len(bi), 1))
        draft_ids.append(torch.zeros(mask.shape, dtype=torch.long, device=dev).index_put_((bi, li), d))
        if i == 0:
            full = torch.zeros(b, t, dtype=torch.float32, device=dev).index_put_((bi, li), p)
            keep = torch.zeros(b, t, dtype=torch.bool, device=dev).index_put_((bi, li), counted)
            rows_out = row_means(full, keep) if segments is None else segment_means(full, keep, segments, seqs)
    return total, losses, accs, rows_out, draft_ids


def distill_loss(
    draft_logits: torch.Tensor, target_logp: torch.Tensor, loss_mask: torch.Tensor, kind: str = "kl",
    target_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small draft LM distillation: position t predicts token t + 1, teacher-forced.

    draft_logits: [B, T, V]; target_logp: [B, T, V]; loss_mask: [B, T] bool; kind "kl" or "ce"
    (``target_ids`` [B, T] = token t + 1). Returns (loss, top-1 agreement with the target,
    per-sequence loss [B], detached).
    """
    _check_kind(kind, target_ids, "target_ids (the sampled next tokens)")
    point, counted = _point_loss(kind, draft_logits, target_logp, target_ids, loss_mask)
    return (_masked_mean(point, counted), top1_agreement(draft_logits, target_logp, loss_mask),
            row_means(point.detach(), counted))


@torch.no_grad()
def top1_agreement(draft_logits: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of masked positions where argmax q == argmax p. [..., V], [..., V], [...] -> scalar."""
    same = (draft_logits.argmax(-1) == target_logp.argmax(-1)).float()
    return _masked_mean(same, mask)


def step_weights(steps: int, decay: float) -> list[float]:
    """[decay^0, decay^1, ...]: the EAGLE-3 / HASS TTT weighting (decay 0.8)."""
    return [decay**i for i in range(steps)]
