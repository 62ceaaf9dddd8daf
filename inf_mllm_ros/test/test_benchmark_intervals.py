"""The intervals the recall tables report (`benchmarks/common.py`): Wilson's over questions, and the one over
trials that holds where one trial's questions are not independent (its facts asked at every distance)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

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


def test_the_recall_summary_pools_the_recorded_distances_and_counts_the_misses_by_kind():
    # The recorded twelve-at-once runs at cache 512 (docs/archive.md): 1K-4K and 8K-16K files make one row.
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "archive_recall.py"), "summary",
                           "--misses-by", "kind", "--out", "archive_recall_wide_twelve.json",
                           "archive_recall_wide_twelve_16k.json"],
                          capture_output=True, text=True, timeout=120, env=os.environ | {"BENCHMARK_RESULTS": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 12 | yes | no | inf_mllm | 512 | on"))
    cells = [c.strip() for c in row.strip("| ").split("|")][6:]
    assert [c.split(" ")[0] for c in cells] == ["200/240", "198/240", "216/240", "218/240", "224/240", "1056/1200"]
    assert "; trials " in cells[-1]
    misses = next(line for line in done.stdout.splitlines() if line.startswith("| 12 | yes | inf_mllm | 512 | over 4K"))
    assert misses.split(" | ")[5:] == ["0/96", "19/96", "0/96", "16/96", "3/96 |"]
