"""The robot's pose topic, and evidence as messages.

`PoseInput` belongs to the node (node/lifecycle.py): it subscribes to `pose_topic` once the topic's type is known
(nav_msgs/Odometry, geometry_msgs/PoseStamped or geometry_msgs/PoseWithCovarianceStamped, read from the graph,
so that one parameter serves every robot), keeps the poses in a `PoseHistory` (engine/poses.py) and gives the
pose at an input's stamp. A pose that cannot be used is refused with its reason through the node's refusal
counter (counted on /diagnostics, logged once per kind); nothing else is lost.
"""

from __future__ import annotations

import threading
from typing import Callable

from geometry_msgs.msg import Point, PoseStamped, PoseWithCovarianceStamped, Quaternion
from geometry_msgs.msg import Pose as PoseMsg
from nav_msgs.msg import Odometry
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from inf_mllm_interfaces.msg import Evidence as EvidenceMsg

from ..engine.api import Evidence
from ..engine.poses import Pose, PoseHistory, PoseRefusedError
from ..input_rules import POSE_MESSAGE_TYPES, pose_message, stamp_seconds

POSE_TYPES = dict(zip(POSE_MESSAGE_TYPES, (Odometry, PoseStamped, PoseWithCovarianceStamped)))
# Best effort takes a reliable publisher's poses too; a robot's odometry comes at tens of Hz.
POSE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=50, reliability=ReliabilityPolicy.BEST_EFFORT)
# Seconds between looks at the graph for the pose topic's type while it is not published yet.
DISCOVERY_PERIOD = 1.0


class PoseInput:
    """The pose topic of one node: found, subscribed, kept, looked up."""

    def __init__(self, node, topic: str, frame_id: str, tolerance: float, on_refused: Callable[[str, str], None]):
        self._node = node
        self.topic = topic
        self.history = PoseHistory(frame_id, tolerance)
        self._on_refused = on_refused
        self._lock = threading.Lock()  # poses come in on one executor thread, inputs look them up on others
        self._subscription = None
        self._timer = None
        self._wrong_type_said = False

    @property
    def frame_id(self) -> str:
        return self.history.frame_id

    def start(self) -> None:
        """Subscribe now where the topic's type is known, else look again every DISCOVERY_PERIOD seconds."""
        if not self.topic or self._subscription is not None:
            return
        if not self._subscribe() and self._timer is None:
            self._timer = self._node.create_timer(DISCOVERY_PERIOD, self._subscribe)

    def stop(self) -> None:
        for handle, destroy in ((self._subscription, self._node.destroy_subscription),
                                (self._timer, self._node.destroy_timer)):
            if handle is not None:
                destroy(handle)
        self._subscription = self._timer = None

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
        self._node.get_logger().info(f"poses from {name} ({msgtype}), tolerance {self.history.tolerance} s")
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
                self.history.add(stamp, pose, frame_id)
        except PoseRefusedError as exc:
            self._on_refused("pose", f"pose refused: {exc}")

    def at(self, seconds: float) -> Pose | None:
        """The robot's pose at a time (seconds on the node's clock), where one is known."""
        with self._lock:
            return self.history.at(seconds)


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
