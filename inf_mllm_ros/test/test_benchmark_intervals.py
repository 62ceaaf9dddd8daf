"""The intervals the recall tables report (`benchmarks/common.py`): Wilson's over questions, and the one over
trials that holds where one trial's questions are not independent (its facts asked at every distance)."""

from __future__ import annotations

import importlib.util

from conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("benchmark_common", REPO_ROOT / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)


def test_misses_clustered_in_trials_widen_the_interval_over_trials_past_wilsons():
    # 20 trials of 36 questions: half recall all, half a third; 540 of 720 either way.
    clustered = [(36, 36)] * 10 + [(18, 36)] * 10
    low, high = common.trial_interval(clustered)
    wilson_low, wilson_high = common.wilson(540, 720)
    assert low <= 0.75 <= high
    assert high - low > 2 * (wilson_high - wilson_low)


def test_misses_spread_evenly_over_trials_give_an_interval_over_trials_within_wilsons():
    for seed in range(3):
        even = [(27, 36)] * 20
        low, high = common.trial_interval(even, seed=seed)
        assert (low, high) == (0.75, 0.75)
        # Mixed but not clustered: 26 to 28 of 36 each.
        mixed = [(26 + (i % 3), 36) for i in range(20)]
        low, high = common.trial_interval(mixed, seed=seed)
        rate = sum(h for h, _ in mixed) / (36 * 20)
        wilson_low, wilson_high = common.wilson(sum(h for h, _ in mixed), 36 * 20)
        assert wilson_low <= low <= rate <= high <= wilson_high


def test_the_interval_over_trials_is_the_same_for_the_same_seed():
    trials = [(i % 5, 4) for i in range(20)]
    assert common.trial_interval(trials, seed=7) == common.trial_interval(trials, seed=7)
