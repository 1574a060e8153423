"""Online k (draftadapt/online_k.py, metrics/kcost.py): the choice per batch size and its
update from per-position counters. Pure: no engine (tests/integration/test_online_k.py runs one)."""

from __future__ import annotations

import math

import pytest

from draftadapt.config import ConfigError
from draftadapt.metrics.acceptance import AcceptanceStats
from draftadapt.metrics.kcost import (
    as_schedule,
    best_k_per_batch,
    fit_step_costs,
    k_at,
    predicted_tokens_per_s,
    StepCostModel,
    step_cost,
    acceptance_length_at,
)
from draftadapt.online_k import OnlineK, OnlineKConfig, schedule_text


def true_cost(k: int, b: int) -> float:
    """The CPU-like step of tests/unit/test_kcost.py: verifying k + 1 tokens costs k + 1 plain
    ones per sequence, so longer drafts pay at small batches only."""
    c = 2e-3 + 1e-4 * b
    if k:
        c += 1e-3 + 2e-5 * b + k * (3e-4 + 1e-4 * b)
    return c


BSS = [1, 8, 32, 64]
MODEL = fit_step_costs([(k, b, true_cost(k, b)) for k in (0, 1, 5) for b in BSS])


def brute_force(rates: list[float], b: int) -> int:
    tps = {k: predicted_tokens_per_s(MODEL, k, b, acceptance_length_at(rates, k)) for k in range(len(rates) + 1)}
    return max(tps, key=lambda k: (tps[k], -k))


def test_best_k_is_the_argmax_of_the_prediction_at_every_batch_size():
    rates = [0.9, 0.8, 0.7, 0.55, 0.4]
    ks = best_k_per_batch(MODEL, rates, 64)
    assert len(ks) == 64
    assert ks == [brute_force(rates, b) for b in range(1, 65)]
    # a compute-bound target: long drafts at one sequence, shorter as the batch grows
    assert ks[0] >= 3 and ks[-1] < ks[0]
    assert all(a >= b for a, b in zip(ks, ks[1:]))


def test_speculation_is_turned_off_where_it_does_not_pay():
    ks = best_k_per_batch(MODEL, [0.3, 0.1, 0.05, 0.0, 0.0], 64)
    assert ks[-1] == 0  # a weak draft at 64 sequences: no draft beats verifying it
    assert best_k_per_batch(MODEL, [0.99] * 5, 64)[-1] > 0  # a strong one still pays there
    # rates a k_max engine never reached (nan: a table that never drafted that far) count as 0
    assert best_k_per_batch(MODEL, [0.9, float("nan"), float("nan")], 1) == [1]


def test_a_longer_draft_must_beat_the_shorter_ones_by_the_margin():
    rates = [0.9, 0.8, 0.7, 0.55, 0.4]
    plain = best_k_per_batch(MODEL, rates, 64)
    cautious = best_k_per_batch(MODEL, rates, 64, margin=0.03)
    assert all(c <= p for c, p in zip(cautious, plain)) and cautious != plain
    for b, k in enumerate(cautious, start=1):
        tps = [predicted_tokens_per_s(MODEL, j, b, acceptance_length_at(rates, j)) for j in range(6)]
        assert tps[k] >= max(tps) / 1.03 ** 5  # never far from the best
        # every longer k that the margin passed over gains less than 3% over the chosen one
        assert all(tps[j] <= tps[k] * 1.03 for j in range(k + 1, 6)) or k == 0


def test_where_the_plain_step_extrapolates_to_no_cost_the_last_covered_choice_holds():
    """Calibrated at batch 1 and 4 on a loaded machine, the plain step's line fell to zero past
    batch ~61 while the drafted ones stayed positive, and k=1 was chosen there by default (a
    margin of 10 stood for a draft that pays nowhere). Past the model's reach the k of the last
    batch size it still covers holds."""
    noisy = StepCostModel(batch_sizes=[1, 4], plain=[2e-3, 1.9e-3], fixed=[1e-3, 1.2e-3], per_k=[3e-4, 4e-4])
    assert step_cost(noisy, 0, 64) <= 0 < step_cost(noisy, 1, 64)
    assert best_k_per_batch(noisy, [0.05] * 3, 64, margin=10.0) == [0] * 64


def test_k_max_caps_the_choice_and_needs_the_rates():
    assert max(best_k_per_batch(MODEL, [0.99] * 5, 8, k_max=2)) <= 2
    with pytest.raises(ValueError, match="k_max=6"):
        best_k_per_batch(MODEL, [0.9] * 5, 8, k_max=6)


# Measured (vLLM, 64 sequences, the seed-2 toy's final policy and adapted head, 96 tokens): ms
# per step at k = 0..4, and the head's per-position rates. The step cost is convex in k here.
STEPS_64 = {0: 20.185, 1: 31.085, 2: 36.398, 3: 43.909, 4: 54.095}
RATES_64 = [0.9331, 0.8457, 0.7855, 0.6108]


def test_the_cost_curves_in_k_where_five_lengths_were_measured():
    curved = fit_step_costs([(k, 64, ms / 1000) for k, ms in STEPS_64.items()])
    assert curved.per_k2 is not None and curved.per_k2[0] > 0
    for k, ms in STEPS_64.items():  # the fit follows every measured length to within 1%
        assert step_cost(curved, k, 64) * 1000 == pytest.approx(ms, rel=0.01)
    # three lengths: a line in k, as before; it over-prices k = 2 and 3 by about 6%, and with
    # these rates picks k = 4 where k = 3 measured fastest (5159 tokens/s against 4848)
    line = fit_step_costs([(k, 64, STEPS_64[k] / 1000) for k in (0, 1, 4)])
    assert line.per_k2 is None and step_cost(line, 3, 64) * 1000 == pytest.approx(46.42, abs=0.05)
    assert best_k_per_batch(line, RATES_64, 64, 4)[63] == 4
    assert best_k_per_batch(curved, RATES_64, 64, 4)[63] == 3
    assert curved.to_dict()["per_k2_s"] == curved.per_k2 and "per_k2_s" not in line.to_dict()
    # a concave fit (here: k = 2 and 3 measured slow) is noise, not a cost curve: the line instead
    noisy = {**STEPS_64, 2: 40.0, 3: 48.0}
    flat = fit_step_costs([(k, 64, ms / 1000) for k, ms in noisy.items()])
    assert flat.per_k2 is None and step_cost(flat, 0, 64) * 1000 == pytest.approx(20.185, rel=1e-6)


def test_schedule_ranges_and_lookup_match_vllm():
    ks = [5, 5, 4, 4, 4, 2, 0, 0]
    sched = as_schedule(ks)
    assert sched == [(1, 2, 5), (3, 5, 4), (6, 6, 2), (7, 8, 0)]
    assert [k_at(sched, b) for b in range(1, 9)] == ks
    assert k_at(sched, 100) == 0  # past the last range: its k (vLLM carries it to max_num_seqs)
    assert k_at([(1, 4, 3), (9, 16, 1)], 6) == 3  # a gap carries the previous k, as vLLM's table
    assert schedule_text(sched) == "1-2:5 3-5:4 6:2 7-8:0"


def stats(accepted, drafted, drafts):
    return AcceptanceStats(len(accepted), drafts, list(accepted), sum(drafted), list(drafted))


def test_rates_count_only_the_drafts_that_reached_each_position():
    # 100 drafts at k=3 and 100 at k=1 (a table that changed k between batch sizes)
    s = stats([80 + 85, 60, 50], [200, 100, 100], 200)
    assert s.reached_rates == pytest.approx([0.825, 0.6, 0.5])
    assert s.per_position == pytest.approx([0.825, 0.3, 0.25])  # what under-counts the later positions
    assert s.length == pytest.approx(1 + (165 + 60 + 50) / 200)  # tokens per verify step: unchanged
    # one k for every draft: drafted_per_pos may be absent, and then the two rates agree
    fixed = AcceptanceStats(3, 100, [80, 60, 50])
    assert fixed.reached_rates == fixed.per_position
    both = fixed + s
    assert both.drafted_per_pos == [300, 200, 200] and both.reached_rates[1] == pytest.approx(120 / 200)
    assert (both - s).drafted_per_pos == [100, 100, 100]
    assert math.isnan(AcceptanceStats(2, 0, [0, 0]).reached_rates[0])


class RecordingEngine:
    """What OnlineK.update touches of an engine: the table it serves, set in place."""

    def __init__(self, schedule):
        self.k_schedule = schedule
        self.sets = []

    def set_k_schedule(self, schedule):
        self.sets.append(schedule)
        self.k_schedule = schedule


def test_update_folds_counts_in_and_writes_the_table_only_when_it_changes():
    online = OnlineK(MODEL, 64, 5, decay=0.5, counts=stats([90, 80, 70, 55, 40], [100] * 5, 100))
    engine = RecordingEngine([(1, 64, 5)])
    m = first = online.update(engine, stats([900, 800, 700, 550, 400], [1000] * 5, 1000))
    assert engine.sets == [online.choose()] and m["k/changed"] == 1.0
    assert engine.k_schedule == as_schedule(best_k_per_batch(MODEL, [0.9, 0.8, 0.7, 0.55, 0.4], 64))
    assert {f"k/b{b}" for b in BSS} <= set(m) and m["k/b1"] == k_at(engine.k_schedule, 1)
    assert m["k/rate_pos_0"] == pytest.approx(0.9)
    # the same acceptance again: nothing to write
    m = online.update(engine, stats([900, 800, 700, 550, 400], [1000] * 5, 1000))
    assert len(engine.sets) == 1 and m["k/changed"] == 0.0
    # the policy drifts away from the draft: the newest counts outweigh the decayed ones and
    # the table shortens the drafts (speculation off at the large batches)
    for _ in range(6):
        online.update(engine, stats([300, 100, 50, 0, 0], [1000] * 5, 1000))
    assert online.rates[0] < 0.35 and k_at(engine.k_schedule, 32) == 0 < first["k/b32"]
    assert k_at(engine.k_schedule, 8) < first["k/b8"]


def test_without_step_aside_a_table_never_turns_every_draft_off():
    # at any batch size no draft pays: one token stays on for a single sequence, so the
    # counters keep measuring the draft
    online = OnlineK(MODEL, 64, 5, counts=stats([0, 0, 0, 0, 0], [100] * 5, 100))
    assert online.choose() == [(1, 1, 1), (2, 64, 0)]


class IdlingEngine(RecordingEngine):
    """A table of zeros idles the drafter (RolloutEngine.set_k_schedule)."""

    @property
    def drafter_idle(self):
        return not any(k for _, _, k in self.k_schedule)


def test_step_aside_turns_every_draft_off_and_the_simulated_length_turns_it_back_on():
    assert OnlineKConfig().step_aside  # the default
    online = OnlineK(MODEL, 64, 5, counts=stats([0, 0, 0, 0, 0], [100] * 5, 100), step_aside=True)
    assert online.choose() == [(1, 64, 0)]
    engine = IdlingEngine([(1, 64, 3)])
    online.update(engine, stats([0, 0, 0, 0, 0], [100] * 5, 100))
    assert engine.drafter_idle and engine.k_schedule == [(1, 64, 0)]
    # idle: the engine measures nothing, the adapter's simulated length of the served draft
    # stands in; a weak draft (1.05 at k = 3) keeps it idle, a good one (3.4) turns drafting on
    m = online.simulated(engine, 1.05, 3)
    assert engine.drafter_idle and m["k/resumed"] == 0.0 and m["k/idle_simulated_length"] == 1.05
    m = online.simulated(engine, 3.4, 3)
    assert not engine.drafter_idle and m["k/resumed"] == 1.0 and k_at(engine.k_schedule, 1) > 0
    # once drafting, the engine's own counters decide; the simulated length is not used
    assert online.simulated(engine, 1.0, 3) == {} and not engine.drafter_idle


def test_where_no_k_pays_at_the_rl_batch_no_batch_size_drafts():
    # a middling draft pays only at 1-2 sequences: alone that is the table; an RL batch of 32
    # would pay vLLM's drafter pass on every k = 0 step, so with step_aside nothing drafts
    counts = stats([60, 36, 20, 10, 5], [100] * 5, 100)
    assert OnlineK(MODEL, 64, 5, counts=counts, step_aside=True).choose() == [(1, 1, 3), (2, 2, 2), (3, 64, 0)]
    assert OnlineK(MODEL, 64, 5, counts=counts, step_aside=True, rl_batch=32).choose() == [(1, 64, 0)]
    assert OnlineK(MODEL, 64, 5, counts=counts, step_aside=True, rl_batch=2).choose() == [(1, 1, 3), (2, 2, 2), (3, 64, 0)]
    # without step_aside the table keeps its single-sequence draft; past max_batch the largest size decides
    assert OnlineK(MODEL, 64, 5, counts=counts, step_aside=False, rl_batch=32).choose() == [(1, 1, 3), (2, 2, 2), (3, 64, 0)]
    assert OnlineK(MODEL, 64, 5, counts=counts, step_aside=True, rl_batch=500).choose() == [(1, 64, 0)]
    # a draft that pays at the RL batch keeps its whole table
    good = stats([95, 90, 85, 80, 75], [100] * 5, 100)
    table = OnlineK(MODEL, 64, 5, counts=good, step_aside=True).choose()
    assert OnlineK(MODEL, 64, 5, counts=good, step_aside=True, rl_batch=32).choose() == table and k_at(table, 32) > 0


def prefill_cost(b: int) -> float:
    """A call's cost before its first decode step (the call, the prefill): several steps' worth."""
    return 0.02 + 2e-3 * b


class CostedEngine(RecordingEngine):
    """What OnlineK.calibrate touches of an engine, without vLLM: a step drafting k tokens for b
    sequences costs true_cost(k, b) seconds, position i is accepted with cumulative rate
    rates[i], and generate reports tokens/s and counts as the engine's counters would."""

    def __init__(self, rates, k_max=5, max_num_seqs=64):
        super().__init__([(1, max_num_seqs, 3)])
        self.k, self.max_num_seqs, self.rates = k_max, max_num_seqs, rates
        self.generated = []  # (k, batch size) of every generation

    def generate(self, prompts, temperature, max_tokens, seed):
        """A call costs a prefill (which gives each sequence its first token) and then its
        decode steps, each ``length`` tokens a sequence."""
        from types import SimpleNamespace

        b, k = len(prompts), k_at(self.k_schedule, len(prompts))
        self.generated.append((k, b))
        n = 1000 if k else 0
        acc = AcceptanceStats(self.k, n, [n * r if i < k else 0 for i, r in enumerate(self.rates)], n * k,
                              [n if i < k else 0 for i in range(self.k)])
        length = 1 + sum(self.rates[:k])
        seconds = prefill_cost(b) + (max_tokens - 1) / length * true_cost(k, b)
        return SimpleNamespace(tokens_per_s=b * max_tokens / seconds, seconds=seconds, num_tokens=b * max_tokens,
                               acceptance=acc, decode_step_seconds=lambda batch, drafted: [])

    @property
    def drafter_idle(self):
        return not any(k for _, _, k in self.k_schedule)


def test_a_calibration_stops_early_where_no_k_can_pay_and_finishes_when_a_draft_would():
    cfg = OnlineKConfig(batch_sizes=[1, 8, 32, 64], repeats=1)
    weak = [0.3, 0.09, 0.03, 0.01, 0.003]
    engine = CostedEngine(weak)
    online = OnlineK.calibrate(engine, ["p"] * 4, cfg, rl_batch=32)
    # k = 0, 1, 2 at the RL batch's 32 sequences first (none past it), and the bound held there:
    # nothing else measured
    assert sorted(set(engine.generated)) == [(k, 32) for k in (0, 1, 2)]
    assert online.pending is not None
    assert sorted(online.pending.left) == sorted([(k, b) for k in (0, 1, 2) for b in (1, 8)] +
                                                 [(k, b) for k in (3, 4, 5) for b in (1, 8, 32)])
    assert engine.k_schedule == [(1, 64, 0)] and online.model.batch_sizes == [32]
    assert online.sizes == [1, 8, 32]  # the k at every calibration size is still reported
    assert {"k/b1", "k/b8", "k/b32"} <= set(online.update(engine, AcceptanceStats(5)))
    # the bound agrees with the whole calibration: nothing pays at the RL batch there either
    whole = OnlineK.calibrate(CostedEngine(weak), ["p"] * 4, OnlineKConfig(batch_sizes=[1, 8, 32, 64], repeats=1,
                                                                           early_stop=False), rl_batch=32)
    assert whole.pending is None and whole.choose() == [(1, 64, 0)]
    # the steps are the engine's own: the calls' prefill is not folded into them
    for k in range(6):
        for i, b in enumerate(whole.model.batch_sizes):
            assert step_cost(whole.model, k, b) == pytest.approx(true_cost(k, b), rel=1e-6)
    # the draft it would serve turns good (its simulated length, and the engine's own rates): the
    # left-out k are measured before any table drafts, their generations' counts folded in
    engine.rates = [0.99, 0.97, 0.95, 0.93, 0.9]
    m = online.simulated(engine, 3.9, 3)
    assert m["k/resumed"] == 1.0 and online.pending is None
    assert {(k, b) for k in range(6) for b in (1, 8, 32)} <= set(engine.generated)
    assert online.model.batch_sizes == [1, 8, 32] and k_at(engine.k_schedule, 32) > 0
    # calibration sizes short of the RL batch: the bound is not extrapolated, the calibration is whole
    engine = CostedEngine(weak)
    online = OnlineK.calibrate(engine, ["p"] * 4, OnlineKConfig(batch_sizes=[1, 8], repeats=1), rl_batch=32)
    assert online.pending is None and {k for k, _ in engine.generated} == {0, 1, 2, 3, 4, 5}
    # a draft that may pay is calibrated whole at once
    engine = CostedEngine([0.95, 0.9, 0.85, 0.8, 0.75])
    online = OnlineK.calibrate(engine, ["p"] * 4, cfg, rl_batch=32)
    assert online.pending is None and {k for k, _ in engine.generated} == {0, 1, 2, 3, 4, 5}
    assert k_at(engine.k_schedule, 32) > 0


def test_the_early_stop_leaves_out_the_second_round_where_the_bound_holds_with_room():
    cfg = OnlineKConfig(batch_sizes=[1, 8, 32, 64], repeats=2)
    # a head that accepts almost nothing: one round of k = 0, 1, 2 at the RL batch settles it
    engine = CostedEngine([0.05, 0.01, 0.002, 0.0, 0.0])
    online = OnlineK.calibrate(engine, ["p"] * 4, cfg, rl_batch=32)
    # (the k = 0 calls past the cells are one-token ones: this engine times no steps, see measure)
    assert engine.generated[:3] == [(0, 32), (1, 32), (2, 32)] and engine.generated.count((1, 32)) == 1
    assert engine.generated.count((2, 32)) == 1 and {b for _, b in engine.generated} == {32}
    assert online.pending is not None and engine.k_schedule == [(1, 64, 0)]
    # the round it left out is measured with the rest, the first time a table would draft
    assert {(0, 32), (1, 32), (2, 32)} <= set(online.pending.left)
    engine.rates = [0.99, 0.97, 0.95, 0.93, 0.9]
    online.simulated(engine, 3.9, 3)
    assert online.pending is None and engine.generated.count((1, 32)) == 1 + cfg.repeats
    assert len(online.model.batch_sizes) == 3 and k_at(engine.k_schedule, 32) > 0
    for k in range(6):  # each cell once in the fit, its lowest reading
        assert step_cost(online.model, k, 32) == pytest.approx(true_cost(k, 32), rel=1e-6)
    # at 32 sequences k = 1 costs 1.99 plain steps and k = 2 3.5 more: a first-position rate of
    # 0.3 (bound 1.25 x 0.3 = 0.375 a plain step) clears the bound only without the slack
    # (0.73 ms left under it): the second round is measured, and then it stops early
    engine = CostedEngine([0.3, 0.09, 0.03, 0.01, 0.003])
    online = OnlineK.calibrate(engine, ["p"] * 4, cfg, rl_batch=32)
    assert {b for _, b in engine.generated} == {32} and engine.generated.count((1, 32)) == 2 and engine.generated.count((2, 32)) == 2
    assert online.pending is not None and engine.k_schedule == [(1, 64, 0)]
    assert not {(0, 32), (1, 32), (2, 32)} & set(online.pending.left)  # both rounds measured already
    # the counts of both rounds' k = 2 generations are kept
    assert online.counts.drafts == 2000


class SlowSpellEngine(CostedEngine):
    """A CostedEngine on a machine that runs at half speed for a spell of consecutive decode
    generations (calls ``spell`` of them, counted from 0; the one-token calls are not counted)."""

    def __init__(self, rates, spell: range):
        super().__init__(rates)
        self.spell, self.decodes = spell, []  # (k, batch size) of every decode generation

    def generate(self, prompts, temperature, max_tokens, seed):
        res = super().generate(prompts, temperature, max_tokens, seed)
        if max_tokens > 1:
            if len(self.decodes) in self.spell:
                res.seconds *= 2
                res.tokens_per_s /= 2
            self.decodes.append(self.generated[-1])
        return res


def test_a_calibration_measures_in_rounds_so_a_slow_spell_slows_no_cell_twice():
    cfg = OnlineKConfig(batch_sizes=[8, 32], repeats=2, early_stop=False)
    cells = [(k, b) for k in range(6) for b in (8, 32)]
    # four generations at half speed: measured back to back (each cell's repeats in a row) that
    # was both repeats of k = 1's two cells; in rounds every cell has a repeat outside the spell
    engine = SlowSpellEngine([0.9, 0.8, 0.7, 0.6, 0.5], spell=range(4, 8))
    online = OnlineK.calibrate(engine, ["p"] * 4, cfg, rl_batch=32)
    # k = 0-2, then the longer k: each part in two identical rounds of its cells
    head, longer = engine.decodes[:12], engine.decodes[12:]
    assert sorted(head[:6]) == [c for c in cells if c[0] <= 2] and head[:6] == head[6:], head
    assert sorted(longer[:6]) == [c for c in cells if c[0] > 2] and longer[:6] == longer[6:], longer
    for k, b in cells:  # the fastest repeat of every cell is the engine's own step cost
        assert step_cost(online.model, k, b) == pytest.approx(true_cost(k, b), rel=1e-6), (k, b)


class StepTimedEngine(CostedEngine):
    """A CostedEngine whose generations report their engine steps, on a machine whose calls cost
    a different, larger amount each time (the call, the prefill: 1x to 6x ``prefill_cost``) and
    where one decode step of every call runs 10x slow."""

    def __init__(self, rates):
        super().__init__(rates)
        self.calls = 0

    def generate(self, prompts, temperature, max_tokens, seed):
        res = super().generate(prompts, temperature, max_tokens, seed)
        k, b = self.generated[-1]
        self.calls += 1
        n = max(1, round((max_tokens - 1) / (1 + sum(self.rates[:k]))))  # decode steps
        steps = [true_cost(k, b) * (10 if i == self.calls % n else 1) for i in range(n)]
        res.seconds = prefill_cost(b) * (1 + 5 * (self.calls * 7 % 11) / 10) + sum(steps)
        res.tokens_per_s = res.num_tokens / res.seconds
        res.decode_step_seconds = lambda batch, drafted: steps if (batch, drafted) == (b, k) else []
        return res


def test_a_calibration_prices_the_engine_s_own_steps_whatever_the_call_and_a_slow_step_cost():
    cfg = OnlineKConfig(batch_sizes=[1, 8, 32], repeats=2, early_stop=False)
    rates = [0.9, 0.8, 0.7, 0.6, 0.5]
    engine = StepTimedEngine(rates)
    online = OnlineK.calibrate(engine, ["p"] * 4, cfg, rl_batch=32)
    for k in range(6):  # the median step: neither the call's cost nor the slow step moves it
        for b in (1, 8, 32):
            assert step_cost(online.model, k, b) == pytest.approx(true_cost(k, b), rel=1e-6), (k, b)
    # the call's cost is not measured: no one-token generations
    assert len(engine.generated) == 6 * 3 * 2
    # the same calls without their steps: the fallback, the call less a one-token call, is off
    # the true cost by more than 10% on some cell here (what the steps are for)
    blind = StepTimedEngine(rates)
    timed = blind.generate
    def untimed(*a, **kw):
        res = timed(*a, **kw)
        res.decode_step_seconds = lambda batch, drafted: []
        return res
    blind.generate = untimed
    fallback = OnlineK.calibrate(blind, ["p"] * 4, cfg, rl_batch=32)
    assert max(abs(step_cost(fallback.model, k, b) / true_cost(k, b) - 1) for k in range(6) for b in (1, 8, 32)) > 0.10


def test_positions_the_table_stopped_drafting_are_extrapolated_not_kept_stale():
    # a drifted draft measured at every position, then six steps of an improved draft under a
    # table that drafts only 2 tokens: positions 2-4 get no new counts
    online = OnlineK(MODEL, 64, 5, counts=stats([500, 250, 100, 30, 10], [1000] * 5, 1000))
    engine = RecordingEngine(online.choose())
    for _ in range(6):
        m = online.update(engine, stats([950, 880, 0, 0, 0], [1000, 1000, 0, 0, 0], 1000))
    stale = online.counts.reached_rates
    assert stale[2] == pytest.approx(0.1)  # the decayed counts alone: still the drifted draft's
    # what the choice uses: the newest conditional rate 0.88 / 0.95 carried on
    cond = 0.88 / 0.95
    assert online.rates[:2] == pytest.approx([0.95, 0.88], abs=0.01)
    assert online.rates[2:] == pytest.approx([0.88 * cond, 0.88 * cond ** 2, 0.88 * cond ** 3], abs=0.01)
    assert online.measured_positions == 2 and m["k/measured_positions"] == 2.0
    assert m["k/rate_pos_2"] == pytest.approx(online.rates[2])
    assert k_at(engine.k_schedule, 1) >= 3  # the improved draft gets a longer k back at once
    # only position 0 measured: each further position at r_0 again
    first = OnlineK(MODEL, 64, 5, counts=stats([800, 0, 0, 0, 0], [1000, 0, 0, 0, 0], 1000))
    assert first.rates == pytest.approx([0.8, 0.64, 0.512, 0.4096, 0.32768])
    # nothing drafted yet: no rates to extrapolate from
    assert all(math.isnan(r) for r in OnlineK(MODEL, 64, 5).rates)


def test_an_extrapolated_position_never_exceeds_its_own_recent_rate():
    # seed 173's flip-flop: the RL batch drafts 3 tokens at 64 sequences and 4-5 only in its
    # short tail, so positions 3-4 are reached by fewer than min_reach of the drafts, yet by
    # hundreds of them, and they measure far below the conditional rate carried on from 1 -> 2
    online = OnlineK(MODEL, 64, 5, prior_drafts=64)
    s = stats([900, 840, 740, 120, 40], [1000, 1000, 1000, 200, 200], 1000)
    online.observe(s)
    assert online.measured_positions == 3
    carried = 0.74 * (0.74 / 0.84)
    assert online.rates[:3] == pytest.approx([0.9, 0.84, 0.74])
    assert online.rates[3] == pytest.approx(0.6)  # its own 120 / 200, below the carried 0.652
    assert online.rates[3] < carried
    assert online.rates[4] == pytest.approx(0.2)  # 40 / 200, below 0.6 * (0.6 / 0.74)
    # the same shape with the tail reached by fewer than prior_drafts drafts: the guess stands
    few = OnlineK(MODEL, 64, 5, prior_drafts=64, counts=stats([900, 840, 740, 6, 2], [1000, 1000, 1000, 10, 10], 1000))
    assert few.rates[3] == pytest.approx(carried) and few.rates[4] == pytest.approx(carried * 0.74 / 0.84)
    # an own rate above the guess never raises it: the cap only lowers
    high = OnlineK(MODEL, 64, 5, prior_drafts=64, counts=stats([900, 840, 740, 190, 180], [1000, 1000, 1000, 200, 200], 1000))
    assert high.rates[3] == pytest.approx(carried)
    # stale: five steps with nothing reaching position 3 decay its 200 drafts below 64; the guess is back
    for _ in range(5):
        online.observe(stats([900, 840, 740, 0, 0], [1000, 1000, 1000, 0, 0], 1000))
    assert online.counts.drafts_per_position(5)[3] < 64
    assert online.rates[3] == pytest.approx(carried, rel=1e-6)


def test_a_new_draft_keeps_the_tail_the_engine_measured_past_the_simulated_k():
    # the draft before fell off past position 2 (conditional 0.3 at 3, 0.5 at 4): the new one,
    # simulated at k=3 only, keeps that shape there instead of its seeded c
    online = OnlineK(MODEL, 64, 5, prior_drafts=64, counts=stats([900, 800, 700, 210, 105], [1000] * 5, 1000))
    engine = RecordingEngine(online.choose())
    c = online.new_draft(engine, 3.4, 3)["k/seeded_rate"]
    assert online.rates[:3] == pytest.approx([c, c ** 2, c ** 3])
    assert online.rates[3] == pytest.approx(c ** 3 * 0.3)
    assert online.rates[4] == pytest.approx(c ** 3 * 0.3 * 0.5)
    # a measured tail above c does not raise the seed
    up = OnlineK(MODEL, 64, 5, prior_drafts=64, counts=stats([500, 250, 245, 244, 243], [1000] * 5, 1000))
    c2 = up.new_draft(RecordingEngine(up.choose()), 3.4, 3)["k/seeded_rate"]
    assert up.rates == pytest.approx([c2 ** (i + 1) for i in range(5)])

def test_the_adapter_pauses_only_where_even_a_fresh_draft_would_not_pay():
    """Idle because no draft pays here (a weak head): the rounds wait. Idle because the served
    draft fell behind a moving policy, while the adapter's drafts were worth drafting when
    published: the rounds go on, since a fresh one would serve."""
    online = OnlineK(MODEL, 64, 5, counts=stats([0, 0, 0, 0, 0], [100] * 5, 100), step_aside=True, rl_batch=32)
    engine = IdlingEngine([(1, 64, 0)])
    online.update(engine, stats([0, 0, 0, 0, 0], [100] * 5, 100))
    assert engine.drafter_idle
    saved = online.counts
    assert not online.would_pay(1.05, 3) and online.would_pay(3.4, 3)
    assert online.counts is saved and engine.drafter_idle  # asking changes nothing
    assert online.pause_adapter(engine, None, 3)  # no publish yet: the starting draft decides
    assert online.pause_adapter(engine, 1.05, 3)  # a weak head: nothing it trains would serve
    assert not online.pause_adapter(engine, 3.4, 3)  # drifted out of pay: train the fresh one
    online.simulated(engine, 3.4, 3)
    assert not engine.drafter_idle and not online.pause_adapter(engine, 1.05, 3)  # drafting: never paused


def test_a_new_draft_starts_from_its_simulated_acceptance():
    # the served draft accepted nothing: drafting is off everywhere but a single sequence, so an
    # RL batch would hardly measure the better draft swapped in next
    online = OnlineK(MODEL, 64, 5, counts=stats([0, 0, 0, 0, 0], [5000] * 5, 5000), prior_drafts=64)
    engine = RecordingEngine(online.choose())
    assert engine.k_schedule == [(1, 1, 1), (2, 64, 0)]
    m = online.new_draft(engine, 3.4, 3)  # the adapter simulated 3.4 at k=3 for it
    c = m["k/seeded_rate"]
    assert c + c ** 2 + c ** 3 == pytest.approx(2.4, abs=1e-9)
    assert online.rates == pytest.approx([c ** (i + 1) for i in range(5)])
    assert online.counts.drafts == 64 and m["k/changed_on_swap"] == 1.0
    assert engine.k_schedule == online.choose() and k_at(engine.k_schedule, 32) >= 2
    # the next RL batch's counts outweigh the prior at once
    online.update(engine, stats([500, 250, 100, 30, 10], [1000] * 5, 1000))
    assert online.rates[0] == pytest.approx((500 + 32 * c) / 1032)
    # a length past what k tokens can give is capped (every position accepted); nonsense refused
    assert online.new_draft(engine, 9.0, 3)["k/seeded_rate"] == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(ValueError, match="acceptance length >= 1"):
        online.new_draft(engine, float("nan"), 3)


def test_counts_of_another_k_and_bad_configs_are_refused():
    online = OnlineK(MODEL, 64, 5)
    with pytest.raises(ValueError, match="k_max=5"):
        online.observe(AcceptanceStats(3, 10, [5, 3, 1]))
    for bad in (OnlineKConfig(k_max=0), OnlineKConfig(batch_sizes=[]), OnlineKConfig(decay=1.0),
                OnlineKConfig(repeats=0), OnlineKConfig(margin=-0.1), OnlineKConfig(min_reach=0.0),
                OnlineKConfig(prior_drafts=0)):
        with pytest.raises(ConfigError, match="online_k"):
            bad.validate()
