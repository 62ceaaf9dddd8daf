"""The robot's frames as tf2 keeps them (inf_mllm_ros/transform_tree.py): composed along the tree, interpolated
between samples, static edges at every time, a jump back in time reported, and lookups that cannot be made None."""

from __future__ import annotations

import math
import random

import pytest

from inf_mllm_ros.engine.poses import Pose, PoseRefusedError
from inf_mllm_ros.robot_poses import RobotPoses
from inf_mllm_ros.transform_tree import JUMP_BACK_S, TransformTree, compose, inverse


def yaw_pose(x: float, y: float, yaw: float) -> Pose:
    return Pose(x, y, 0.0, 0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2))


def random_pose(rng: random.Random) -> Pose:
    q = [rng.gauss(0, 1) for _ in range(4)]
    n = math.sqrt(sum(c * c for c in q))
    return Pose(rng.uniform(-5, 5), rng.uniform(-5, 5), rng.uniform(-1, 1), *(c / n for c in q))


def close(a: Pose, b: Pose, tol: float = 1e-9) -> bool:
    same_q = all(abs(p - q) < tol for p, q in zip(a.as_tuple()[3:], b.as_tuple()[3:]))
    flipped_q = all(abs(p + q) < tol for p, q in zip(a.as_tuple()[3:], b.as_tuple()[3:]))
    return all(abs(p - q) < tol for p, q in zip(a.as_tuple()[:3], b.as_tuple()[:3])) and (same_q or flipped_q)


def test_map_odom_base_composes_as_a_robot_moves():
    tree = TransformTree(tolerance=0.5)
    tree.add("map", "odom", 0.0, yaw_pose(1.0, 2.0, math.pi / 2))
    tree.add("odom", "base_link", 0.0, yaw_pose(3.0, 0.0, 0.0))
    # odom is turned 90 degrees in the map: 3 m along odom's x is 3 m along the map's y.
    pose = tree.lookup("map", "base_link", 0.0)
    assert close(pose, yaw_pose(1.0, 5.0, math.pi / 2))


@pytest.mark.parametrize("seed", range(5))
def test_a_lookup_is_the_inverse_of_the_other_way_and_joins_at_the_common_frame(seed):
    rng = random.Random(seed)
    tree = TransformTree()
    a, b, c = random_pose(rng), random_pose(rng), random_pose(rng)
    tree.add("map", "odom", 1.0, a)
    tree.add("odom", "base_link", 1.0, b)
    tree.add("base_link", "camera_link", 0.0, c, static=True)
    tree.add("map", "dock", 1.0, random_pose(rng))
    camera_in_map = tree.lookup("map", "camera_link", 1.0)
    assert close(camera_in_map, compose(compose(a, b), c))
    assert close(tree.lookup("camera_link", "map", 1.0), inverse(camera_in_map))
    dock_in_camera = tree.lookup("camera_link", "dock", 1.0)
    assert close(compose(camera_in_map, dock_in_camera), tree.lookup("map", "dock", 1.0))
    assert close(tree.lookup("odom", "odom", 1.0), Pose(0.0, 0.0, 0.0))
    assert tree.lookup("map", "elsewhere", 1.0) is None


@pytest.mark.parametrize("seed", range(4))
def test_an_edge_is_interpolated_between_its_samples_and_held_within_the_tolerance(seed):
    rng = random.Random(seed)
    tree = TransformTree(tolerance=0.4)
    t0 = rng.uniform(0, 100)
    for i in range(11):  # 1 m/s along x, at 10 Hz
        tree.add("odom", "base_link", t0 + 0.1 * i, Pose(float(i) * 0.1, 0.0, 0.0))
    tree.add("map", "odom", t0, Pose(10.0, 0.0, 0.0))  # one correction, held while within the tolerance
    at = rng.uniform(0.0, 0.4)
    assert abs(tree.lookup("map", "base_link", t0 + at).x - (10.0 + at)) < 1e-9
    assert tree.lookup("map", "base_link", t0 + 0.45) is None  # the correction is 0.45 s old
    assert tree.lookup("odom", "base_link", t0 + 1.3) is not None  # the newest odometry, 0.3 s old
    assert tree.lookup("odom", "base_link", t0 + 1.5) is None


def test_a_late_message_goes_in_its_place_and_a_jump_back_is_reported_and_cleared():
    tree = TransformTree()
    tree.add("base_link", "camera_link", 0.0, Pose(0.2, 0.0, 0.5), static=True)
    for t in (10.0, 10.2, 10.1):
        assert tree.add("odom", "base_link", t, Pose(t, 0.0, 0.0)) == 0.0
    assert abs(tree.lookup("odom", "base_link", 10.15).x - 10.15) < 1e-9
    jumped = tree.add("odom", "base_link", 10.2 - JUMP_BACK_S - 5.0, Pose(0.0, 0.0, 0.0))
    assert jumped == pytest.approx(JUMP_BACK_S + 5.0)
    tree.clear()
    assert tree.lookup("odom", "base_link", 10.15) is None
    assert tree.lookup("base_link", "camera_link", 99.0) is not None  # static: it holds at every time
    tree.add("odom", "base_link", 4.0, Pose(4.0, 0.0, 0.0))  # the second pass goes on from the jump
    assert tree.lookup("odom", "base_link", 4.0).x == 4.0


@pytest.mark.parametrize("parent, child, pose, reason", [
    ("map", "odom", Pose(math.nan, 0.0, 0.0), "finite"),
    ("map", "odom", Pose(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5), "unit quaternion"),
    ("", "odom", Pose(0.0, 0.0, 0.0), "named"),
    ("odom", "odom", Pose(0.0, 0.0, 0.0), "differ"),
])
def test_a_transform_that_cannot_be_used_is_refused_with_its_reason(parent, child, pose, reason):
    tree = TransformTree()
    with pytest.raises(PoseRefusedError, match=reason):
        tree.add(parent, child, 1.0, pose)
    assert len(tree) == 0


def test_the_robots_pose_comes_through_the_tree_else_from_the_pose_topic_in_the_memorys_frame():
    poses = RobotPoses("", tolerance=0.5, map_frame="map", base_frame="base_link")
    poses.add_pose(1.0, Pose(7.0, 0.0, 0.0), "map")  # a pose topic in map
    assert poses.at(1.0) == Pose(7.0, 0.0, 0.0) and poses.frame_id == "map"
    poses.add_transform("map", "odom", 1.0, Pose(2.0, 0.0, 0.0))
    poses.add_transform("odom", "base_link", 1.0, Pose(3.0, 0.0, 0.0))
    assert close(poses.at(1.0), Pose(5.0, 0.0, 0.0)), "tf2 first, where it joins the frames"
    assert poses.at(None) is None


def test_the_tree_is_asked_in_the_frame_the_memory_keeps():
    poses = RobotPoses("", tolerance=0.5, map_frame="map", base_frame="base_link")
    poses.keep_frame("odom")  # a restored memory's poses are in odom
    poses.add_transform("map", "odom", 1.0, Pose(2.0, 0.0, 0.0))
    poses.add_transform("odom", "base_link", 1.0, Pose(3.0, 0.0, 0.0))
    assert close(poses.at(1.0), Pose(3.0, 0.0, 0.0)) and poses.frame_id == "odom"
    fresh = RobotPoses("", map_frame="map")
    fresh.add_transform("map", "odom", 1.0, Pose(2.0, 0.0, 0.0))
    fresh.add_transform("odom", "base_link", 1.0, Pose(3.0, 0.0, 0.0))
    assert fresh.frame_id == "" and close(fresh.at(1.0), Pose(5.0, 0.0, 0.0)) and fresh.frame_id == "map"
    with pytest.raises(PoseRefusedError, match="frame"):
        fresh.add_pose(2.0, Pose(0.0, 0.0, 0.0), "odom")  # the memory keeps map


@pytest.mark.parametrize("source", ["tree", "topic"])
def test_a_jump_back_in_either_source_clears_both(source):
    poses = RobotPoses("map", tolerance=0.5)
    for t in (100.0, 100.2):
        poses.add_transform("map", "base_link", t, Pose(t, 0.0, 0.0))
        poses.add_pose(t, Pose(t, 0.0, 0.0), "map")
    jumped = (poses.add_transform("map", "base_link", 10.0, Pose(-1.0, 0.0, 0.0)) if source == "tree"
              else poses.add_pose(10.0, Pose(-1.0, 0.0, 0.0), "map"))
    assert jumped == pytest.approx(90.2)
    assert poses.at(100.1) is None and poses.at(10.0) == Pose(-1.0, 0.0, 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_is_behind_a_stamp_its_transforms_have_not_reached_on_the_asked_path_only(seed):
    rng = random.Random(seed)
    poses = RobotPoses(tolerance=0.5)
    start = rng.uniform(0, 1000)
    assert not poses.behind(start)  # nothing joins map and base_link: no lookup to wait for
    poses.add_transform("base_link", "camera_link", start, yaw_pose(0.3, 0, 0), static=True)
    odom_until = start + rng.uniform(5, 20)
    t = start
    while t <= odom_until:
        poses.add_transform("odom", "base_link", t, yaw_pose(t - start, 0, 0))
        if round((t - start) * 20) % 7 == 0:
            poses.add_transform("map", "odom", t, yaw_pose(1.0, 0, 0))
            last_map = t
        t += 0.05
    poses.add_transform("odom", "gripper", start, yaw_pose(0, 0, 0))  # a frame off the path, long stale
    inside = rng.uniform(start + 1, odom_until - 1)
    assert poses.at(inside) is not None and not poses.behind(inside)
    later = odom_until + rng.uniform(0.6, 30)  # an input after transforms still on their way
    assert poses.at(later) is None and poses.behind(later)
    assert not poses.behind(last_map + 0.45)  # within the tolerance of each edge's newest: held
    assert poses.behind(last_map + 0.55)  # the localiser's newest too old: its next is on its way
    # Once the transforms of its stamp are in, the same input has its pose.
    poses.add_transform("odom", "base_link", later, yaw_pose(later - start, 0, 0))
    poses.add_transform("map", "odom", later, yaw_pose(1.0, 0, 0))
    assert not poses.behind(later) and close(poses.at(later), yaw_pose(later - start + 1.0, 0, 0), 1e-6)
