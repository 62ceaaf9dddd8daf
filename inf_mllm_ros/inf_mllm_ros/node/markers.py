"""What an answer or a recall rests on, for RViz: markers over the robot's route.

`EvidenceMarkers` belongs to the node's services (node/services.py). After each answer, `~/evidence`
(visualization_msgs/MarkerArray) shows its evidence where the robot was: a sphere per input with a pose, sized by
its weight (the heaviest the largest), and a label above it with its time and words; after each recall,
`~/recall_moments` the same for its moments. Both are latched (transient local, the last array only), so an RViz
started later shows the last ones, and each array first deletes the one before. `~/evidence_poses` keeps the
evidence's poses as a geometry_msgs/PoseArray, as before markers came.
"""

from __future__ import annotations

from datetime import datetime, timezone

from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import PoseArray
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import ColorRGBA
from visualization_msgs.msg import Marker, MarkerArray

from ..engine.api import Evidence
from .poses import pose_msg

LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
# Sphere diameters (m): the lightest evidence's and the heaviest's.
SMALLEST, LARGEST = 0.25, 0.8
LABEL_HEIGHT = 0.25  # m, the labels' text
LABEL_CHARS = 48
COLOURS = {"evidence": ColorRGBA(r=1.0, g=0.55, b=0.0, a=0.85), "recall": ColorRGBA(r=0.1, g=0.6, b=1.0, a=0.85)}
WHITE = ColorRGBA(r=1.0, g=1.0, b=1.0, a=1.0)


def marker_array(entries: list[Evidence], namespace: str, frame_id: str, stamp: Time, ros_time) -> MarkerArray:
    """Markers for the entries that have a pose: a DELETEALL first (the last array's go), then a sphere and a label
    each. `ros_time` turns a stream time into a builtin_interfaces/Time."""
    clear = Marker(action=Marker.DELETEALL, ns=namespace)
    clear.header.frame_id, clear.header.stamp = frame_id, stamp
    markers = [clear]
    posed = [e for e in entries if e.pose is not None]
    weights = [e.weight for e in posed]
    low, high = (min(weights), max(weights)) if weights else (0.0, 0.0)
    for i, entry in enumerate(posed):
        share = 1.0 if high == low else (entry.weight - low) / (high - low)
        size = SMALLEST + share * (LARGEST - SMALLEST)
        sphere = Marker(ns=namespace, id=2 * i, type=Marker.SPHERE, action=Marker.ADD, pose=pose_msg(entry.pose),
                        color=COLOURS.get(namespace, WHITE), lifetime=Duration())
        sphere.scale.x = sphere.scale.y = sphere.scale.z = size
        label = Marker(ns=namespace, id=2 * i + 1, type=Marker.TEXT_VIEW_FACING, action=Marker.ADD,
                       pose=pose_msg(entry.pose), color=WHITE, text=label_text(entry, ros_time), lifetime=Duration())
        label.pose.position.z += size / 2 + LABEL_HEIGHT
        label.scale.z = LABEL_HEIGHT
        for marker in (sphere, label):
            marker.header.frame_id, marker.header.stamp = frame_id, stamp
            markers.append(marker)
    return MarkerArray(markers=markers)


def label_text(entry: Evidence, ros_time) -> str:
    """"#1 08:00:31 The orange cart is by the tyres..." ("frame" and its camera for a frame)."""
    when = ""
    if entry.stamp is not None:
        t = ros_time(entry.stamp)
        when = datetime.fromtimestamp(t.sec + t.nanosec * 1e-9, timezone.utc).strftime("%H:%M:%S") + " "
    words = entry.text or f"{entry.camera + ' ' if entry.camera else ''}frame"
    words = words if len(words) <= LABEL_CHARS else words[: LABEL_CHARS - 3] + "..."
    return f"{when}{words}"


class EvidenceMarkers:
    """The node's evidence publishers (lifecycle publishers: they publish while the node is active)."""

    def __init__(self, node):
        self._node = node
        self._answer = node.create_lifecycle_publisher(MarkerArray, "~/evidence", LATCHED_QOS)
        self._recall = node.create_lifecycle_publisher(MarkerArray, "~/recall_moments", LATCHED_QOS)
        self._poses = node.create_lifecycle_publisher(PoseArray, "~/evidence_poses", 10)

    def answered(self, evidence: list[Evidence], frame_id: str, ros_time) -> None:
        stamp = self._node.get_clock().now().to_msg()
        self._answer.publish(marker_array(evidence, "evidence", frame_id, stamp, ros_time))
        posed = [e.pose for e in evidence if e.pose is not None]
        if posed:
            msg = PoseArray(poses=[pose_msg(p) for p in posed])
            msg.header.frame_id, msg.header.stamp = frame_id, stamp
            self._poses.publish(msg)

    def recalled(self, moments: list[Evidence], frame_id: str, ros_time) -> None:
        self._recall.publish(marker_array(moments, "recall", frame_id, self._node.get_clock().now().to_msg(),
                                          ros_time))
