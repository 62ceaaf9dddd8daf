"""How the node takes its inputs, in one place for the node and the offline runner: the stream time of
an input, which text messages are taken (checked once, here), and which frames pass `frame_rate`.

Both apply these to the same messages in the same order, so a bag replayed into the node and the same
bag run offline build the same prompts. No ROS import: a header stamp is anything with `sec` and
`nanosec`.
"""

from __future__ import annotations

import math
from typing import Any

from .engine.poses import Pose
from .engine.text_rules import CheckedText, checked_text
from .engine.value_rules import camera_problem

# The topic a single camera comes on, relative to the node (remapped by the launch file's image_topic).
DEFAULT_IMAGE_TOPIC = "image"
# Topic segments that say what a topic carries rather than which camera: a camera is named by the last segment of
# its topic that is none of these ("front/image_raw" -> front, "/arm_cam/color/image_rect" -> arm_cam).
GENERIC_TOPIC_WORDS = frozenset({"image", "image_raw", "image_rect", "image_color", "image_rect_color", "image_mono",
                                 "color", "rgb", "camera", "compressed"})


def stamp_seconds(header_stamp: Any | None, now_ns: int) -> float:
    """An input's time in seconds: its header stamp, or `now_ns` (the node clock) when that is None or zero."""
    # The same arithmetic everywhere, so stamps print the same to the last digit.
    seconds = header_stamp.sec + header_stamp.nanosec * 1e-9 if header_stamp is not None else 0.0
    return seconds if seconds != 0.0 else now_ns * 1e-9


class StreamClock:
    """Stream time: seconds since the first input taken in (a refused input does not start it)."""

    def __init__(self, origin: float | None = None) -> None:
        # Seconds (stamp_seconds) of stream time 0: the first input taken in, or a restored memory's.
        self.origin = origin

    def __call__(self, header_stamp: Any | None, now_ns: int) -> float:
        seconds = stamp_seconds(header_stamp, now_ns)
        if self.origin is None:
            self.origin = seconds
        return seconds - self.origin

    def time_of(self, seconds: float) -> float | None:
        """A moment (in `stamp_seconds`' seconds: a question's time) in stream time without starting the clock; None
        before the first input."""
        return None if self.origin is None else seconds - self.origin


def text_message(text: Any, max_text_chars: int) -> CheckedText:
    """A text message as the node and the bag tools take it from a topic: the one text rule (engine/text_rules.py,
    `checked_text`), so the engine and the stream take the CheckedText as it is. Raises TextRefused with its kind
    and reason."""
    return checked_text(text, "text message", max_text_chars)


# The pose messages a robot publishes, by type name: where the pose is in each.
POSE_MESSAGE_TYPES = ("nav_msgs/msg/Odometry", "geometry_msgs/msg/PoseStamped",
                      "geometry_msgs/msg/PoseWithCovarianceStamped")


def pose_message(msg: Any, msgtype: str) -> tuple[Pose, str]:
    """A pose message (a type in POSE_MESSAGE_TYPES, from rclpy or from a bag) as the pose and its frame: the node
    and the offline runner read poses alike (their time: `stamp_seconds` of the header's stamp)."""
    pose = msg.pose if msgtype == "geometry_msgs/msg/PoseStamped" else msg.pose.pose
    p, q = pose.position, pose.orientation
    return Pose(p.x, p.y, p.z, q.x, q.y, q.z, q.w), msg.header.frame_id


class FrameGate:
    """`frame_rate`: the first frame of each 1 / rate-second period passes, by the frames' own times (header stamp,
    else arrival), the periods counted from the first frame that passed; rate 0 lets every frame pass.

    A frame that passes is the newest there is at that moment, so the model sees the scene as it is now, `rate`
    times a second whatever the camera's rate. The periods are fixed rather than restarted at each frame that
    passes: a camera's stamps jitter by milliseconds, and a gate that waited 1 / rate from the last frame taken
    would hold back the frame due a millisecond early and take the next one, a camera interval late, again and
    again (a 5 Hz camera under rate 1: about 0.87 frames a second). Two frames that pass are at least 1 / rate less
    one camera interval apart. Judged before decoding, so a frame that does not pass costs nothing. A time earlier
    than the last one (a bag started again, a clock reset) or a new rate starts the periods afresh.
    """

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = rate

    @property
    def rate(self) -> float:
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        if not value >= 0.0:
            raise ValueError(f"frame_rate must be >= 0, got {value}")
        self._rate = float(value)
        self._origin: float | None = None  # the time the periods are counted from
        self._last = float("-inf")  # the time of the last frame that passed
        self._last_period = -1

    def admit(self, seconds: float) -> bool:
        """Whether a frame of time `seconds` goes to the model: the first one seen in its period."""
        if self._origin is None or seconds < self._last:
            self._origin, self._last_period = seconds, -1
        # A small tolerance: a 10 Hz camera's stamps under frame_rate 5 are 0.2 s apart in decimal, not in binary.
        period = math.floor((seconds - self._origin) * self._rate + 1e-6) if self._rate > 0.0 else self._last_period + 1
        if period <= self._last_period:
            return False
        self._last, self._last_period = seconds, period
        return True


__all__ = ["FrameGate", "StreamClock", "stamp_seconds", "text_message"]


def camera_topics(image_topics: list[str], camera_names: list[str]) -> list[tuple[str, str]]:
    """Each camera's (name, image topic). One topic: the robot's one camera, unnamed (its frames say no camera, as
    before there were several). Several: each named by `camera_names` (same order) or, where that is empty, by its
    topic (GENERIC_TOPIC_WORDS). Empty entries are left out (a parameter's empty default). ValueError for no topic,
    a topic given twice, names that do not match the topics, a name given twice or one the camera rule refuses."""
    topics = [t.strip() for t in image_topics if t.strip()]
    names = [n.strip() for n in camera_names if n.strip()]
    if not topics:
        raise ValueError("image_topics names no topic")
    if len(set(topics)) != len(topics):
        raise ValueError(f"image_topics names a topic twice: {topics}")
    if len(topics) == 1:
        return [(names[0] if names else "", topics[0])]
    if names and len(names) != len(topics):
        raise ValueError(f"camera_names gives {len(names)} names for {len(topics)} image_topics")
    names = names or [topic_camera_name(t) for t in topics]
    if len(set(names)) != len(names):
        raise ValueError(f"two cameras have one name {names}: set camera_names")
    for name in names:
        problem = camera_problem(name)
        if problem:
            raise ValueError(f"{problem}; set camera_names")
    return list(zip(names, topics))


def topic_camera_name(topic: str) -> str:
    """A camera's name from its topic: the last segment that names no kind of image (GENERIC_TOPIC_WORDS), else
    the topic's segments joined."""
    segments = [s for s in topic.strip("/~").split("/") if s]
    for segment in reversed(segments):
        if segment.lower() not in GENERIC_TOPIC_WORDS:
            return segment
    return "_".join(segments)


def transform_message(msg: Any) -> tuple[str, str, Pose]:
    """A geometry_msgs/TransformStamped (from rclpy or from a bag) as (parent frame, child frame, the child's pose
    in the parent): the node and the offline runner read /tf alike."""
    t, q = msg.transform.translation, msg.transform.rotation
    return msg.header.frame_id, msg.child_frame_id, Pose(t.x, t.y, t.z, q.x, q.y, q.z, q.w)
