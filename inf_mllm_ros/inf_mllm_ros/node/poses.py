"""The robot's pose from tf2 and the pose topic, and evidence as messages.

`PoseInput` belongs to the node (node/lifecycle.py): it takes `/tf` and `/tf_static` (tf2_msgs/TFMessage, on a
thread of their own: node/transform_listener.py) and,
with `pose_topic` set, that topic once its type is known (nav_msgs/Odometry, geometry_msgs/PoseStamped or
geometry_msgs/PoseWithCovarianceStamped, read from the graph, so that one parameter serves every robot), keeps
them in a `RobotPoses` (robot_poses.py) and gives the robot's pose at an input's stamp: its `base_frame` in the
memory's frame through tf2's frames, else the pose topic's. A pose or transform that cannot be used is refused with
its reason through the node's refusal counter (counted on /diagnostics, logged once per kind); a jump back in time
clears the poses and is reported (`on_jump`); nothing else is lost.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from geometry_msgs.msg import Point, PoseStamped, PoseWithCovarianceStamped, Quaternion
from geometry_msgs.msg import Pose as PoseMsg
from nav_msgs.msg import Odometry
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from inf_mllm_interfaces.msg import Evidence as EvidenceMsg

from ..engine.api import Evidence
from ..engine.poses import Pose, PoseRefusedError
from ..input_rules import POSE_MESSAGE_TYPES, pose_message, stamp_seconds, transform_message
from ..robot_poses import RobotPoses
from .transform_listener import TransformListener

try:  # a robot's ROS has it; scripts/setup.sh builds its TFMessage where the ROS 2 wheels lack it
    from tf2_msgs.msg import TFMessage
except ImportError:  # pragma: no cover - without it, poses come from the pose topic only
    TFMessage = None

POSE_TYPES = dict(zip(POSE_MESSAGE_TYPES, (Odometry, PoseStamped, PoseWithCovarianceStamped)))
# Best effort takes a reliable publisher's poses too; a robot's odometry comes at tens of Hz.
POSE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=50, reliability=ReliabilityPolicy.BEST_EFFORT)
# Seconds between looks at the graph for the pose topic's type while it is not published yet.
DISCOVERY_PERIOD = 1.0
# The longest an input waits for the transforms of its stamp where they have not come in yet, as tf2's message
# filter holds a message until its transform is there: /tf comes in bursts (a bag replayed in lockstep, a link that
# caught up), and an input that came right after a burst can be looked up before the burst is in. On route bags in
# lockstep on 2 busy cores, the waits that succeeded took up to 1.5 s with /tf on its own thread (up to 2.7 s on the
# node's executor); at 1 s, 9 of 162 evidence lines had no pose. A wait that ends without
# them is not made again until a lookup through tf2 succeeds (a stopped localiser would hold up every input).
TRANSFORM_WAIT_S = 3.0


class PoseInput:
    """The robot's pose for one node: tf2's frames and the pose topic, found, subscribed, kept, looked up.

    node: the rclpy node it subscribes on. topic: the pose topic ("": none). frame_id: the memory's pose frame
    ("": chosen by the first pose). map_frame, base_frame: the frames tf2 is asked for (map_frame "": tf2 is not
    taken). on_refused(kind, message): a pose or transform refused. on_jump(seconds): time jumped back that far
    and the poses were cleared."""

    def __init__(self, node, topic: str, frame_id: str, tolerance: float, on_refused: Callable[[str, str], None],
                 *, map_frame: str = "map", base_frame: str = "base_link",
                 on_jump: Callable[[float], None] = lambda seconds: None):
        self._node = node
        self.topic = topic
        self.poses = RobotPoses(frame_id, tolerance, map_frame, base_frame)
        self._on_refused, self._on_jump = on_refused, on_jump
        self._lock = threading.Lock()  # poses come in on executor threads, inputs look them up on others
        self._transforms_in = threading.Condition(self._lock)  # notified with each /tf message kept
        self._wait_for_transforms = True  # false after a wait that ended without them, until a lookup succeeds
        self._subscription = None
        self._transforms = TransformListener(node, TFMessage, self._on_transforms)  # on a thread of its own
        self._timer = None
        self._wrong_type_said = False

    @property
    def frame_id(self) -> str:
        """The memory's pose frame ("" until the first pose)."""
        with self._lock:
            return self.poses.frame_id

    def keep_frame(self, frame_id: str) -> None:
        """The memory's poses are in `frame_id` (a restored memory's)."""
        with self._lock:
            self.poses.keep_frame(frame_id)

    def start(self) -> None:
        """Take tf2's frames, and subscribe to the pose topic now where its type is known, else look again every
        DISCOVERY_PERIOD seconds."""
        if self.poses.map_frame and TFMessage is not None:
            self._transforms.start()
        if not self.topic or self._subscription is not None:
            return
        if not self._subscribe() and self._timer is None:
            self._timer = self._node.create_timer(DISCOVERY_PERIOD, self._subscribe)

    def stop(self) -> None:
        for handle, destroy in ((self._subscription, self._node.destroy_subscription),
                                (self._timer, self._node.destroy_timer)):
            if handle is not None:
                destroy(handle)
        self._transforms.stop()
        self._subscription = self._timer = None

    def clear(self) -> None:
        """Forget the poses (a reset of the memory)."""
        with self._lock:
            self.poses.clear()

    def _subscribe(self) -> bool:
        name = self._resolved()
        types = dict(self._node.get_topic_names_and_types()).get(name, [])
        known = [t for t in types if t in POSE_TYPES]
        if not known:
            if types and not self._wrong_type_said:
                self._wrong_type_said = True
                self._on_refused("pose_topic_type", f"pose topic {name} has type {', '.join(types)}; it must be one of "
                                 + ", ".join(POSE_TYPES))
            return False
        msgtype = known[0]
        # A group of its own, as each input has (node/inputs.py, `subscribe`): odometry comes at tens of Hz.
        self._subscription = self._node.create_subscription(POSE_TYPES[msgtype], name,
                                                            lambda msg: self._on_pose(msg, msgtype), POSE_QOS,
                                                            callback_group=MutuallyExclusiveCallbackGroup())
        if self._timer is not None:
            self._node.destroy_timer(self._timer)
            self._timer = None
        self._node.get_logger().info(f"poses from {name} ({msgtype}), tolerance {self.poses.tolerance} s")
        return True

    def _resolved(self) -> str:
        if self.topic.startswith("/"):
            return self.topic
        namespace = self._node.get_namespace().rstrip("/")
        return f"{namespace}/{self.topic}"

    def _on_pose(self, msg, msgtype: str) -> None:
        pose, frame_id = pose_message(msg, msgtype)
        stamp = stamp_seconds(msg.header.stamp, self._node.get_clock().now().nanoseconds)
        try:
            with self._lock:
                jumped = self.poses.add_pose(stamp, pose, frame_id)
        except PoseRefusedError as exc:
            self._on_refused("pose", f"pose refused: {exc}")
            return
        if jumped:
            self._on_jump(jumped)

    def _on_transforms(self, msg, static: bool) -> None:
        now = self._node.get_clock().now().nanoseconds
        for transform in msg.transforms:
            parent, child, pose = transform_message(transform)
            try:
                with self._lock:
                    jumped = self.poses.add_transform(parent, child, stamp_seconds(transform.header.stamp, now), pose,
                                                      static=static)
            except PoseRefusedError as exc:
                self._on_refused("transform", f"transform refused: {exc}")
                continue
            if jumped:
                self._on_jump(jumped)
        with self._lock:
            self._transforms_in.notify_all()

    def at(self, seconds: float) -> Pose | None:
        """The robot's pose at a time (seconds on the node's clock), where one is known; where tf2's transforms for
        it have not come in yet, after waiting for them up to TRANSFORM_WAIT_S."""
        deadline = time.monotonic() + TRANSFORM_WAIT_S
        with self._lock:
            while True:
                pose = self.poses.at(seconds)
                if pose is not None:
                    self._wait_for_transforms = True
                    return pose
                if not (self._wait_for_transforms and self.poses.behind(seconds)):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self._wait_for_transforms = False
                    return None
                self._transforms_in.wait(left)


def pose_msg(pose: Pose) -> PoseMsg:
    return PoseMsg(position=Point(x=pose.x, y=pose.y, z=pose.z),
                   orientation=Quaternion(x=pose.qx, y=pose.qy, z=pose.qz, w=pose.qw))


def evidence_msgs(evidence: list[Evidence], ros_time, frame_id: str) -> list[EvidenceMsg]:
    """Evidence as messages; `ros_time` turns a stream time into a builtin_interfaces/Time."""
    return [EvidenceMsg(stamp=ros_time(e.stamp), has_stamp=e.stamp is not None, kind=e.kind, camera=e.camera,
                        source=e.source,
                        has_pose=e.pose is not None, pose=pose_msg(e.pose) if e.pose is not None else PoseMsg(),
                        frame_id=frame_id if e.pose is not None else "", text=e.text, weight=e.weight)
            for e in evidence]
