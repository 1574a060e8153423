"""The telemetry reader: the documented format, missing keys, bad lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftadapt.sim.telemetry import TelemetryError, parse_record, read_telemetry, to_json

SAMPLE = Path(__file__).resolve().parents[2] / "recipes" / "sim_telemetry_sample.jsonl"


def test_sample_file_reads_and_logs_every_documented_key():
    records = read_telemetry(SAMPLE)
    assert len(records) == 16
    keys = set().union(*(to_json(r) for r in records))
    documented = {"step", "policy_version", "stage/prepare_s", "stage/gen_s", "stage/logprob_s",
                  "stage/train_s", "stage/adapt_s", "accept/length", "accept/pos_0", "accept/pos_1",
                  "accept/pos_2", "accept/simulated_length", "spec/k", "gen/tokens", "gen/num_seqs",
                  "draft/version", "swap/ms"}
    assert documented <= keys
    spec = [r for r in records if r.speculative]
    assert all(r.accept_length == pytest.approx(1 + sum(r.accept_pos), abs=1e-3) for r in spec)
    assert {r.draft_version for r in spec} == {0, 1, 2}  # adapted twice


def test_missing_keys_stay_none():
    rec = parse_record({"step": 3, "stage/gen_s": 80.0})
    assert rec.gen_s == 80.0 and rec.train_s is None and rec.k is None
    assert not rec.speculative and rec.mean_response is None


def test_positions_give_k_and_the_length():
    rec = parse_record({"accept/pos_0": 0.8, "accept/pos_1": 0.5, "accept/pos_2": 0.3})
    assert rec.k == 3 and rec.accept_length == pytest.approx(2.6)


def test_unknown_keys_are_kept():
    rec = parse_record({"run": "rl-zero/plain", "stage/gen_s": 100.0})
    assert rec.extra == {"run": "rl-zero/plain"}
    assert to_json(rec)["run"] == "rl-zero/plain"


@pytest.mark.parametrize("obj,fragment", [
    ({"stage/gen_s": -1.0}, "negative"),
    ({"stage/gen_s": "fast"}, "not a number"),
    ({"spec/k": 3, "accept/length": 4.5}, "exceeds spec/k + 1 = 4"),
    ({"accept/length": 0.7}, "below 1"),
    ({"accept/pos_0": 0.8, "accept/pos_2": 0.3}, "skips position(s) [1]"),
    ({"spec/k": 2, "accept/pos_0": 0.8, "accept/pos_1": 0.5, "accept/pos_2": 0.3}, "spec/k=2 but 3"),
    ({"accept/pos_0": 1.2}, "must lie in [0, 1]"),
])
def test_bad_values_are_rejected(obj, fragment):
    with pytest.raises(TelemetryError, match=None) as info:
        parse_record(obj, "t.jsonl:1")
    assert fragment in str(info.value) and "t.jsonl:1" in str(info.value)


def test_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n\n{not json}\n")
    with pytest.raises(TelemetryError, match=r"t.jsonl:3: not JSON"):
        read_telemetry(path)


def test_empty_or_missing_file(tmp_path):
    with pytest.raises(TelemetryError, match="does not exist"):
        read_telemetry(tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(TelemetryError, match="holds no records"):
        read_telemetry(tmp_path / "e.jsonl")


def test_round_trip():
    obj = {"step": 3, "policy_version": 3, "stage/prepare_s": 2.0, "stage/gen_s": 88.1,
           "accept/length": 2.7, "accept/pos_0": 0.8, "accept/pos_1": 0.55, "accept/pos_2": 0.35,
           "spec/k": 3, "gen/tokens": 123456, "gen/num_seqs": 512, "draft/version": 2, "swap/ms": 21.0}
    assert to_json(parse_record(obj)) == obj


def test_the_demos_async_stages_are_read():
    """The demo's async rows (docs/design.md "The demo's step on shared cores")."""
    obj = {"step": 2, "stage/gen_s": 3.6, "stage/exposed_gen_s": 0.0, "stage/train_s": 5.3,
           "stage/adapt_s": 0.3, "stage/rl_step_s": 5.8, "async/trainer_version": 1.0,
           "async/rollout_version": 0.0}
    rec = parse_record(obj)
    assert rec.exposed_gen_s == 0.0 and rec.rl_step_s == 5.8
    assert rec.extra == {"async/trainer_version": 1.0, "async/rollout_version": 0.0}
    assert to_json(rec) == obj
    demo = read_telemetry(Path(__file__).resolve().parents[2] / "recipes" / "demo_async_telemetry.jsonl")
    assert all(r.rl_step_s > 0 and r.exposed_gen_s is not None for r in demo)
