"""The node's inputs, and what the engine reports back about them: camera frames and texts in, descriptions out.

`Inputs` is a part the node (node/lifecycle.py) owns. Subscription callbacks only judge, convert and hand a
message to the engine, never waiting for the model: `frame_rate` is applied before decoding, per camera (FrameGate),
texts are refused with a reason before they reach the engine (input_rules), and each refused input is
counted and logged once per kind. Whatever the engine reports from its worker thread (an input done, a
description) goes through an outbox and a guard condition, so that publishing and logging happen on the
executor.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from builtin_interfaces.msg import Time
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.exceptions import InvalidParameterValueException
from rclpy.lifecycle import LifecycleNode
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from inf_mllm_interfaces.msg import Description

from ..engine.api import EngineBusyError, EngineNotReadyError, FrameDroppedError, FramesNotSupportedError, TextRefused
from ..image_conversion import ImageConversionError, compressed_msg_to_rgb, image_msg_to_rgb
from ..input_rules import FrameGate, StreamClock, camera_topics, stamp_seconds, text_message
from .health import InputsHealth, NodeCounters
from .poses import PoseInput
from .state import NodeState, ParameterReader

# Camera: newest frame only. Text: reliable, and deep enough (20 s of a 50 Hz topic) that a reader whose executor
# lags on a busy CPU loses none; the engine's own queue (max_pending_texts) bounds what waits for the model.
IMAGE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT,
                       durability=DurabilityPolicy.VOLATILE)
TEXT_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1000, reliability=ReliabilityPolicy.RELIABLE)
# Descriptions: the latest one, for a subscriber that comes late too.
LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)


class Inputs:
    """Frame gating, the text subscriptions, refused inputs, stream time, the outbox of engine reports and
    the periodic description.

    ros: the rclpy node it subscribes and publishes on. state: the node's (its engine, whether it is stopping).
    param: reads the node's parameters. counters: the node's. publish_stats: called after every input the node is
    done with (a lockstep player waits on it).
    """

    def __init__(self, ros: LifecycleNode, state: NodeState, param: ParameterReader, counters: NodeCounters,
                 publish_stats: Callable[[], None]):
        self.ros, self.state, self.param = ros, state, param
        self.counters, self.publish_stats = counters, publish_stats
        node = ros
        self._kinds_logged: set[str] = set()
        self.stream_clock = StreamClock()  # the model sees times since the first input
        try:  # read-only parameters: a camera list that cannot be taken ends the constructor, as a bad value does
            self.cameras = camera_topics(param("image_topics"), param("camera_names"))
        except ValueError as exc:
            raise InvalidParameterValueException("image_topics", param("image_topics"), str(exc)) from None
        # Each camera's frames pass frame_rate on their own: a robot's cameras see different things at once.
        self.frame_gates = {name: FrameGate(param("frame_rate")) for name, _ in self.cameras}
        self._last_frame: dict[str, float] = {}  # when each camera's last frame came (time.monotonic)
        self._subscribed_at = 0.0
        self._frame_id = ""
        self._inputs_done = 0  # bumped per ingested input and reset, so descriptions skip an unchanged memory
        self._described_at = -1
        self.description_error: str | None = None  # the last description's failure, until one succeeds
        self._describing = False
        self._description_pub = None  # from configure to cleanup
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.subscriptions: list = []
        # What each kind of report in the outbox is handed to (see post).
        self._report_handlers = {
            "ingested": self._handle_ingested,
            "frame_done": self._handle_frame_done,
            "text_done": self._handle_text_done,
            "described": self.handle_described,
        }
        # The engine's reports and the periodic description share a group: they read and write what was described.
        self.reports_group = MutuallyExclusiveCallbackGroup()
        self._wake = node.create_guard_condition(self._drain_outbox, callback_group=self.reports_group)
        self._clock_lock = threading.Lock()  # the first input, on whichever thread, starts the memory's clock
        self.poses = PoseInput(node, param("pose_topic"), param("pose_frame"), param("pose_tolerance"),
                               self.refuse_pose, map_frame=param("map_frame"),
                               base_frame=param("base_frame"), on_jump=self._poses_jumped)
        self.pose_jumps = 0  # times the poses were cleared by a jump back in time
        self.last_pose_jump: tuple[float, str] | None = None  # (time.monotonic, what happened), for /diagnostics

    def open_descriptions(self) -> None:
        # A lifecycle publisher: it publishes while the node is active only (a description finished after a
        # deactivate is dropped), as a lifecycle manager expects of a node's outputs.
        if self._description_pub is None:
            self._description_pub = self.ros.create_lifecycle_publisher(Description, "~/description", LATCHED_QOS)

    def close_descriptions(self) -> None:
        if self._description_pub is not None:
            self.ros.destroy_lifecycle_publisher(self._description_pub)
        self._description_pub = None

    def subscribe(self) -> None:
        # Each input has a callback group of its own. Under the multi-threaded executor, two inputs of one mutually
        # exclusive group that are ready together make the one that loses wake the executor again and again: under
        # a flood of texts beside a camera, its thread spun a whole core for seconds (sampled per thread), and the
        # model, short of the GIL, took almost nothing meanwhile. Alone in its group, an input is waited on only
        # when its last callback has ended, so its messages still go in one at a time and in order.
        node = self.ros
        self.subscriptions = []
        for camera, topic in self.cameras:
            said = f"{camera} " if camera else ""
            self.subscriptions += [
                node.create_subscription(
                    Image, topic, lambda m, c=camera, s=f"{said}image": self._offer_frame(m, image_msg_to_rgb, s, c),
                    IMAGE_QOS, callback_group=MutuallyExclusiveCallbackGroup()),
                node.create_subscription(
                    CompressedImage, f"{topic}/compressed",
                    lambda m, c=camera, s=f"{said}compressed": self._offer_frame(m, self._decode_compressed, s, c),
                    IMAGE_QOS, callback_group=MutuallyExclusiveCallbackGroup()),
            ]
        self._subscribed_at = time.monotonic()
        self._last_frame.clear()
        self.subscriptions += [
            node.create_subscription(String, "text", self._on_text, TEXT_QOS,
                                     callback_group=MutuallyExclusiveCallbackGroup()),
            # What the robot must not forget (a task, a code, a rule): kept ahead of what attention chooses.
            node.create_subscription(String, "text/pinned", lambda m: self._on_text(m, pin=True), TEXT_QOS,
                                     callback_group=MutuallyExclusiveCallbackGroup()),
        ]
        self.poses.start()

    def unsubscribe(self) -> None:
        for sub in self.subscriptions:
            self.ros.destroy_subscription(sub)
        self.subscriptions = []
        self.poses.stop()

    @property
    def camera_names(self) -> list[str]:
        """The cameras' names (none for a robot's one camera)."""
        return [name for name, _ in self.cameras if name]

    def health(self, camera_timeout: float) -> InputsHealth:
        """What /diagnostics says of the inputs (`camera_timeout` 0: no camera is judged silent)."""
        with self.counters.lock:
            jump, jumps = self.last_pose_jump, self.pose_jumps
        return InputsHealth(self.description_error, self.silent_cameras(camera_timeout), jump, jumps,
                            self.poses.frame_id, ", ".join(name or topic for name, topic in self.cameras))

    def set_frame_rate(self, rate: float) -> None:
        with self.counters.lock:  # the gates judge frames under it, on the image topics' threads
            for gate in self.frame_gates.values():
                gate.rate = rate

    def silent_cameras(self, timeout: float) -> list[tuple[str, float]]:
        """The cameras without a frame for over `timeout` s while subscribed, with the seconds since their last (or
        since subscribing): one that has sent frames, or any of several (a robot's one camera that never sent a
        frame may be none: a robot that only talks). Empty with timeout 0 or when not subscribed."""
        if timeout <= 0 or not self.subscriptions:
            return []
        now, silent = time.monotonic(), []
        for name, topic in self.cameras:
            last = self._last_frame.get(name)
            if last is None and len(self.cameras) == 1:
                continue
            quiet = now - (last if last is not None else self._subscribed_at)
            if quiet > timeout:
                silent.append((name or topic, quiet))
        return silent

    # --- input -------------------------------------------------------------------------------------------
    def _offer_frame(self, msg, convert, source: str, camera: str) -> None:
        # frame_rate is judged by the frame's time before decoding, so a frame held back costs nothing.
        seconds = stamp_seconds(msg.header.stamp, self.ros.get_clock().now().nanoseconds)
        self._last_frame[camera] = time.monotonic()
        with self.counters.lock:
            admitted = self.frame_gates[camera].admit(seconds)
            if not admitted:
                self.counters.frames_dropped += 1
        if admitted:
            self._ingest_frame(msg, convert, source, camera)
        else:
            self.publish_stats()  # as for a frame the model had no time for: a lockstep replay waits on it

    def _decode_compressed(self, msg):
        return compressed_msg_to_rgb(msg, max_pixels=self.param("max_decoded_pixels"))

    def _ingest_frame(self, msg, convert, source: str, camera: str) -> None:
        try:
            rgb = convert(msg)
        except ImageConversionError as exc:
            self.reject(f"{source.replace(' ', '_')}_{exc.kind}", f"{source} message refused: {exc}")
            return
        self._frame_id = msg.header.frame_id
        pose = self._pose_at(stamp_seconds(msg.header.stamp, self.ros.get_clock().now().nanoseconds))
        try:
            future = self.state.engine.submit_frame(rgb, self._stream_time(msg.header.stamp), pose=pose, camera=camera)
        except EngineNotReadyError as exc:
            self.reject("engine_closed", f"frame refused: {exc}")
            return
        future.add_done_callback(lambda f: self.post("frame_done", f))

    def _on_text(self, msg: String, pin: bool = False) -> None:
        try:
            text = text_message(msg.data, self.param("max_text_chars"))
        except TextRefused as exc:
            self.reject(exc.kind, str(exc))
            return
        pose = self._pose_at(stamp_seconds(None, self.ros.get_clock().now().nanoseconds))
        engine = self.state.engine
        try:
            future = engine.submit_text(text, self._stream_time(None), pin=pin, pose=pose)
        except EngineNotReadyError as exc:
            self.reject("engine_closed", f"text refused: {exc}")
            return
        if future.done() and isinstance(future.exception(), EngineBusyError):
            # Counted without a ~/cache_stats message of its own: this happens under a flood (a lockstep player
            # sends one input at a time and never meets it), where a message per refusal would cost both sides
            # what the model needs; the next stats carry the count.
            with self.counters.lock:
                self.counters.inputs_rejected += 1
            self.ros.get_logger().warning(
                f"{future.exception()} (refused so far: {engine.counters.texts_refused}); "
                "the model cannot keep up with the text topic", throttle_duration_sec=2.0)
            return
        future.add_done_callback(lambda f: self.post("text_done", f))

    def _pose_at(self, seconds: float):
        """The robot's pose at an input's time; the memory keeps the frame of its poses from the first one on."""
        pose = self.poses.at(seconds)
        engine = self.state.engine
        if pose is not None and engine is not None and engine.pose_frame != self.poses.frame_id:
            engine.pose_frame = self.poses.frame_id
        return pose

    def clear_poses(self, why: str) -> None:
        """Forget the robot's poses (the memory was reset): none from before is given to a later input."""
        self.poses.clear()
        self._note_pose_jump(f"{why}: pose history cleared")

    def _poses_jumped(self, seconds: float) -> None:
        self._note_pose_jump(f"time jumped back {seconds:.1f} s (a looped bag or a simulator reset): pose history "
                             "cleared")

    def _note_pose_jump(self, what: str) -> None:
        with self.counters.lock:
            self.pose_jumps += 1
            self.last_pose_jump = (time.monotonic(), what)
        self.ros.get_logger().warning(what, throttle_duration_sec=1.0)

    def refuse_pose(self, kind: str, message: str) -> None:
        """A refused pose: counted and logged as a refused input, without a `~/cache_stats` message of its own (an
        odometry topic comes at tens of Hz; the next stats carry the count)."""
        self.reject(kind, message, publish=False)

    def reject(self, kind: str, message: str, *, publish: bool = True) -> None:
        """Count a refused input; log the first of each kind only, so a bad stream cannot flood the log."""
        with self.counters.lock:
            self.counters.inputs_rejected += 1
            first = kind not in self._kinds_logged
            self._kinds_logged.add(kind)
            self.counters.last_error = message
        if first:
            self.ros.get_logger().warning(
                f"{message} [further '{kind}' inputs are counted in ~/cache_stats, not logged]")
        if publish:  # after every input the node is done with, so a lockstep player can move on
            self.publish_stats()

    def _stream_time(self, stamp) -> float:
        """Seconds since the first input (of the memory, across restarts); a zero stamp means now."""
        with self._clock_lock:
            seconds = self.stream_clock(stamp, self.ros.get_clock().now().nanoseconds)
            engine = self.state.engine
            if engine.time_origin is None:  # the first input: the memory keeps its clock from now on
                engine.time_origin = self.stream_clock.origin
        return seconds

    def now_stream_time(self) -> float | None:
        """The node clock's now in stream time (a question's time, for "how long ago"); None before the first input."""
        with self._clock_lock:
            return self.stream_clock.time_of(stamp_seconds(None, self.ros.get_clock().now().nanoseconds))

    def restart_clock(self, origin: float | None) -> None:
        """Times go on from this caller's time of stream time 0 (a restored memory's), or from the next input."""
        with self._clock_lock:
            self.stream_clock = StreamClock(origin)

    @property
    def time_origin(self) -> float | None:
        """The caller's time of stream time 0, None before the first input."""
        return self.stream_clock.origin

    @property
    def pose_frame(self) -> str:
        """The frame the inputs' poses are in ("" before the first pose)."""
        return self.poses.frame_id

    def keep_pose_frame(self, frame: str) -> None:
        """Poses in this frame only (a restored memory's)."""
        self.poses.keep_frame(frame)

    def descriptions_restarted(self) -> None:
        """A description's failure is news only while descriptions run: a new period starts without it."""
        self.description_error = None

    def ros_time(self, stream_time: float | None) -> Time:
        if stream_time is None or self.stream_clock.origin is None:
            return Time()
        seconds = self.stream_clock.origin + stream_time
        sec = math.floor(seconds)
        return Time(sec=int(sec), nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))

    # --- reports from the engine's threads, handled on the executor ----------------------------------------
    def post(self, kind: str, payload) -> None:
        self._outbox.put((kind, payload))
        try:
            self._wake.trigger()
        except Exception:  # the node is shutting down
            pass

    def _drain_outbox(self) -> None:
        while True:
            try:
                kind, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._report_handlers[kind](payload)

    def _handle_ingested(self, _kind: str) -> None:
        self._inputs_done += 1
        self.publish_stats()

    def _handle_frame_done(self, future: Future) -> None:
        exc = future.exception()
        if exc is None:
            return
        if isinstance(exc, FrameDroppedError):
            self.publish_stats()
        elif isinstance(exc, FramesNotSupportedError):
            self.reject("frames_not_supported", f"{exc}; frames are counted as rejected. Set 'model' to a "
                                                 "vision-language model to use the camera")
        else:
            self.reject(f"frame_{type(exc).__name__}", f"frame failed in the model: {exc}")

    def _handle_text_done(self, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            self.reject(f"text_{type(exc).__name__}", f"text failed in the model: {exc}")

    def handle_described(self, future: Future) -> None:
        self._describing = False
        exc = future.exception()
        if exc is not None:
            if not isinstance(exc, (EngineBusyError, EngineNotReadyError)):
                self.description_error = str(exc)  # in /diagnostics until one succeeds
                self.ros.get_logger().warning(f"description failed: {exc}", throttle_duration_sec=60.0)
            return
        self.description_error = None
        answer = future.result()
        msg = Description(text=answer.text, cache_fill=answer.cache_fill, generation_time=answer.latency)
        msg.header.stamp = self.ros_time(answer.newest_frame_stamp)
        msg.header.frame_id = self._frame_id
        engine = self.state.engine
        stats = engine.stats() if engine is not None else None
        msg.frames_seen = stats.frames_ingested if stats is not None else 0
        if self._description_pub is not None:
            self._description_pub.publish(msg)

    # --- periodic output ---------------------------------------------------------------------------------
    def on_description_timer(self) -> None:
        # One description at a time, and none while nothing new has come in.
        engine = self.state.engine
        if (self._describing or self.state.stopping.is_set() or not engine.ready.is_set()
                or self._inputs_done == self._described_at):
            return
        stats = engine.stats()
        if stats is None or stats.tokens_seen == 0:
            return
        self._described_at = self._inputs_done
        try:
            future = engine.submit_describe(self.param("description_prompt") or None,
                                            max_new_tokens=self.param("max_new_tokens"))
        except EngineNotReadyError:  # closed under the timer
            return
        self._describing = True
        future.add_done_callback(lambda f: self.post("described", f))
