"""What crosses between draftadapt's trainer and verl's actor for the hand-over, and what comes
back from verl's rollout workers: plain data and pure functions (no verl, no Ray), so they are
tested without either.

- :class:`HandOverRequest`: what the adapter asks verl's log-prob forward to keep (its aux
  layers, vocabulary, temperature, how many rows per data-parallel rank, the policy tensors its
  draft shares), put in the log-prob batch's ``extra_info`` under :data:`REQUEST`;
- :func:`gather`: the rows every actor rank handed over, matched to the rollouts verl trained
  on by their tokens, as one :class:`~draftadapt.capture.hidden.HandedOver`;
- :func:`served`: each rollout worker's served draft version and the skew between them;
- :func:`weight_sync_path`: which receive path a policy sync takes in the rollout worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

# the key of the adapter's request in a log-prob batch (verl's non-tensor batch data)
REQUEST = "draftadapt_handover"
# the vendor draftadapt's FSDP engine is registered under in verl's engine registry; verl selects
# it with VERL_ENGINE_VENDOR=draftadapt (``EngineRegistry.get_engine_cls``)
VENDOR = "draftadapt"
# what a draft may share with the policy, by the HF accessor that finds it
SHARED = ("input_embeddings", "output_embeddings")


@dataclass
class HandOverRequest:
    """What verl's log-prob forward keeps for the adapter (module docstring)."""

    aux_layer_ids: list[int]  # the draft's aux layers (vLLM's numbering; capture/hidden.py)
    draft_to_target: list[int] | None  # the draft vocabulary's target ids; None: the whole vocabulary
    temperature: float  # the rollout's sampling temperature: log-probs of softmax(logits / T)
    store: str = "logp"  # AdapterConfig.handover_store
    rows_per_rank: int | None = None  # rows each data-parallel rank keeps (chosen at random); None: all
    seed: int = 0  # draws which rows; the trainer sets the step
    shared: list[str] = field(default_factory=list)  # of SHARED: policy tensors the draft reads

    def __post_init__(self):
        bad = [s for s in self.shared if s not in SHARED]
        if bad:
            raise ValueError(f"hand-over request: shared {bad}; name among {list(SHARED)}")
        if self.rows_per_rank is not None and self.rows_per_rank < 1:
            raise ValueError(f"hand-over request: rows_per_rank={self.rows_per_rank}; at least 1, or None for all")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HandOverRequest":
        return cls(**d)


def rows_per_rank(rows: int | None, dp_size: int) -> int | None:
    """``+draftadapt.handover_rows`` (a step's total; None: every rollout) spread over the ranks."""
    if rows is None:
        return None
    if rows < 1:
        raise ValueError(f"+draftadapt.handover_rows={rows}: at least 1 (or leave it out: every rollout)")
    return -(-rows // max(1, dp_size))


def gather(payloads: Sequence[dict[str, Any]], rollouts: Sequence[tuple[list[int], list[int]]]):
    """The rows each actor rank handed over (``{"tokens", "handover", "dp_rank"}`` each, as
    verl's engine put them), matched by their tokens to the (prompt ids, response ids) verl
    trained on. Returns (the rollouts handed over, one HandedOver numbering them 0..n-1).

    A row whose tokens are none of the step's rollouts is refused (ValueError): it is not what
    verl sampled and trained on (another step's batch, or a changed prompt)."""
    from draftadapt.capture.hidden import HandedOver

    by_tokens = {tuple(p) + tuple(r): (list(p), list(r)) for p, r in rollouts}
    out_rollouts: list[tuple[list[int], list[int]]] = []
    merged = HandedOver()
    for pl in sorted(payloads, key=lambda p: p["dp_rank"]):
        ho = pl["handover"]
        for i, tokens in enumerate(pl["tokens"]):
            hit = by_tokens.get(tuple(tokens))
            if hit is None:
                raise ValueError(f"hand-over: row {i} of actor rank {pl['dp_rank']} ({len(tokens)} tokens) is none of "
                                 f"this step's {len(rollouts)} rollouts; the log-prob batch and the trained batch "
                                 "must be the same rollouts")
            if i not in ho.rows:
                raise ValueError(f"hand-over: actor rank {pl['dp_rank']} names row {i} but handed over no tensors for it")
            merged.rows[len(out_rollouts)] = ho.rows[i]
            out_rollouts.append(hit)
        merged.seconds += ho.seconds
        merged.lm_head = merged.lm_head or ho.lm_head
        merged.shared.update(ho.shared)
    return out_rollouts, merged


def served(workers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each rollout worker's report (``replica``, ``rank``, ``version``) -> the served draft
    version per worker (``r{replica}w{rank}``), how many workers answered, and the skew (newest -
    oldest served version; a worker serving no version of the store counts as version 0)."""
    versions = {f"r{w['replica']}w{w['rank']}": w.get("version") for w in workers}
    known = [0 if v is None else int(v) for v in versions.values()]
    return {"versions": versions, "workers": len(versions), "skew": (max(known) - min(known)) if known else 0}


def weight_sync_path(cpu: bool, lora: bool, qat: bool) -> str:
    """Which receive path a policy sync takes in the rollout worker: "layerwise" (draftadapt's:
    vLLM's plain ``load_weights`` fails on the CPU's repacked weights) or "verl" (verl's own,
    untouched: on every accelerator, with its CUDA-IPC remapping and MTP-drafter sync, and for
    LoRA or QAT syncs, which verl prepares itself)."""
    return "layerwise" if cpu and not lora and not qat else "verl"
