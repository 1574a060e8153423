"""The demo's and the TRL recipe's whole-run block: the dip and the mean over every step."""

from __future__ import annotations

import math

import pytest

from draftadapt.rl.summary import whole_run


def test_whole_run_block_from_per_step_acceptance():
    adapted = [3.2, 2.8, float("nan"), 2.4, 3.6]  # a step where nothing was drafted is left out
    frozen = [3.2, 2.8, 2.9, 2.4, 2.4]
    w = whole_run(adapted, frozen, [False, False, False, True, False])
    assert w["adapted_mean"] == pytest.approx(12.0 / 4, rel=1e-12)
    assert w["frozen_mean"] == pytest.approx(10.8 / 4, rel=1e-12)
    assert w["adapted_over_frozen"] == pytest.approx(12.0 / 10.8, rel=1e-12)
    assert w["adapted_worst_over_start"] == pytest.approx(2.4 / 3.2, rel=1e-12)
    assert w["adapted_retention"] == pytest.approx(3.0 / 3.2, rel=1e-12)
    assert w["first_publish_step"] == 4  # steps count from 1


def test_whole_run_without_a_publish_or_a_measured_step():
    assert whole_run([3.0, 2.0], [3.0, 2.5], [False, False])["first_publish_step"] is None
    assert whole_run([math.nan], [math.nan], [True]) == {}
