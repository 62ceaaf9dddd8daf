"""Where the robot was: poses kept beside the memory's inputs.

A robot publishes its pose (odometry, a localiser's estimate) far more often than it sees a frame or hears a
text. `PoseHistory` keeps the recent ones and gives the pose at any input's stamp, interpolated between the two
nearest (position linearly, orientation by spherical interpolation), or none where the nearest is farther than
the tolerance. The pose then travels with the input's tokens (the archive's blocks, the memory file), so that an
answer can say where what it rests on was seen.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import astuple, dataclass

# A pose as stored beside the archive's blocks: x, y, z, qx, qy, qz, qw (NaN: none).
POSE_FIELDS = 7
# A pose this much older than the newest kept is a jump back in time (a looped bag, a simulator reset), not a late
# message: the history starts again from it.
JUMP_BACK_S = 1.0


class PoseRefusedError(ValueError):
    """A pose that cannot be used; the message says why."""


@dataclass(frozen=True)
class Pose:
    """A position and an orientation (a unit quaternion) in the memory's pose frame."""

    x: float
    y: float
    z: float
    qx: float = 0.0
    qy: float = 0.0
    qz: float = 0.0
    qw: float = 1.0

    def as_tuple(self) -> tuple[float, ...]:
        return astuple(self)

    def distance_to(self, x: float, y: float) -> float:
        """Distance in the plane to a place (x, y)."""
        return math.hypot(self.x - x, self.y - y)


def interpolate(a: Pose, b: Pose, t: float) -> Pose:
    """The pose a fraction `t` of the way from `a` to `b`."""
    qa, qb = (a.qx, a.qy, a.qz, a.qw), (b.qx, b.qy, b.qz, b.qw)
    dot = sum(p * q for p, q in zip(qa, qb))
    if dot < 0:  # the shorter way round
        qb, dot = tuple(-q for q in qb), -dot
    if dot > 0.9995:  # nearly the same: linear, then normalised
        q = [p + t * (r - p) for p, r in zip(qa, qb)]
    else:
        theta = math.acos(dot)
        wa, wb = math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
        q = [wa * p + wb * r for p, r in zip(qa, qb)]
    norm = math.sqrt(sum(c * c for c in q))
    return Pose(a.x + t * (b.x - a.x), a.y + t * (b.y - a.y), a.z + t * (b.z - a.z), *(c / norm for c in q))


class PoseHistory:
    """The robot's recent poses in one frame, at most `length` of them.

    frame_id: the frame every pose must be in ("": the first pose's frame, held to after it); tolerance: the
    farthest (seconds) an input's stamp may be from the nearest pose for it to get one.
    """

    def __init__(self, frame_id: str = "", tolerance: float = 0.5, length: int = 4096):
        if tolerance < 0 or not math.isfinite(tolerance):
            raise ValueError(f"pose tolerance must be a finite number of seconds >= 0, got {tolerance}")
        if length < 2:
            raise ValueError(f"a pose history holds at least 2 poses, got {length}")
        self.frame_id = frame_id
        self.tolerance = tolerance
        self._stamps: deque[float] = deque(maxlen=length)
        self._poses: deque[Pose] = deque(maxlen=length)

    def __len__(self) -> int:
        return len(self._stamps)

    def clear(self) -> None:
        """Forget the poses (their frame stays: the memory's poses are in it)."""
        self._stamps.clear()
        self._poses.clear()

    def add(self, stamp: float, pose: Pose, frame_id: str) -> float:
        """Keep a pose. Returns 0.0, or the seconds time jumped back (a stamp more than JUMP_BACK_S before the
        newest kept: the history is cleared and starts again from this pose). PoseRefusedError (nothing kept) for a
        value that is not finite, a quaternion that is not a rotation, another frame, or a stamp shortly before
        the newest kept."""
        values = (stamp, *pose.as_tuple())
        if not all(math.isfinite(v) for v in values):
            raise PoseRefusedError(f"pose at {stamp} has a value that is not a finite number: {values}")
        norm = math.sqrt(pose.qx ** 2 + pose.qy ** 2 + pose.qz ** 2 + pose.qw ** 2)
        if abs(norm - 1.0) > 1e-3:
            raise PoseRefusedError(f"pose at {stamp}: its orientation is not a unit quaternion (norm {norm:.4f})")
        if not self.frame_id:
            self.frame_id = frame_id
        if frame_id != self.frame_id:
            raise PoseRefusedError(f"pose in frame {frame_id!r}; this memory keeps poses in {self.frame_id!r}")
        jumped = 0.0
        if self._stamps and stamp < self._stamps[-1]:
            if self._stamps[-1] - stamp <= JUMP_BACK_S:
                raise PoseRefusedError(f"pose at {stamp} is older than the newest kept ({self._stamps[-1]}): out of "
                                       "order")
            jumped = self._stamps[-1] - stamp
            self.clear()
        self._stamps.append(stamp)
        self._poses.append(pose)
        return jumped

    def at(self, stamp: float | None) -> Pose | None:
        """The pose at `stamp`: interpolated between the two kept poses around it, or the nearest one's where the
        stamp is beyond the newest or the oldest; None where that pose is farther than the tolerance."""
        if stamp is None or not self._stamps:
            return None
        i = bisect.bisect_left(self._stamps, stamp)
        if 0 < i < len(self._stamps):
            before, after = self._stamps[i - 1], self._stamps[i]
            if min(stamp - before, after - stamp) > self.tolerance:
                return None
            t = 0.0 if after == before else (stamp - before) / (after - before)
            return interpolate(self._poses[i - 1], self._poses[i], t)
        nearest = 0 if i == 0 else len(self._stamps) - 1
        if abs(self._stamps[nearest] - stamp) > self.tolerance:
            return None
        return self._poses[nearest]
