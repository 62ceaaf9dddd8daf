"""The node's inputs, and what the engine reports back about them: camera frames and texts in, descriptions out.

`NodeInputs` is a part of `InfMLLMNode` (node.py). Subscription callbacks only judge, convert and hand a
message to the engine, never waiting for the model: `frame_rate` is applied before decoding (FrameGate),
texts are refused with a reason before they reach the engine (input_rules), and each refused input is
counted and logged once per kind. Whatever the engine reports from its worker thread (an input done, a
description) goes through an outbox and a guard condition, so that publishing and logging happen on the
executor.
"""

from __future__ import annotations

import math
import queue
from concurrent.futures import Future

from builtin_interfaces.msg import Time
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from inf_mllm_interfaces.msg import Description

from .engine.adapters import FramesNotSupportedError
from .engine.engine import EngineBusyError, EngineNotReadyError, FrameDroppedError
from .image_conversion import ImageConversionError, compressed_msg_to_rgb, image_msg_to_rgb
from .input_rules import FrameGate, StreamClock, stamp_seconds, text_refusal
from .node_poses import PoseInput

# Camera: newest frame only. Text: reliable, never dropped by the middleware.
IMAGE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT,
                       durability=DurabilityPolicy.VOLATILE)
TEXT_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=50, reliability=ReliabilityPolicy.RELIABLE)
# Descriptions: the latest one, for a subscriber that comes late too.
LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)


class NodeInputs:
    """Frame gating, the text subscriptions, refused inputs, stream time, the outbox of engine reports and
    the periodic description.

    A mixin of `InfMLLMNode`: it uses the node's `engine`, `_lock`, `_stopping`, `_last_error`,
    `_description_pub`, `_param` and `_publish_stats`.
    """

    def _init_inputs(self) -> None:
        """The inputs' counters and bookkeeping, and the guard condition that drains the outbox."""
        self._inputs_rejected = 0
        self._frames_dropped = 0  # held back by frame_rate
        self._kinds_logged: set[str] = set()
        self._stream_clock = StreamClock()  # the model sees times since the first input
        self._frame_gate = FrameGate(self.get_parameter("frame_rate").value)
        self._frame_id = ""
        self._inputs_done = 0  # bumped per ingested input and reset, so descriptions skip an unchanged memory
        self._described_at = -1
        self._description_error: str | None = None
        self._describing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._input_subscriptions: list = []
        # What each kind of report in the outbox is handed to (see _post).
        self._report_handlers = {
            "ingested": self._handle_ingested,
            "frame_done": self._handle_frame_done,
            "text_done": self._handle_text_done,
            "described": self._handle_described,
        }
        self._wake = self.create_guard_condition(self._drain_outbox)
        self._poses = PoseInput(self, self.get_parameter("pose_topic").value, self.get_parameter("pose_frame").value,
                                self.get_parameter("pose_tolerance").value, self._reject)

    def _subscribe_inputs(self) -> None:
        self._input_subscriptions = [
            self.create_subscription(Image, "image", lambda m: self._offer_frame(m, image_msg_to_rgb, "image"),
                                     IMAGE_QOS),
            self.create_subscription(CompressedImage, "image/compressed",
                                     lambda m: self._offer_frame(m, self._decode_compressed, "compressed"), IMAGE_QOS),
            self.create_subscription(String, "text", self._on_text, TEXT_QOS),
            # What the robot must not forget (a task, a code, a rule): kept ahead of what attention chooses.
            self.create_subscription(String, "text/pinned", lambda m: self._on_text(m, pin=True), TEXT_QOS),
        ]
        self._poses.start()

    def _unsubscribe_inputs(self) -> None:
        for sub in self._input_subscriptions:
            self.destroy_subscription(sub)
        self._input_subscriptions = []
        self._poses.stop()

    # --- input -------------------------------------------------------------------------------------------
    def _offer_frame(self, msg, convert, source: str) -> None:
        # frame_rate is judged by the frame's time before decoding, so a frame held back costs nothing.
        seconds = stamp_seconds(msg.header.stamp, self.get_clock().now().nanoseconds)
        with self._lock:
            admitted = self._frame_gate.admit(seconds)
            if not admitted:
                self._frames_dropped += 1
        if admitted:
            self._ingest_frame(msg, convert, source)
        else:
            self._publish_stats()  # as for a frame the model had no time for: a lockstep replay waits on it

    def _decode_compressed(self, msg):
        return compressed_msg_to_rgb(msg, max_pixels=self._param("max_decoded_pixels"))

    def _ingest_frame(self, msg, convert, source: str) -> None:
        try:
            rgb = convert(msg)
        except ImageConversionError as exc:
            self._reject(f"{source}_{exc.kind}", f"{source} message refused: {exc}")
            return
        self._frame_id = msg.header.frame_id
        pose = self._poses.at(stamp_seconds(msg.header.stamp, self.get_clock().now().nanoseconds))
        try:
            future = self.engine.submit_frame(rgb, self._stream_time(msg.header.stamp), pose=pose)
        except EngineNotReadyError as exc:
            self._reject("engine_closed", f"frame refused: {exc}")
            return
        future.add_done_callback(lambda f: self._post("frame_done", f))

    def _on_text(self, msg: String, pin: bool = False) -> None:
        text = msg.data
        refusal = text_refusal(text, self._param("max_text_chars"))
        if refusal is not None:
            self._reject(*refusal)
            return
        pose = self._poses.at(stamp_seconds(None, self.get_clock().now().nanoseconds))
        try:
            future = self.engine.submit_text(text, self._stream_time(None), pin=pin, pose=pose)
        except EngineNotReadyError as exc:
            self._reject("engine_closed", f"text refused: {exc}")
            return
        if future.done() and isinstance(future.exception(), EngineBusyError):
            with self._lock:
                self._inputs_rejected += 1
            self.get_logger().warning(
                f"{future.exception()} (refused so far: {self.engine.counters.texts_refused}); "
                "the model cannot keep up with the text topic", throttle_duration_sec=2.0)
            self._publish_stats()
            return
        future.add_done_callback(lambda f: self._post("text_done", f))

    def _reject(self, kind: str, message: str) -> None:
        """Count a refused input; log the first of each kind only, so a bad stream cannot flood the log."""
        with self._lock:
            self._inputs_rejected += 1
            first = kind not in self._kinds_logged
            self._kinds_logged.add(kind)
            self._last_error = message
        if first:
            self.get_logger().warning(f"{message} [further '{kind}' inputs are counted in ~/cache_stats, not logged]")
        # After every input the node is done with, so a lockstep player can move on.
        self._publish_stats()

    def _stream_time(self, stamp) -> float:
        """Seconds since the first input (of the memory, across restarts); a zero stamp means now."""
        seconds = self._stream_clock(stamp, self.get_clock().now().nanoseconds)
        if self.engine.time_origin is None:  # the first input: the memory keeps its clock from now on
            self.engine.time_origin = self._stream_clock.origin
        return seconds

    def _ros_time(self, stream_time: float | None) -> Time:
        if stream_time is None or self._stream_clock.origin is None:
            return Time()
        seconds = self._stream_clock.origin + stream_time
        sec = math.floor(seconds)
        return Time(sec=int(sec), nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))

    # --- reports from the engine's threads, handled on the executor ----------------------------------------
    def _post(self, kind: str, payload) -> None:
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
        self._publish_stats()

    def _handle_frame_done(self, future: Future) -> None:
        exc = future.exception()
        if exc is None:
            return
        if isinstance(exc, FrameDroppedError):
            self._publish_stats()
        elif isinstance(exc, FramesNotSupportedError):
            self._reject("frames_not_supported", f"{exc}; frames are counted as rejected. Set 'model' to a "
                                                 "vision-language model to use the camera")
        else:
            self._reject(f"frame_{type(exc).__name__}", f"frame failed in the model: {exc}")

    def _handle_text_done(self, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            self._reject(f"text_{type(exc).__name__}", f"text failed in the model: {exc}")

    def _handle_described(self, future: Future) -> None:
        self._describing = False
        exc = future.exception()
        if exc is not None:
            if not isinstance(exc, (EngineBusyError, EngineNotReadyError)):
                self._description_error = str(exc)  # in /diagnostics until one succeeds
                self.get_logger().warning(f"description failed: {exc}", throttle_duration_sec=60.0)
            return
        self._description_error = None
        answer = future.result()
        msg = Description(text=answer.text, cache_fill=answer.cache_fill, generation_time=answer.latency)
        msg.header.stamp = self._ros_time(answer.newest_frame_stamp)
        msg.header.frame_id = self._frame_id
        stats = self.engine.stats() if self.engine is not None else None
        msg.frames_seen = stats.frames_ingested if stats is not None else 0
        if self._description_pub is not None:
            self._description_pub.publish(msg)

    # --- periodic output ---------------------------------------------------------------------------------
    def _on_description_timer(self) -> None:
        # One description at a time, and none while nothing new has come in.
        if (self._describing or self._stopping.is_set() or not self.engine.ready.is_set()
                or self._inputs_done == self._described_at):
            return
        stats = self.engine.stats()
        if stats is None or stats.tokens_seen == 0:
            return
        self._described_at = self._inputs_done
        try:
            future = self.engine.submit_describe(self._param("description_prompt") or None,
                                                 max_new_tokens=self._param("max_new_tokens"))
        except EngineNotReadyError:  # closed under the timer
            return
        self._describing = True
        future.add_done_callback(lambda f: self._post("described", f))
