"""Where the robot was at an input's stamp, from tf2's frames or a pose topic, in the memory's one frame.

`RobotPoses` is what the node's pose input (node/poses.py) keeps, without ROS: the frames tree from `/tf` and
`/tf_static` (transform_tree.py) and the pose topic's history (engine/poses.py). An input's pose is the robot's
base frame in the memory's frame at its stamp, looked up through the tree (odometry's `odom -> base_link` with a
localiser's `map -> odom`, so drift is corrected as the localiser corrects it), or the pose topic's where the tree
cannot say. The memory keeps its poses in one frame (`frame_id`): the configured or saved one, else the map frame
for the tree, else the pose topic's first frame; a pose topic in another frame is refused, as before.

A jump back in time in either source (a looped bag, a simulator reset) clears both: no pose from before the jump
is given to an input after it. `clear` does the same for a reset of the memory.
"""

from __future__ import annotations

from .engine.poses import Pose, PoseHistory
from .transform_tree import TransformTree


class RobotPoses:
    """The robot's poses from the frames tree and the pose topic. Not thread-safe: its owner locks.

    frame_id: the memory's pose frame ("": chosen by the first pose). tolerance: seconds an input's stamp may be
    from the poses around it. map_frame: the frame the tree is asked in while the memory has none ("": the tree is
    not asked). base_frame: the robot's frame the tree is asked for."""

    def __init__(self, frame_id: str = "", tolerance: float = 0.5, map_frame: str = "map",
                 base_frame: str = "base_link"):
        self.tree = TransformTree(tolerance)
        self.history = PoseHistory(frame_id, tolerance)
        self.map_frame, self.base_frame = map_frame, base_frame

    @property
    def frame_id(self) -> str:
        return self.history.frame_id

    @property
    def tolerance(self) -> float:
        return self.history.tolerance

    def keep_frame(self, frame_id: str) -> None:
        """The memory's poses are in `frame_id` (a restored memory's): the tree is asked in it, the pose topic held
        to it."""
        self.history.frame_id = frame_id

    def add_transform(self, parent: str, child: str, stamp: float, pose: Pose, *, static: bool = False) -> float:
        """A transform from /tf or /tf_static. Returns the seconds time jumped back (both sources cleared), or 0.0.
        PoseRefusedError for one that cannot be used."""
        jumped = self.tree.add(parent, child, stamp, pose, static=static)
        if jumped:
            self.clear()
            self.tree.add(parent, child, stamp, pose, static=static)
        return jumped

    def add_pose(self, stamp: float, pose: Pose, frame_id: str) -> float:
        """A pose from the pose topic. Returns the seconds time jumped back (both sources cleared), or 0.0.
        PoseRefusedError for one that cannot be used."""
        jumped = self.history.add(stamp, pose, frame_id)
        if jumped:
            self.tree.clear()
        return jumped

    def clear(self) -> None:
        """Forget every pose and moving transform (the frame and the static transforms stay)."""
        self.tree.clear()
        self.history.clear()

    def behind(self, stamp: float) -> bool:
        """Whether the frames tree is asked and its transforms for `stamp` have not all come in yet (a burst of /tf
        still on its way): a lookup at the stamp may succeed once they have."""
        target = self.frame_id or self.map_frame
        return bool(target and self.base_frame) and self.tree.behind(target, self.base_frame, stamp)

    def at(self, stamp: float | None) -> Pose | None:
        """The robot's pose at `stamp` in the memory's frame, where one is known."""
        if stamp is None:
            return None
        target = self.frame_id or self.map_frame
        if target and self.base_frame:
            pose = self.tree.lookup(target, self.base_frame, stamp)
            if pose is not None:
                if not self.frame_id:
                    self.history.frame_id = target  # the memory's poses are in it from now on
                return pose
        return self.history.at(stamp)
