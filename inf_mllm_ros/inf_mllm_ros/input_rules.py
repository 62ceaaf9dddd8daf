"""How the node takes its inputs, in one place for the node and the offline runner: the stream time of
an input, which text messages are taken (checked once, here), and which frames pass `frame_rate`.

Both apply these to the same messages in the same order, so a bag replayed into the node and the same
bag run offline build the same prompts. No ROS import: a header stamp is anything with `sec` and
`nanosec`.
"""

from __future__ import annotations

from typing import Any

from .engine.poses import Pose
from .engine.text_rules import CheckedText, TextRefused, checked_text


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


# What the node adds to a refused text message's reason, by its kind.
TEXT_ADVICE = {"text_too_long": "; split it into shorter messages", "text_empty": " refused (no visible character)"}


def text_message(text: Any, max_text_chars: int) -> CheckedText:
    """A text message as the node and the offline runner take it, checked once (engine/text_rules.py): the engine
    and the stream take the CheckedText as it is. Raises TextRefused with its kind and reason."""
    try:
        return checked_text(text, "text message", max_text_chars)
    except TextRefused as exc:
        raise TextRefused(exc.kind, f"{exc}{TEXT_ADVICE.get(exc.kind, '')}") from None


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
    """`frame_rate`: a frame passes when at least 1 / rate seconds have passed since the last frame that
    passed, by the frames' own times (header stamp, else arrival); rate 0 lets every frame pass.

    A frame that passes is the newest there is at that moment, so the model sees the scene as it is
    now, at most `rate` times a second, whatever the camera's rate. Judged before decoding, so a frame
    that does not pass costs nothing. A time earlier than the last one (a bag started again, a clock
    reset) starts the gate afresh.
    """

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = rate
        self._last: float | None = None

    @property
    def rate(self) -> float:
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        if not value >= 0.0:
            raise ValueError(f"frame_rate must be >= 0, got {value}")
        self._rate = float(value)

    def admit(self, seconds: float) -> bool:
        """Whether a frame of time `seconds` goes to the model; if so, the period starts again from it."""
        last = self._last
        # A small tolerance: a 10 Hz camera's stamps under frame_rate 5 are 0.2 s apart in decimal, not in binary.
        if self._rate > 0.0 and last is not None and last <= seconds < last + 1.0 / self._rate - 1e-6:
            return False
        self._last = seconds
        return True


__all__ = ["FrameGate", "StreamClock", "stamp_seconds", "text_message"]
