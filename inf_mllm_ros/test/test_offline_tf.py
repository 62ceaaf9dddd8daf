"""The offline runner takes a bag's /tf and /tf_static as the node does (robot_poses.py): on a route bag whose
odometry drifts, each narration is kept where the robot truly was (the localiser's correction applied), not where
its odometry says, and a bag without /tf goes on as before (test_replay_offline.py)."""

from __future__ import annotations

import math

import pytest

from inf_mllm_ros.bags.offline import run_offline
from inf_mllm_ros.bags.route_bag import write_route_bag
from inf_mllm_ros.settings import DEFAULTS

from conftest import load_prepared

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2():
    return load_prepared("smollm2")


@pytest.mark.parametrize("seed", [3, 11])
def test_offline_inputs_are_kept_where_tf2_puts_the_robot(tmp_path, seed, smollm2):
    summary = write_route_bag(tmp_path / "bag", seed, duration=90.0, fps=0.5, size=(64, 48))
    scenario = summary.scenario
    settings = dict(DEFAULTS, model="smollm2", cache_size=256, description_period=0.0)
    result = run_offline(summary.path, [], settings, topics=["/narration", "/tf", "/tf_static"], adapter=smollm2)
    texts = [r for r in result.records if r["type"] == "text"]
    assert len(texts) == len(scenario.narration) and result.counts["transforms"] > 1000
    assert result.counts["poses_refused"] == 0 and result.route_frame == "map"
    errors = []
    for record in texts:
        x, y, _ = (float(v) for v in scenario.pose_at(record["bag_time"]))
        assert record["pose"] is not None, record
        errors.append(math.hypot(record["pose"][0] - x, record["pose"][1] - y))
    assert max(errors) < 0.25, errors  # the localiser's noise, a few centimetres
    assert summary.drift_max_m > 0.25, "odometry alone would be off by more"
