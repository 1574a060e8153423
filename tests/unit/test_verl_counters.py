"""The rollout servers' speculative counters as online k reads them (pure: vLLM's per-request
record stands in as a plain object; the servers themselves are tests/integration/test_verl.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (pip install --no-deps verl==0.9.1)")

from draftadapt.integrations.verl import cpu  # noqa: E402
from draftadapt.integrations.verl.rollout import counters_to_acceptance  # noqa: E402


def request(per_step_accepted, per_step_drafted, k=5, detailed=True):
    hist = [0] * (k + 1)
    for j in per_step_accepted:
        hist[j] += 1
    return SimpleNamespace(histogram=hist, num_draft_tokens=sum(per_step_drafted),
                           per_step_drafted=list(per_step_drafted) if detailed else [])


def test_per_position_counts_from_each_requests_record():
    cpu.take_spec_counters()  # whatever an earlier test left
    # one request at k = 5 (accepted 2, then 5), one at k = 1 (its batch size drafted 1)
    cpu._tally(cpu._SpecStats(request([2, 5], [5, 5])))
    cpu._tally(cpu._SpecStats(request([1, 0, 1], [1, 1, 1])))
    acc, metrics = counters_to_acceptance([cpu.take_spec_counters()])
    assert acc.k == 5 and acc.drafts == 5 and acc.draft_tokens == 13
    # position i accepted where a verify step accepted more than i tokens
    assert acc.accepted_per_pos == [4, 2, 1, 1, 1]
    assert acc.drafted_per_pos == [5, 2, 2, 2, 2]
    assert acc.length == pytest.approx(1 + 9 / 5) and metrics["accept/length"] == pytest.approx(1 + 9 / 5)
    assert metrics["accept/requests"] == 2.0
    assert cpu.take_spec_counters()["requests"] == 0  # taken: reset


def test_servers_sum_and_a_missing_record_gives_no_per_position_counts():
    a = {"requests": 1, "drafts": 3, "accepted": 2, "verify_steps": 1, "length_sum": 3.0,
         "accepted_per_pos": [1, 1, 0], "drafted_per_pos": [1, 1, 1]}
    b = dict(a, accepted_per_pos=[1, 0, 0], accepted=1, length_sum=2.0)
    acc, m = counters_to_acceptance([a, b], k=3)
    assert acc.accepted_per_pos == [2, 1, 0] and acc.drafted_per_pos == [2, 2, 2] and acc.drafts == 2
    assert m["accept/length_per_request"] == 2.5
    cpu.take_spec_counters()
    cpu._tally(cpu._SpecStats(request([2], [3], k=3, detailed=False)))  # vLLM's summary record: no per-step drafts
    acc, m = counters_to_acceptance([cpu.take_spec_counters()])
    assert acc is None and m["accept/length"] == 3.0  # verl's figure still; online k gets no counts
    assert counters_to_acceptance([cpu.take_spec_counters()]) == (None, {})  # nothing finished
