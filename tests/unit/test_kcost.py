"""The k-choice cost model (draftadapt/metrics/kcost.py): pure functions, no engine."""

from __future__ import annotations

import pytest

from draftadapt.metrics.kcost import (
    StepCostModel,
    acceptance_length_at,
    best_k_per_batch,
    choose_k,
    fit_ks,
    fit_step_costs,
    predicted_tokens_per_s,
    step_cost,
    step_seconds,
)


def true_cost(k: int, b: int) -> float:
    """A CPU-like step: 2 ms + 0.1 ms per sequence plain; speculation adds 1 ms + 0.02 ms/seq,
    and each draft token 0.3 ms + 0.1 ms/seq (verifying k+1 tokens costs k+1 plain ones per sequence)."""
    c = 2e-3 + 1e-4 * b
    if k:
        c += 1e-3 + 2e-5 * b + k * (3e-4 + 1e-4 * b)
    return c


def test_fit_ks_takes_plain_and_the_ends():
    assert fit_ks([0, 1, 2, 3, 4, 5]) == [0, 1, 5]
    assert fit_ks([5, 3, 0]) == [0, 3, 5]
    assert fit_ks([0, 2]) == [0, 2]
    assert fit_ks([2, 4]) == [2, 4]


def test_fit_recovers_the_model_from_three_ks_and_predicts_the_rest():
    bss = [8, 32, 128]
    model = fit_step_costs([(k, b, true_cost(k, b)) for k in fit_ks([0, 1, 2, 3, 4, 5]) for b in bss])
    assert model.batch_sizes == bss
    for b in bss:
        for k in range(6):
            assert step_cost(model, k, b) == pytest.approx(true_cost(k, b), rel=1e-9)
    # between and past the measured batch sizes the (here affine) coefficients interpolate exactly
    for b in (4, 16, 64, 256):
        assert step_cost(model, 3, b) == pytest.approx(true_cost(3, b), rel=1e-9)


def test_fit_is_least_squares_in_relative_error():
    # four k at one batch size, one of them 10% off: the fit spreads it, it does not chase it
    pts = [(k, 32, true_cost(k, 32) * (1.1 if k == 2 else 1.0)) for k in (0, 1, 2, 3)]
    model = fit_step_costs(pts)
    assert step_cost(model, 0, 32) == pytest.approx(true_cost(0, 32), rel=1e-9)  # plain is its own column
    errs = [step_cost(model, k, 32) / true_cost(k, 32) - 1 for k in (1, 2, 3)]
    assert 0 < errs[1] < 0.1 and max(abs(e) for e in errs) < 0.1


def test_fit_with_one_speculative_k_is_exact_where_measured():
    model = fit_step_costs([(0, 4, 0.01), (2, 4, 0.03), (0, 8, 0.02), (2, 8, 0.05)])
    assert step_cost(model, 0, 4) == pytest.approx(0.01) and step_cost(model, 2, 4) == pytest.approx(0.03)
    assert step_cost(model, 2, 8) == pytest.approx(0.05) and step_cost(model, 2, 6) == pytest.approx(0.04)


def test_a_speculative_step_timed_below_the_plain_one_costs_the_plain_one():
    """A loaded machine timed k=1 and k=3 at 8 sequences below the plain step (CI: an 8-token
    calibration with one repeat); the fit's negative speculative part is held at zero, so a draft
    that accepts nothing never pays and one that accepts 2% more per step does not beat the 3%
    margin (the k chosen under the old, unfloored cost was 1 at every batch size)."""
    model = fit_step_costs([(0, 8, 0.020), (1, 8, 0.017), (3, 8, 0.019), (0, 1, 0.010), (1, 1, 0.009),
                            (3, 1, 0.0095)])
    for b in (1, 4, 8):
        assert step_cost(model, 0, b) == pytest.approx(step_cost(model, 1, b), rel=1e-12)
        assert all(step_cost(model, k, b) >= step_cost(model, 0, b) for k in (1, 2, 3))
    assert best_k_per_batch(model, [0.0, 0.0, 0.0], 8) == [0] * 8
    assert best_k_per_batch(model, [0.02, 0.0, 0.0], 8, margin=0.03) == [0] * 8
    # a draft that accepts half its first token still pays where the step is that cheap
    assert best_k_per_batch(model, [0.5, 0.25, 0.1], 8, margin=0.03) != [0] * 8
    # a positive speculative part is untouched
    assert step_cost(fit_step_costs([(0, 4, 0.01), (2, 4, 0.03)]), 2, 4) == pytest.approx(0.03)


def test_fit_errors_name_the_missing_measurement():
    with pytest.raises(ValueError, match="batch size 8 has no k=0"):
        fit_step_costs([(2, 8, 0.05)])
    with pytest.raises(ValueError, match="seconds > 0"):
        fit_step_costs([(0, 8, 0.0)])
    with pytest.raises(ValueError, match="no step-cost points"):
        fit_step_costs([])


def test_acceptance_at_k_is_the_first_k_positions_of_a_longer_draft():
    rates = [0.9, 0.7, 0.5, 0.3, 0.1]  # P(positions 0..i all accepted), as vLLM counts them
    assert acceptance_length_at(rates, 0) == 1.0
    assert acceptance_length_at(rates, 1) == pytest.approx(1.9)
    assert acceptance_length_at(rates, 3) == pytest.approx(3.1)
    assert acceptance_length_at(rates, 5) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="measured at k >= 6"):
        acceptance_length_at(rates, 6)


def test_step_seconds_inverts_tokens_per_s():
    # 32 sequences, 2.5 tokens per step each, 1000 tokens/s -> 80 ms per step
    assert step_seconds(32, 1000.0, 2.5) == pytest.approx(0.08)
    model = fit_step_costs([(0, 32, 0.032), (3, 32, 0.08)])
    assert predicted_tokens_per_s(model, 3, 32, 2.5) == pytest.approx(1000.0)
    assert predicted_tokens_per_s(model, 0, 32, 1.0) == pytest.approx(1000.0)


def test_the_choice_falls_with_batch_size_on_a_compute_bound_target():
    rates = [0.9, 0.8, 0.7, 0.6, 0.5]
    model = fit_step_costs([(k, b, true_cost(k, b)) for k in (0, 1, 5) for b in (8, 32, 128)])
    table = {(k, b): predicted_tokens_per_s(model, k, b, acceptance_length_at(rates, k))
             for k in range(6) for b in (8, 32, 128)}
    choice = choose_k(table)
    assert set(choice) == {8, 32, 128}
    for b, k in choice.items():
        assert table[(k, b)] == max(table[(j, b)] for j in range(6))
    assert choice[8] > choice[32] >= choice[128]  # more sequences: verification costs more
    assert choice[128] == 0  # ~k+1 plain steps per verify at 128 sequences: speculation loses


def test_choose_k_ties_go_to_the_smaller_k_and_missing_cells_are_skipped():
    assert choose_k({(0, 8): 100.0, (2, 8): 100.0, (3, 8): None}) == {8: 0}
    assert choose_k({(0, 8): 100.0, (2, 8): 120.0, (0, 32): 300.0, (2, 32): 250.0}) == {8: 2, 32: 0}


def test_model_to_dict_names_the_coefficients():
    m = StepCostModel([8], [0.01], [0.002], [0.003])
    assert m.to_dict() == {"batch_sizes": [8], "plain_s": [0.01], "spec_fixed_s": [0.002], "per_k_s": [0.003]}
