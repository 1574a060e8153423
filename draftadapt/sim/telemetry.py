"""Reader for the per-step telemetry a draftadapt run writes (JSON lines), for calibration.

Format: one JSON object per line, one line per RL step, flat keys namespaced with '/'.
Every key is optional: a run logs what it measured, and the reader keeps the rest None.

    key                        unit     meaning
    step                       -        RL step index
    policy_version             -        policy version that generated the step's rollouts
    stage/prepare_s            s        weight sync into the rollout engine
    stage/gen_s                s        rollout generation (wall time of the generation stage; in an
                                        asynchronous run, of the generation beside the trainer)
    stage/exposed_gen_s        s        how long the trainer waited for rollouts (= gen_s when sync)
    stage/logprob_s            s        logprob forward(s) of the learner
    stage/train_s              s        policy update (forward + backward + optimizer)
    stage/adapt_s              s        draft side-trainer time spent in this step
    stage/rl_step_s            s        wall time of the whole RL step (the demo: from one policy
                                        version to the next, its measurement arms left out)
    accept/length              tokens   mean tokens per verify step, bonus included (1 + accepted/drafts)
    accept/pos_0 .. pos_{k-1}  -        P(draft positions 0..i all accepted) (vLLM per-position counters / drafts)
    accept/simulated_length    tokens   acceptance length computed offline from target and draft probabilities
    spec/k                     -        speculative tokens per step; 0 or absent = no speculation
    gen/tokens                 tokens   response tokens generated in the step (all sequences)
    gen/num_seqs               -        sequences generated in the step
    draft/version              -        draft version in the engine during the step
    swap/ms                    ms       generation pause of the last draft swap

Keys the reader does not know (e.g. a ``run`` label) are kept in ``StepRecord.extra``.
A sample lives in recipes/sim_telemetry_sample.jsonl:

    {"step": 3, "policy_version": 3, "stage/prepare_s": 2.0, "stage/gen_s": 88.1,
     "stage/logprob_s": 17.9, "stage/train_s": 31.2, "stage/adapt_s": 4.1,
     "accept/length": 2.7, "accept/pos_0": 0.8, "accept/pos_1": 0.55, "accept/pos_2": 0.35,
     "spec/k": 3, "gen/tokens": 20070400, "gen/num_seqs": 8192, "draft/version": 2,
     "swap/ms": 21.0}
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

class TelemetryError(ValueError):
    """A telemetry line that cannot mean what it says."""


def _logged(key: str):
    """A scalar field of StepRecord, read from and written to the telemetry key ``key``."""
    return field(default=None, metadata={"key": key})


@dataclass
class StepRecord:
    step: int | None = _logged("step")
    policy_version: int | None = _logged("policy_version")
    accept_length: float | None = _logged("accept/length")
    simulated_length: float | None = _logged("accept/simulated_length")
    k: int | None = _logged("spec/k")
    tokens: float | None = _logged("gen/tokens")
    num_seqs: int | None = _logged("gen/num_seqs")
    draft_version: int | None = _logged("draft/version")
    swap_ms: float | None = _logged("swap/ms")
    prepare_s: float | None = _logged("stage/prepare_s")
    gen_s: float | None = _logged("stage/gen_s")
    logprob_s: float | None = _logged("stage/logprob_s")
    train_s: float | None = _logged("stage/train_s")
    adapt_s: float | None = _logged("stage/adapt_s")
    exposed_gen_s: float | None = _logged("stage/exposed_gen_s")
    rl_step_s: float | None = _logged("stage/rl_step_s")
    accept_pos: list[float] | None = None  # [k] when logged, from accept/pos_0 .. pos_{k-1}
    extra: dict = field(default_factory=dict)

    @property
    def speculative(self) -> bool:
        return bool(self.k)

    @property
    def mean_response(self) -> float | None:
        if self.tokens is None or not self.num_seqs:
            return None
        return self.tokens / self.num_seqs


# telemetry key -> (StepRecord field, int or float), from the fields' own declarations
_HINTS = typing.get_type_hints(StepRecord)
_SCALARS = {
    f.metadata["key"]: (f.name, int if int in typing.get_args(_HINTS[f.name]) else float)
    for f in fields(StepRecord)
    if "key" in f.metadata
}


def parse_record(obj: dict, where: str = "telemetry") -> StepRecord:
    """One telemetry object -> StepRecord, checked."""
    if not isinstance(obj, dict):
        raise TelemetryError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    rec = StepRecord()
    pos: dict[int, float] = {}
    for key, value in obj.items():
        if key.startswith("accept/pos_"):
            try:
                pos[int(key.removeprefix("accept/pos_"))] = float(value)
            except (TypeError, ValueError):
                raise TelemetryError(f"{where}: {key}={value!r} is not a number") from None
            continue
        if key not in _SCALARS:
            rec.extra[key] = value
            continue
        if value is None:
            continue
        name, tp = _SCALARS[key]
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TelemetryError(f"{where}: {key}={value!r} is not a number") from None
        if not math.isfinite(number):
            raise TelemetryError(f"{where}: {key}={value!r} is not finite")
        if number < 0:
            raise TelemetryError(f"{where}: {key}={value} is negative; times, counts and lengths are >= 0")
        setattr(rec, name, int(number) if tp is int else number)
    if pos:
        missing = sorted(set(range(max(pos) + 1)) - set(pos))
        if missing:
            raise TelemetryError(f"{where}: accept/pos_* skips position(s) {missing}")
        rec.accept_pos = [pos[i] for i in range(len(pos))]
        if any(not 0 <= p <= 1 for p in rec.accept_pos):
            raise TelemetryError(f"{where}: accept/pos_* must lie in [0, 1], got {rec.accept_pos}")
        if rec.k is None:
            rec.k = len(rec.accept_pos)
        elif rec.k != len(rec.accept_pos):
            raise TelemetryError(
                f"{where}: spec/k={rec.k} but {len(rec.accept_pos)} accept/pos_* values; log one per position"
            )
        if rec.accept_length is None:
            rec.accept_length = 1.0 + sum(rec.accept_pos)
    for name, length in (("accept/length", rec.accept_length),
                         ("accept/simulated_length", rec.simulated_length)):
        if length is None:
            continue
        if length < 1.0:
            raise TelemetryError(f"{where}: {name}={length} is below 1 (the bonus token is always emitted)")
        if rec.k is not None and length > rec.k + 1 + 1e-6:
            raise TelemetryError(
                f"{where}: {name}={length} exceeds spec/k + 1 = {rec.k + 1}; "
                "a verify step emits at most k drafted tokens plus one"
            )
    return rec


def read_telemetry(path: str | Path) -> list[StepRecord]:
    """All records of a JSON-lines telemetry file (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise TelemetryError(f"telemetry file {path} does not exist")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TelemetryError(f"{where}: not JSON ({exc.msg}); one object per line expected") from None
        records.append(parse_record(obj, where))
    if not records:
        raise TelemetryError(f"telemetry file {path} holds no records")
    return records


def to_json(rec: StepRecord) -> dict:
    """StepRecord -> the flat telemetry object (only the fields that are set)."""
    out: dict = {}
    for key, (name, _) in _SCALARS.items():
        value = getattr(rec, name)
        if value is not None:
            out[key] = value
    for i, p in enumerate(rec.accept_pos or []):
        out[f"accept/pos_{i}"] = p
    out.update(rec.extra)
    return out
