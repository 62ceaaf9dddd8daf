"""Bag messages as the node's inputs: one mapping for the replay tool and the offline runner.

The node (`inf_mllm_node`) takes frames on `image` and `image/compressed`, texts on `text` and
texts to keep on `text/pinned`, and stamps every input for the model with its time since the
node's first input: a frame's ``header.stamp``, a text's arrival on the node clock (a zero stamp
also means "now"). When the
node runs with ``use_sim_time`` and a player publishes ``/clock`` with each message's bag time,
"now" is that bag time. :class:`StreamClock` applies the same rule to bag messages, so the
offline runner builds the prompts the node builds from the same bag, and a greedy answer from
either is the same.

Which bag topic feeds which input follows the remappings of the replay tool (:data:`DEFAULT_REMAPS`
makes the sample bag feed the node out of the box). Questions are asked at bag times, in seconds
from the bag's first message, once every message up to that time has been taken in.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..engine.text_rules import TextRefused, checked_text, is_blank
from ..image_conversion import ImageConversionError, msg_to_rgb
from ..input_rules import (POSE_MESSAGE_TYPES, FrameGate, StreamClock, pose_message, stamp_seconds, text_message,
                           transform_message)
from .bag_io import Bag, BagError, BagMessage

__all__ = [
    "DEFAULT_REMAPS",
    "Question",
    "StreamInput",
    "chosen_questions",
    "input_kind",
    "load_questions",
    "node_namespace",
    "open_selected",
    "parse_ask",
    "parse_remaps",
    "pose_source",
    "transform_sources",
    "questions_due",
    "resolve",
    "select_inputs",
    "stream_inputs",
    "times_of_day",
]

# Bag topics of the sample bags (and common camera drivers) -> the node's input names.
DEFAULT_REMAPS = {
    "/camera/image_raw": "image",
    "/camera/image_raw/compressed": "image/compressed",
    "/narration": "text",
}
# The node's input names, the message type each takes, and what they carry.
NODE_INPUTS = {
    "image": ("sensor_msgs/msg/Image", "frame"),
    "image/compressed": ("sensor_msgs/msg/CompressedImage", "frame"),
    "text": ("std_msgs/msg/String", "text"),
    "text/pinned": ("std_msgs/msg/String", "pinned"),
}


def parse_remaps(items: Iterable[str], *, defaults: bool = True) -> dict[str, str]:
    """``FROM:=TO`` strings (as ``ros2 bag play --remap``) on top of the defaults."""
    remaps = dict(DEFAULT_REMAPS) if defaults else {}
    for item in items:
        source, sep, target = item.partition(":=")
        if not sep or not source or not target:
            raise ValueError(f"remap must look like /bag/topic:=node_input, got {item!r}")
        remaps[source] = target
    return remaps


def node_namespace(node: str) -> str:
    """The namespace of a node's full name: '/robot1/inf_mllm' -> '/robot1', '/inf_mllm' -> ''."""
    return ("/" + node.strip("/")).rsplit("/", 1)[0]


def resolve(name: str, namespace: str) -> str:
    """A topic name as a node in ``namespace`` resolves it: relative names go into the namespace."""
    return name if name.startswith("/") else f"{namespace}/{name}"


def input_kind(target: str, namespace: str = "") -> str | None:
    """The input of a node in ``namespace`` that a published topic name reaches: 'image', 'image/compressed',
    'text', 'text/pinned' or None. The node's inputs are relative names: ``text`` and ``/robot1/text``
    reach a node in ``/robot1``; ``/camera/depth/image`` reaches none."""
    name = resolve(target, namespace)
    for node_input in NODE_INPUTS:
        if name == f"{namespace}/{node_input}":
            return node_input
    return None


def select_inputs(topics: dict[str, str], remaps: dict[str, str], namespace: str = "") -> dict[str, str]:
    """Bag topic -> 'frame', 'text' or 'pinned', for the topics that reach an input of a node in ``namespace``
    after remapping.

    ``topics`` maps each bag topic to its message type. A topic remapped to an input of another
    type is an error: the node would never receive it.
    """
    out: dict[str, str] = {}
    for topic, msgtype in topics.items():
        node_input = input_kind(remaps.get(topic, topic), namespace)
        if node_input is None:
            continue
        want, kind = NODE_INPUTS[node_input]
        if msgtype != want:
            raise BagError(f"topic {topic!r} ({msgtype}) is remapped to the node input {node_input!r}, "
                           f"which takes {want}; remap it elsewhere")
        out[topic] = kind
    return out


def pose_source(topics: dict[str, str], remaps: dict[str, str], pose_topic: str, namespace: str = "") -> str | None:
    """The bag topic that reaches a node's `pose_topic` after remapping (None: no pose topic, or none reaches it);
    BagError where it is not of a pose type."""
    if not pose_topic:
        return None
    wanted = resolve(pose_topic, namespace)
    for topic, msgtype in topics.items():
        if resolve(remaps.get(topic, topic), namespace) == wanted:
            if msgtype not in POSE_MESSAGE_TYPES:
                raise BagError(f"topic {topic!r} ({msgtype}) reaches pose_topic {pose_topic!r}, which takes "
                               f"{', '.join(POSE_MESSAGE_TYPES)}")
            return topic
    return None


# The topics tf2 listens on, and whether what they carry holds at every time.
TRANSFORM_TOPICS = {"/tf": False, "/tf_static": True}
TRANSFORM_TYPE = "tf2_msgs/msg/TFMessage"


def transform_sources(topics: dict[str, str], remaps: dict[str, str]) -> dict[str, bool]:
    """The bag topics that reach /tf or /tf_static after remapping (bag topic -> static), as a node's tf2 takes
    them (absolute names: a node in a namespace still listens on /tf)."""
    out = {}
    for topic, msgtype in topics.items():
        target = remaps.get(topic, topic)
        if target in TRANSFORM_TOPICS and msgtype == TRANSFORM_TYPE:
            out[topic] = TRANSFORM_TOPICS[target]
    return out


@dataclass
class StreamInput:
    """One bag message as the node takes it: 'frame' (RGB array), 'text', 'pinned' (a text to keep), 'rejected'
    (data: the reason), 'frame_dropped' (held back by frame_rate; data None), 'pose' (data: the pose and its
    frame) or 'transforms' (data: (parent, child, pose, stamp, static) of each transform)."""

    kind: str
    topic: str
    bag_time: float  # seconds since the bag's first message
    stamp: float | None  # stream time the node gives it; None when rejected, and for a pose
    data: Any  # RGB array, text, the reason it was refused, or (Pose, frame_id)
    clock_s: float | None = None  # its time on the node's clock (header stamp or arrival): where a pose is looked up


def stream_inputs(messages: Iterable[BagMessage], kinds: dict[str, str], start_ns: int, *,
                  max_text_chars: int, max_decoded_pixels: int, frame_rate: float,
                  clock: StreamClock | None = None, pose_topic: str | None = None,
                  transform_topics: dict[str, bool] | None = None) -> Iterator[StreamInput]:
    """The node's inputs from bag messages in bag order, by the node's rules (input_rules) and settings, with
    the poses of `pose_topic` (a bag topic, `pose_source`) and the transforms of `transform_topics` (bag topic ->
    static: `transform_sources`); messages on other topics are skipped.

    A frame first passes `frame_rate` (by its time, before decoding), then is refused if it does not
    decode or declares more than ``max_decoded_pixels``; a text is refused if empty or longer than
    ``max_text_chars``. A refused input does not start the stream clock.
    """
    clock = clock or StreamClock()
    gate = FrameGate(frame_rate)
    transform_topics = transform_topics or {}
    for item in messages:
        kind = kinds.get(item.topic)
        if kind is None and item.topic != pose_topic and item.topic not in transform_topics:
            continue
        bag_time = (item.timestamp_ns - start_ns) / 1e9
        msg = item.msg
        if item.topic in transform_topics:
            yield StreamInput("transforms", item.topic, bag_time, None,
                              [(*transform_message(t), stamp_seconds(t.header.stamp, item.timestamp_ns),
                                transform_topics[item.topic]) for t in msg.transforms])
        elif kind is None:
            yield StreamInput("pose", item.topic, bag_time, None, pose_message(msg, item.msgtype),
                              stamp_seconds(msg.header.stamp, item.timestamp_ns))
        elif kind == "frame":
            seconds = stamp_seconds(msg.header.stamp, item.timestamp_ns)
            if not gate.admit(seconds):
                yield StreamInput("frame_dropped", item.topic, bag_time, None, None)
                continue
            try:
                data = msg_to_rgb(msg, max_decoded_pixels=max_decoded_pixels)
            except ImageConversionError as exc:
                yield StreamInput("rejected", item.topic, bag_time, None, f"{exc.kind}: {exc}")
                continue
            yield StreamInput("frame", item.topic, bag_time, clock(msg.header.stamp, item.timestamp_ns), data,
                              seconds)
        elif kind is not None:
            try:
                text = text_message(msg.data, max_text_chars)
            except TextRefused as exc:
                yield StreamInput("rejected", item.topic, bag_time, None, str(exc))
                continue
            yield StreamInput(kind, item.topic, bag_time, clock(None, item.timestamp_ns), text,
                              stamp_seconds(None, item.timestamp_ns))


# --- questions at bag times -------------------------------------------------------------------

TIME_OF_DAY = re.compile(r"\b(\d{1,2}):(\d{2})(?::(\d{2}))?")
# How far a time of day in an answer may be from the expected one for the answer to hold it.
TIME_TOLERANCE_S = 2.0


def times_of_day(text: str) -> list[int]:
    """Every time of day written in `text` ("08:01:16", "8:01"), as seconds since midnight."""
    return [int(h) * 3600 + int(m) * 60 + int(s or 0) for h, m, s in TIME_OF_DAY.findall(text)]


@dataclass(frozen=True)
class Question:
    """Ask ``question`` once the stream has passed ``time_s`` seconds from the bag's start."""

    time_s: float
    question: str
    expected: str = ""
    needs_vision: bool = False  # answerable only from what the frames show, not from any text
    kind: str = "descriptive"  # or "temporal" (expected: a time of day) or "spatial" (expected: a place)
    about_s: float | None = None  # the moment the answer rests on, seconds from the bag's start, where known
    place_xy: tuple[float, float] | None = None  # where the robot was then (the pose topic's frame), where known

    def matches(self, answer: str) -> bool | None:
        """Whether the answer holds the expected words (None when nothing is expected); for a time of day, a time
        within TIME_TOLERANCE_S of it however written ("8:00:31" holds "08:00:31")."""
        if not self.expected:
            return None
        expected = times_of_day(self.expected)
        if self.kind == "temporal" and expected:
            return any(abs(t - expected[0]) <= TIME_TOLERANCE_S for t in times_of_day(answer))
        return self.expected.lower() in answer.lower()

    def mark(self, correct: bool | None) -> str:
        """What follows a printed answer: whether it holds the expected words, and whether it needs sight."""
        mark = {True: "  [ok]", False: f"  [expected: {self.expected}]", None: ""}[correct]
        return mark + ("  (needs trained vision)" if self.needs_vision else "")


def parse_ask(text: str) -> Question:
    """``"T:question"`` -> Question(T, question); T in seconds from the bag's start."""
    head, sep, question = text.partition(":")
    try:
        time_s = float(head)
    except ValueError:
        time_s = math.nan
    if not sep or is_blank(question) or not math.isfinite(time_s) or time_s < 0:
        raise ValueError(f"--ask must look like 'SECONDS:question', e.g. '8:Where did F2 park?', got {text!r}")
    try:
        return Question(time_s, checked_text(question, "question"))
    except TextRefused as exc:
        raise ValueError(f"--ask {text!r}: {exc}") from None


def load_questions(path: str | Path) -> list[Question]:
    """A questions YAML (a list of {time_s, question, expected, needs_vision, kind, about_s, place_xy}), as the
    sample bags carry."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read questions: {exc}") from None
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise ValueError(f"{path}: expected a list of {{time_s, question, expected}}")
    out = []
    for i, entry in enumerate(doc):
        try:
            time_s, question = float(entry["time_s"]), str(entry["question"]).strip()
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: entry {i} needs a number time_s and a question") from None
        if is_blank(question) or not math.isfinite(time_s) or time_s < 0:
            raise ValueError(f"{path}: entry {i} needs a time_s >= 0 and a non-empty question")
        try:
            question = checked_text(question, "question")
        except TextRefused as exc:
            raise ValueError(f"{path}: entry {i}: {exc}") from None
        try:
            about = None if entry.get("about_s") is None else float(entry["about_s"])
            place = None if entry.get("place_xy") is None else tuple(float(v) for v in entry["place_xy"][:2])
        except (TypeError, ValueError):
            raise ValueError(f"{path}: entry {i}: about_s must be a number and place_xy [x, y]") from None
        out.append(Question(time_s, question, str(entry.get("expected") or ""), bool(entry.get("needs_vision")),
                            str(entry.get("kind") or "descriptive"), about, place))
    return sorted(out, key=lambda q: q.time_s)


def chosen_questions(ask: Sequence[str], questions_file: str | None, default_file: Path | None = None
                     ) -> list[Question]:
    """The questions a run asks, in time order: those given as "T:question" (`--ask`), else a questions
    file, else `default_file` where it exists (the offline runner's questions.yaml beside the bag)."""
    if ask:
        return sorted((parse_ask(a) for a in ask), key=lambda q: q.time_s)
    if questions_file:
        return load_questions(questions_file)
    if default_file is not None and default_file.is_file():
        return load_questions(default_file)
    return []


def tally(graded: Sequence[tuple[bool | None, bool]]) -> str:
    """One line on the answers, as (correct, needs_vision) pairs: those answerable from the texts and
    those that need a model that sees are counted apart, since the embedded models cannot see."""
    parts = []
    for vision, name in ((False, "answerable from the texts"), (True, "that need trained vision")):
        marks = [correct for correct, needs in graded if correct is not None and needs == vision]
        if marks:
            parts.append(f"{sum(marks)} of {len(marks)} {name}")
    return ("; ".join(parts) + " hold the expected words") if parts else ""


def questions_due(questions: Sequence[Question], asked: int, bag_time: float | None) -> list[Question]:
    """Questions to ask before a message at ``bag_time`` (None: the end of the bag).

    A question at time T is asked after every message up to T, before the first one after it.
    ``questions`` is sorted by time; ``asked`` is how many were asked already.
    """
    due = []
    for q in questions[asked:]:
        if bag_time is not None and q.time_s >= bag_time:
            break
        due.append(q)
    return due


def open_selected(path: str | Path, remaps: dict[str, str], only: Sequence[str] | None = None, *,
                  namespace: str = "", notice: Callable[[str], None] | None = None
                  ) -> tuple[Bag, dict[str, str], dict[str, str]]:
    """Open a bag; returns it, its topics (name -> type, limited to ``only``) and the inputs they reach of a
    node in ``namespace``.

    A topic that reaches no node input and whose type has no definition is left out, with a ``notice``
    (as ``ros2 bag play`` skips it). Raises BagError for a missing or malformed bag, a topic named in
    ``only`` that the bag lacks, an input topic whose type has no definition, or no topic reaching the node.
    """
    from .bag_io import open_bag

    bag = open_bag(path)
    try:
        topics = {name: t.msgtype for name, t in bag.topics.items()}
        if only:
            missing = [t for t in only if t not in topics]
            if missing:
                raise BagError(f"{bag.path}: no topic {', '.join(map(repr, missing))} in the bag; "
                               f"it has {', '.join(topics) or 'no topics'}")
            topics = {t: topics[t] for t in topics if t in only}
        kinds = select_inputs(topics, remaps, namespace)
        for msgtype, names in bag.unknown_types.items():
            for name in names:
                if name in kinds:
                    raise BagError(f"{bag.path}: topic {name!r} has message type {msgtype!r}, which has no "
                                   "definition in the bag nor in the rosbags type store; leave it out with --topics")
                if name in topics:
                    del topics[name]
                    if notice is not None:
                        notice(f"topic {name} skipped: its type {msgtype} has no definition in the bag nor in "
                               "the rosbags type store")
        if not kinds:
            raise BagError(f"{bag.path}: no topic reaches an input of the node (image, image/compressed, text, "
                           f"text/pinned{' in ' + namespace if namespace else ''}); "
                           f"the bag has {', '.join(f'{n} ({t})' for n, t in topics.items()) or 'no topics'}; "
                           "map one with --remap /bag/topic:=text, or name the node (--node /ns/inf_mllm)")
    except BaseException:
        bag.close()
        raise
    return bag, topics, kinds
