"""The robot's frames as tf2 keeps them, without ROS: where its base was in the map at an input's stamp.

A robot's pose reaches the node through tf2 (`/tf`, `/tf_static`): odometry broadcasts `odom -> base_link` at tens
of Hz, drifting; a localiser broadcasts the correction `map -> odom` a few times a second. `TransformTree` keeps
the recent transforms of each edge (a child frame has one parent, as in tf2) and looks up one frame in another at
a stamp: each edge interpolated between its two samples around the stamp (position linearly, orientation by
slerp), or its nearest sample within `tolerance` seconds (a localiser's last correction stays in force between
its messages), composed along the tree. Static edges hold at every time. The node takes it through
robot_poses.py.

A stamp older than an edge's newest by more than JUMP_BACK_S (engine/poses.py) is a jump back in time (a looped
bag, a simulator reset): `add` reports it, and the caller clears the tree, as tf2's buffer does when the clock
jumps back.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from .engine.poses import JUMP_BACK_S, Pose, PoseRefusedError, interpolate
# Samples kept per edge: a minute of odometry at 50 Hz, far beyond any tolerance.
EDGE_SAMPLES = 3000


def quaternion_product(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float, float, float]:
    """a * b, as (x, y, z, w)."""
    ax, ay, az, aw = a
    bx, by, bz, bw = b
    return (aw * bx + ax * bw + ay * bz - az * by, aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw, aw * bw - ax * bx - ay * by - az * bz)


def rotate(q: tuple[float, ...], v: tuple[float, float, float]) -> tuple[float, float, float]:
    """The vector v rotated by the unit quaternion q."""
    x, y, z, _ = quaternion_product(quaternion_product(q, (*v, 0.0)), (-q[0], -q[1], -q[2], q[3]))
    return x, y, z


def compose(a: Pose, b: Pose) -> Pose:
    """The pose b (given in a's frame) in the frame a is given in: T_a * T_b."""
    qa = (a.qx, a.qy, a.qz, a.qw)
    dx, dy, dz = rotate(qa, (b.x, b.y, b.z))
    q = quaternion_product(qa, (b.qx, b.qy, b.qz, b.qw))
    norm = math.sqrt(sum(c * c for c in q))
    return Pose(a.x + dx, a.y + dy, a.z + dz, *(c / norm for c in q))


def inverse(a: Pose) -> Pose:
    conj = (-a.qx, -a.qy, -a.qz, a.qw)
    x, y, z = rotate(conj, (a.x, a.y, a.z))
    return Pose(-x, -y, -z, *conj)


IDENTITY = Pose(0.0, 0.0, 0.0)


@dataclass
class _Edge:
    parent: str
    static: bool
    stamps: deque
    poses: deque

    def at(self, stamp: float, tolerance: float) -> Pose | None:
        if self.static:
            return self.poses[-1]
        i = bisect.bisect_left(self.stamps, stamp)
        if 0 < i < len(self.stamps):
            before, after = self.stamps[i - 1], self.stamps[i]
            if min(stamp - before, after - stamp) > tolerance:
                return None
            t = 0.0 if after == before else (stamp - before) / (after - before)
            return interpolate(self.poses[i - 1], self.poses[i], t)
        nearest = 0 if i == 0 else len(self.stamps) - 1
        return self.poses[nearest] if abs(self.stamps[nearest] - stamp) <= tolerance else None


class TransformTree:
    """Recent transforms between the robot's frames, looked up at a stamp. Not thread-safe: its owner locks."""

    def __init__(self, tolerance: float = 0.5):
        if tolerance < 0 or not math.isfinite(tolerance):
            raise ValueError(f"transform tolerance must be a finite number of seconds >= 0, got {tolerance}")
        self.tolerance = tolerance
        self._edges: dict[str, _Edge] = {}  # by child frame

    def __len__(self) -> int:
        return len(self._edges)

    def clear(self) -> None:
        """Forget every moving transform (a jump back in time); static ones hold at every time and stay."""
        self._edges = {child: edge for child, edge in self._edges.items() if edge.static}

    def add(self, parent: str, child: str, stamp: float, pose: Pose, *, static: bool = False) -> float:
        """Keep the transform of `child` in `parent` at `stamp`. Returns 0.0, or the seconds it jumped back (its
        stamp that far before its edge's newest: nothing is kept, and the caller clears the tree). A child given
        another parent than before is that parent's from now on. PoseRefusedError for a value that is not finite, a
        rotation that is not a unit quaternion, or a frame without a name or that is its own parent."""
        values = (stamp, *pose.as_tuple())
        if not all(math.isfinite(v) for v in values):
            raise PoseRefusedError(f"transform {parent} -> {child} has a value that is not a finite number: {values}")
        norm = math.sqrt(pose.qx ** 2 + pose.qy ** 2 + pose.qz ** 2 + pose.qw ** 2)
        if abs(norm - 1.0) > 1e-3:
            raise PoseRefusedError(f"transform {parent} -> {child}: its rotation is not a unit quaternion "
                                   f"(norm {norm:.4f})")
        if not parent or not child or parent == child:
            raise PoseRefusedError(f"transform {parent!r} -> {child!r}: frames must be named and differ")
        edge = self._edges.get(child)
        if edge is None or edge.parent != parent or edge.static != static:  # a new edge, or the frame moved on
            edge = _Edge(parent, static, deque(maxlen=1 if static else EDGE_SAMPLES),
                         deque(maxlen=1 if static else EDGE_SAMPLES))
            self._edges[child] = edge
        if not static and edge.stamps and stamp < edge.stamps[-1]:
            if edge.stamps[-1] - stamp > JUMP_BACK_S:
                return edge.stamps[-1] - stamp
            i = bisect.bisect_left(edge.stamps, stamp)  # a late message: in its place
            edge.stamps.insert(i, stamp)
            edge.poses.insert(i, pose)
            return 0.0
        edge.stamps.append(stamp)
        edge.poses.append(pose)
        return 0.0

    def lookup(self, target: str, source: str, stamp: float) -> Pose | None:
        """Where frame `source` was in frame `target` at `stamp` (its origin and orientation), or None where the
        tree does not join them or an edge between them has no transform within the tolerance of the stamp (the
        edges above the frame they meet at are not asked)."""
        common = self._common(target, source)
        if common is None:
            return None
        source_in_common = self._pose_in(source, common, stamp)
        target_in_common = self._pose_in(target, common, stamp)
        if source_in_common is None or target_in_common is None:
            return None
        return compose(inverse(target_in_common), source_in_common)

    def behind(self, target: str, source: str, stamp: float) -> bool:
        """Whether a moving edge between frames `target` and `source` has no transform yet as new as `stamp` (its
        newest sample more than the tolerance before it): its transforms for the stamp have not come in yet. False
        where the tree does not join them."""
        common = self._common(target, source)
        if common is None:
            return False
        for chain in (self._ancestors(source), self._ancestors(target)):
            for frame in chain[: chain.index(common)]:  # each edge on the way up to the common frame
                edge = self._edges[frame]
                if not edge.static and edge.stamps[-1] < stamp - self.tolerance:
                    return True
        return False

    def _common(self, target: str, source: str) -> str | None:
        """The nearest frame both are under (themselves included), or None where the tree does not join them."""
        up_target = set(self._ancestors(target))
        return next((frame for frame in self._ancestors(source) if frame in up_target), None)

    def _ancestors(self, frame: str) -> list[str]:
        """The frame, its parent, its parent's parent... up to its root (a loop ends it)."""
        chain = [frame]
        while chain[-1] in self._edges and self._edges[chain[-1]].parent not in chain:
            chain.append(self._edges[chain[-1]].parent)
        return chain

    def _pose_in(self, frame: str, ancestor: str, stamp: float) -> Pose | None:
        """The frame's pose in one of its ancestors at the stamp; None where an edge on the way has none."""
        pose = IDENTITY
        while frame != ancestor:
            edge = self._edges[frame]
            step = edge.at(stamp, self.tolerance)
            if step is None:
                return None
            pose, frame = compose(step, pose), edge.parent
        return pose
