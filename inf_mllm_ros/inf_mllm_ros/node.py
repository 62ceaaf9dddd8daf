"""The ROS 2 node: camera frames and text in, answers, descriptions and cache figures out.

A thin lifecycle node over `StreamingEngine`, which runs the model on its own worker thread:

- configure loads the model, activate takes input, deactivate stops input and saves the memory,
  cleanup frees the model; with `autostart` (the default) the node configures and activates itself;
- subscription and timer callbacks only convert messages and hand them to the engine (never block);
- `~/query`, `~/reset` and `~/save_memory` run in a reentrant callback group and wait for the engine
  there, so a multi-threaded executor keeps serving topics, timers and parameters while the model works;
- whatever the engine reports from its worker (an input done, a description) goes through a queue
  and a guard condition, so that publishing and logging happen on the executor;
- the services keep up to SERVICE_QOS's depth of requests, so a burst of callers is answered (or
  refused at once with a reason) rather than dropped by the middleware;
- on SIGINT or SIGTERM the node stops the model, saves the memory and answers every caller still
  waiting ("node is shutting down") before it leaves the graph.

Runnable as `ros2 run inf_mllm_ros inf_mllm_node`.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from typing import Callable

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.exceptions import InvalidParameterValueException, ParameterException
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.logging import get_logger
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String
from std_srvs.srv import Trigger

from inf_mllm_interfaces.msg import CacheStats, Description
from inf_mllm_interfaces.action import Ask
from inf_mllm_interfaces.srv import Query

from .engine.adapters import FramesNotSupportedError
from .engine.engine import EngineBusyError, EngineNotReadyError, FrameDroppedError, StreamingEngine
from .engine.stream import AnswerCancelledError
from .engine.text_rules import text_problem
from .image_conversion import ImageConversionError, compressed_msg_to_rgb, image_msg_to_rgb
from .input_rules import FrameGate, StreamClock, length_refusal, stamp_seconds, text_refusal
from .settings import (BY_NAME, MAX_NEW_TOKENS_LIMIT, PARAMETERS, Param, knob_problem, load_settings,
                       stream_config, value_problem)

NODE_NAME = "inf_mllm"
# Seconds a shutdown or cleanup waits for the model: it stops within one block or token, then saves.
ENGINE_CLOSE_TIMEOUT = 30.0

# Camera: newest frame only. Text: reliable, never dropped by the middleware.
IMAGE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT,
                       durability=DurabilityPolicy.VOLATILE)
TEXT_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=50, reliability=ReliabilityPolicy.RELIABLE)
LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
STATS_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
# Services: requests and responses kept for a burst of callers. The default depth (10) lets the middleware
# drop the requests of a burst while the executor is busy, and their callers never hear back.
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
DIAGNOSTICS_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
# Health: frames the model had no time for (a newer one replaced them while it worked), per second.
WARN_MODEL_DROPS_PER_S = 0.5
SHUTTING_DOWN = "node is shutting down"
NOT_CONFIGURED = "node is not configured: no model is loaded (configure it through its lifecycle)"
LOADING = "model is still loading"
INACTIVE = "node is inactive: it takes no input and answers no question until it is activated"


def descriptor(p: Param) -> ParameterDescriptor:
    """The ROS descriptor of a parameter of the settings table (ranges enforced by rclpy)."""
    d = ParameterDescriptor(name=p.name, description=p.description, read_only=p.read_only,
                            additional_constraints=p.constraints)
    if isinstance(p.default, bool) or p.low is None:
        return d
    if isinstance(p.default, int):
        d.integer_range = [IntegerRange(from_value=int(p.low), to_value=int(p.high), step=p.step)]
    else:
        d.floating_point_range = [FloatingPointRange(from_value=float(p.low), to_value=float(p.high), step=0.0)]
    return d


class InfMLLMNode(LifecycleNode):
    """Camera and text into one bounded memory; questions answered from it. A lifecycle node:

    - unconfigured: parameters and services only; a question is answered "not configured";
    - configure: builds the engine and loads the model (services answer "model is still loading" meanwhile,
      `~/cache_stats` says `model_ready` false); fails, with the reason logged, if the model cannot load;
    - activate: subscribes to the camera and text and starts the description timer;
    - deactivate: stops taking input and saves the memory to `memory_file`; the memory stays loaded;
    - cleanup: saves the memory and frees the model.

    engine_factory builds the engine from the parameters (StreamingEngine's signature); tests may
    pass their own.
    """

    def __init__(self, node_name: str = NODE_NAME, *, engine_factory: Callable[..., StreamingEngine] = StreamingEngine,
                 **kwargs):
        super().__init__(node_name, **kwargs)
        for p in PARAMETERS:
            self.declare_parameter(p.name, p.default, descriptor(p))
        for p in PARAMETERS:  # what the descriptors cannot say (a policy's name, a period's rule)
            problem = value_problem(p.name, self._param(p.name))
            if problem:
                raise InvalidParameterValueException(p.name, self._param(p.name), problem)
        self._engine_factory = engine_factory
        self.engine: StreamingEngine | None = None
        self._active = False
        self._lifecycle_state = "unconfigured"  # as the lifecycle names it; /diagnostics reports it
        # Set while autostart configures and activates: callers then hear "model is still loading".
        self.autostarting = bool(self.get_parameter("autostart").value)
        self._lock = threading.Lock()  # the counters below, written from several threads
        self._stopping = threading.Event()  # set at shutdown: queries are answered "node is shutting down"
        self._in_service = 0  # service and action callbacks running now
        self._inputs_rejected = 0
        self._frames_dropped = 0  # held back by frame_rate
        self._queries_failed = 0  # failed before or after the engine (empty, timed out)
        self._kinds_logged: set[str] = set()
        self._stream_clock = StreamClock()  # the model sees times since the first input
        self._frame_gate = FrameGate(self.get_parameter("frame_rate").value)
        self._frame_id = ""
        self._inputs_done = 0  # bumped per ingested input and reset, so descriptions skip an unchanged memory
        self._described_at = -1
        self._description_error: str | None = None
        self._controls_waiting: set[str] = set()  # "reset", "saved": one of each at a time
        self._describing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._periodic: dict[str, object] = {}
        self._input_subscriptions: list = []
        self._stats_pub = self._description_pub = None
        self._last_error = ""
        self._health_prev: tuple[float, int, int] | None = None  # (time, node drops, model drops)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", DIAGNOSTICS_QOS)
        self._diagnostics_timer = None
        # Its own group: health goes on while a lifecycle manager's configure holds the default group for as
        # long as the model loads ("model is loading").
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self._set_diagnostics_period(self._param("diagnostics_period"))

        self._wake = self.create_guard_condition(self._drain_outbox)
        # Services exist in every state, so a caller always hears why not instead of nothing.
        waiting = ReentrantCallbackGroup()
        self.create_service(Query, "~/query", self._on_query, callback_group=waiting, qos_profile=SERVICE_QOS)
        self.create_service(Trigger, "~/reset", self._on_reset, callback_group=waiting, qos_profile=SERVICE_QOS)
        self.create_service(Trigger, "~/save_memory", self._on_save_memory, callback_group=waiting,
                            qos_profile=SERVICE_QOS)
        # Every goal is accepted, so that each one ends with a result that says why when it fails.
        self._ask_server = ActionServer(
            self, Ask, "~/ask", execute_callback=self._execute_ask, callback_group=waiting,
            goal_callback=lambda _goal: GoalResponse.ACCEPT, cancel_callback=lambda _goal: CancelResponse.ACCEPT)
        self.add_on_set_parameters_callback(self._on_set_parameters)

    # --- lifecycle ------------------------------------------------------------------------------------------
    def _transition(self, result: TransitionCallbackReturn, success: str, failure: str) -> TransitionCallbackReturn:
        """Remember the lifecycle state a transition leads to (what /diagnostics reports), and pass its result on."""
        self._lifecycle_state = success if result == TransitionCallbackReturn.SUCCESS else failure
        return result

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition(self._configure(), "inactive", "unconfigured")

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition(self._activate(state), "active", "inactive")

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition(self._deactivate(state), "inactive", "active")

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = TransitionCallbackReturn.SUCCESS if self._release() else TransitionCallbackReturn.FAILURE
        return self._transition(result, "unconfigured", "inactive")

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stopping.set()
        self._release()
        return self._transition(TransitionCallbackReturn.SUCCESS, "finalized", "finalized")

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        return self._transition(TransitionCallbackReturn.SUCCESS, "unconfigured", "finalized")

    def _configure(self) -> TransitionCallbackReturn:
        if not self._release():  # what a failed configure or cleanup left
            return TransitionCallbackReturn.FAILURE
        self._stats_pub = self.create_publisher(CacheStats, "~/cache_stats", STATS_QOS)
        self._description_pub = self.create_publisher(Description, "~/description", LATCHED_QOS)
        self._set_timer("stats", self._param("stats_period"))
        try:
            values = {p.name: self._param(p.name) for p in PARAMETERS}
            config = stream_config(values)
            self.get_logger().info(
                f"loading model {self._param('model')!r} (cache {config.capacity} tokens, policy {config.policy}"
                + "".join(f", {k} {v}" for k, v in config.policy_settings.items()) + ")")
            started = time.monotonic()
            self.engine = self._engine_factory(
                self._param("model"), config, **load_settings(values),
                max_pending_texts=self._param("max_pending_texts"),
                max_pending_queries=self._param("max_pending_queries"),
                on_ingested=lambda kind: self._post("ingested", kind),
                memory_file=self._param("memory_file") or None,
                checkpoint_period=self._param("checkpoint_period"),
                torch_threads=self._param("torch_threads"),
            )
        except Exception as exc:  # rclpy would swallow it: say why here
            self._last_error = f"configure failed: {type(exc).__name__}: {exc}"
            self.get_logger().error(self._last_error)
            self._publish_stats()
            return TransitionCallbackReturn.FAILURE
        self._set_frame_period(self._param("frame_rate"))
        self._publish_stats()
        # The engine signals readiness; meanwhile the services answer "model is still loading".
        try:
            self.engine.wait_ready()
        except EngineNotReadyError as exc:
            self._last_error = str(exc)
            self.get_logger().error(f"{exc}; configure failed (queries answer success=false with this reason)")
            self._publish_stats()
            return TransitionCallbackReturn.FAILURE
        # Times go on from a restored memory's clock: its first input was stream time 0.
        self._stream_clock = StreamClock(self.engine.time_origin)
        self._report_ready(time.monotonic() - started)
        return TransitionCallbackReturn.SUCCESS

    def _activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        if getattr(self.engine, "closed", False):  # kept by a cleanup that failed: it takes no more input
            self.get_logger().error("cannot activate: the model is closed (a cleanup is pending); clean up first")
            return TransitionCallbackReturn.FAILURE
        self._input_subscriptions = [
            self.create_subscription(Image, "image", lambda m: self._offer_frame(m, image_msg_to_rgb, "image"),
                                     IMAGE_QOS),
            self.create_subscription(CompressedImage, "image/compressed",
                                     lambda m: self._offer_frame(m, self._decode_compressed, "compressed"), IMAGE_QOS),
            self.create_subscription(String, "text", self._on_text, TEXT_QOS),
            # What the robot must not forget (a task, a code, a rule): kept ahead of what attention chooses.
            self.create_subscription(String, "text/pinned", lambda m: self._on_text(m, pin=True), TEXT_QOS),
        ]
        self._set_timer("description", self._param("description_period"))
        self._active = True
        self.get_logger().info("active: taking camera frames and texts")
        self._publish_stats()
        return super().on_activate(state)

    def _deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        for sub in self._input_subscriptions:
            self.destroy_subscription(sub)
        self._input_subscriptions = []
        self._set_timer("description", 0.0)
        self._publish_stats()
        if self.engine is not None and getattr(self.engine, "memory_file", None) is not None:
            try:
                info = self.engine.submit_save().result(timeout=self._param("query_timeout"))
                self.get_logger().info(f"inactive; memory saved to {info.path} ({info.fill} tokens held)")
            except Exception as exc:
                self.get_logger().error(f"inactive; saving the memory failed: {exc}")
        else:
            self.get_logger().info("inactive: input is no longer taken; the memory is kept")
        return super().on_deactivate(state)

    def _release(self) -> bool:
        """Stop taking input, save and free the model, and drop the publishers (back to unconfigured). False
        if the model is still busy after ENGINE_CLOSE_TIMEOUT: the engine is then kept, closed, so that no
        new one loads the memory file while this one may still save it (a later configure or cleanup tries
        again)."""
        self._active = False
        for sub in self._input_subscriptions:
            self.destroy_subscription(sub)
        self._input_subscriptions = []
        for name in list(self._periodic):
            self._set_timer(name, 0.0)
        if self.engine is not None:
            if not self._close_engine():
                return False
            self.engine = None
        for pub in (self._stats_pub, self._description_pub):
            if pub is not None:
                self.destroy_publisher(pub)
        self._stats_pub = self._description_pub = None
        return True

    @property
    def executor_threads(self) -> int:
        # The running query and every waiting one hold a thread, a reset and a save may hold one more each, and
        # two keep topics, timers and quick refusals going.
        return self._param("max_pending_queries") + 5

    @property
    def services_busy(self) -> int:
        """Service and action callbacks running now (each has a caller waiting for its response)."""
        with self._lock:
            return self._in_service

    def close(self) -> None:
        """Refuse new queries and stop the model: every caller still waiting is answered "node is shutting down".

        The engine fails what waits and stops its current answer at the next token; this waits for that, so
        that the process never exits while the worker thread is inside the model.
        """
        self._stopping.set()
        if self.engine is not None:
            self._close_engine()

    def destroy_node(self) -> None:
        server = getattr(self, "_ask_server", None)  # absent if the constructor failed before it
        if server is not None:
            server.destroy()
        super().destroy_node()

    def _close_engine(self) -> bool:
        """Close the engine; whether its worker has ended (it stops within a block or a token, then saves)."""
        ended = self.engine.close(timeout=ENGINE_CLOSE_TIMEOUT) is not False
        if not ended:
            self.get_logger().error(f"the model is still busy after {ENGINE_CLOSE_TIMEOUT:g} s; its memory is not "
                                    "saved yet")
            return False
        saved, failed = getattr(self.engine, "last_saved", None), getattr(self.engine, "save_error", None)
        if failed:
            self.get_logger().error(f"memory NOT saved: {failed}" + (
                f"; the file holds the save of {saved.tokens_seen} tokens seen" if saved is not None else ""))
        elif saved is not None:
            self.get_logger().info(f"memory saved to {saved.path}: {saved.fill} tokens held, {saved.tokens_seen} seen")
        return True

    @contextmanager
    def _serving(self):
        with self._lock:
            self._in_service += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_service -= 1

    # --- parameters ------------------------------------------------------------------------------------
    def _param(self, name: str):
        return self.get_parameter(name).value

    def _on_set_parameters(self, params) -> SetParametersResult:
        # Ranges and read-only flags were checked by rclpy against the descriptors already; the table's rule
        # also says what a descriptor cannot (a period's 0-or-at-least rule).
        for p in params:
            problem = value_problem(p.name, p.value) if p.name in BY_NAME else None
            if problem:
                return SetParametersResult(successful=False, reason=problem)
        # Read-only parameters were refused already, so these are the policy's live settings.
        knobs = {p.name for p in params if p.name in BY_NAME and BY_NAME[p.name].policy_knob}
        for name in knobs:
            problem = knob_problem(name, self._param("eviction_policy"))
            if problem:
                return SetParametersResult(successful=False, reason=problem)
        # Before configure the parameter alone changes: configure reads it. After, the engine takes it too.
        engine = self.engine
        for p in params:
            if p.name in knobs:
                if engine is not None:
                    try:
                        engine.set_policy_knob(p.name, p.value)
                    except ValueError as exc:
                        return SetParametersResult(successful=False, reason=str(exc))
            elif p.name == "frame_rate":
                self._frame_gate.rate = p.value
                self._set_frame_period(p.value)
            elif p.name == "description_period" and self._active:
                self._set_timer("description", p.value)
            elif p.name == "stats_period" and self._stats_pub is not None:
                self._set_timer("stats", p.value)
            elif p.name == "diagnostics_period":
                self._set_diagnostics_period(p.value)
            elif p.name == "checkpoint_period" and engine is not None:
                engine.checkpoint_period = p.value  # from the next save on
            elif p.name in BY_NAME and BY_NAME[p.name].engine_field and engine is not None:
                # A live engine setting (system_prompt, max_new_tokens): the configuration it reads.
                setattr(engine.config, BY_NAME[p.name].engine_field, p.value)
            if p.name in BY_NAME:
                self.get_logger().info(f"{p.name} set to {p.value!r}")
        return SetParametersResult(successful=True)

    def _set_frame_period(self, frame_rate: float) -> None:
        """Under a flood of texts the engine still takes a waiting frame every 1 / frame_rate seconds."""
        if self.engine is not None:
            self.engine.frame_period = 1.0 / frame_rate if frame_rate > 0.0 else 0.0

    def _set_diagnostics_period(self, period: float) -> None:
        if self._diagnostics_timer is not None:
            self.destroy_timer(self._diagnostics_timer)
        self._diagnostics_timer = self.create_timer(period, self._publish_diagnostics,
                                                    callback_group=self._diagnostics_group) if period > 0.0 else None

    def _set_timer(self, name: str, period: float) -> None:
        """(Re)create a periodic timer of `period` seconds; 0: none."""
        old = self._periodic.pop(name, None)
        if old is not None:
            self.destroy_timer(old)
        if name == "description":
            self._description_error = None  # a failure is news only while descriptions run
        if period > 0.0:
            callback = {"description": self._on_description_timer, "stats": self._publish_stats}[name]
            self._periodic[name] = self.create_timer(period, callback)

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
        try:
            future = self.engine.submit_frame(rgb, self._stream_time(msg.header.stamp))
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
        try:
            future = self.engine.submit_text(text, self._stream_time(None), pin=pin)
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
            getattr(self, "_handle_" + kind)(payload)

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

    def _report_ready(self, seconds: float) -> None:
        self.get_logger().info(f"model ready in {seconds:.1f} s")
        if getattr(self.engine, "memory_file", None) is not None:
            refused = "refused" in self.engine.memory_status
            (self.get_logger().warning if refused else self.get_logger().info)(self.engine.memory_status)
        notice = getattr(getattr(self.engine, "adapter", None), "notice", "")
        if notice:  # the embedded default: say plainly that its frame descriptions mean nothing
            self.get_logger().warning(notice)
        self._publish_stats()

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

    def _publish_stats(self) -> None:
        if self._stats_pub is None or self.engine is None:
            return
        msg = CacheStats(capacity=self._param("cache_size"), eviction_policy=self._param("eviction_policy"),
                         attention_bias=float(self.engine.config.policy_settings.get("attention_bias", 0.0)),
                         model_ready=self.engine.ready.is_set() and self._active)
        msg.header.stamp = self.get_clock().now().to_msg()
        s = self.engine.stats()
        if s is not None:
            msg.capacity, msg.fill, msg.tokens_seen, msg.tokens_evicted = s.capacity, s.fill, s.tokens_seen, s.tokens_evicted
            msg.frames_ingested, msg.texts_ingested, msg.kv_bytes = s.frames_ingested, s.texts_ingested, s.kv_bytes
            msg.pinned_held = s.pinned_held
            msg.archive_tokens, msg.archive_blocks, msg.archive_bytes = s.archive_tokens, s.archive_blocks, s.archive_bytes
            msg.eviction_policy = s.policy  # the bias is the config's: the snapshot lags a change until the next input
        counters = self.engine.counters
        with self._lock:
            msg.frames_dropped = self._frames_dropped + counters.frames_dropped
            msg.inputs_rejected = self._inputs_rejected
            msg.queries_failed = self._queries_failed + counters.queries_failed
        msg.queries_answered = counters.queries_answered
        pending = getattr(self.engine, "pending", None)
        if pending:
            msg.texts_waiting, msg.queries_waiting = pending["texts"], pending["queries"]
            msg.frame_waiting = pending["frame"]
        self._stats_pub.publish(msg)

    def health(self) -> DiagnosticStatus:
        """The node's health as robot monitors read it: a level, a one-line message and the figures."""
        engine, now = self.engine, time.monotonic()
        stats = engine.stats() if engine is not None else None
        counters = engine.counters if engine is not None else None
        with self._lock:
            node_drops, rejected, failed = self._frames_dropped, self._inputs_rejected, self._queries_failed
            last_error = self._last_error
        model_drops = counters.frames_dropped if counters is not None else 0
        prev, self._health_prev = self._health_prev, (now, node_drops, model_drops)
        span = now - prev[0] if prev else 0.0
        rate_limited = (node_drops - prev[1]) / span if span > 0 else 0.0
        behind = (model_drops - prev[2]) / span if span > 0 else 0.0
        pending = getattr(engine, "pending", None) or {"texts": 0, "queries": 0, "frame": False}
        level, message = DiagnosticStatus.OK, "active: taking input and answering"
        if engine is None:
            level, message = DiagnosticStatus.WARN, "not configured: no model loaded"
        elif engine.load_error is not None:
            level, message = DiagnosticStatus.ERROR, f"model failed to load: {engine.load_error}"
        elif not engine.ready.is_set():
            level, message = DiagnosticStatus.WARN, "model is loading"
        elif getattr(engine, "save_error", None):
            level, message = DiagnosticStatus.ERROR, f"memory file not saved: {engine.save_error}"
        elif not self._active:
            message = "inactive: the memory is kept, no input is taken"
        elif self._description_error:
            level, message = DiagnosticStatus.WARN, f"descriptions failing: {self._description_error}"
        elif behind > WARN_MODEL_DROPS_PER_S:
            level, message = DiagnosticStatus.WARN, f"model behind the camera: {behind:.1f} frames/s replaced unseen"
        elif pending["texts"] > self._param("max_pending_texts") // 2:
            level, message = DiagnosticStatus.WARN, f"model behind the text topic: {pending['texts']} texts waiting"
        elif pending["queries"] >= self._param("max_pending_queries"):
            level, message = DiagnosticStatus.WARN, f"query queue full ({pending['queries']} waiting)"
        values = {
            "state": self._lifecycle_state,
            "model": str(self._param("model")),
            "model_ready": str(engine is not None and engine.ready.is_set()).lower(),
            "cache_fill": f"{stats.fill if stats else 0}/{self._param('cache_size')}",
            "tokens_seen": str(stats.tokens_seen if stats else 0),
            "archive_fill": f"{stats.archive_tokens if stats else 0}/{self._param('archive_size')}",
            "archive_bytes": str(stats.archive_bytes if stats else 0),
            "texts_waiting": str(pending["texts"]),
            "queries_waiting": str(pending["queries"]),
            "frame_waiting": str(pending["frame"]).lower(),
            "frames_dropped_by_rate_per_s": f"{rate_limited:.2f}",
            "frames_dropped_by_model_per_s": f"{behind:.2f}",
            "inputs_rejected": str(rejected),
            "queries_failed": str(failed + (counters.queries_failed if counters else 0)),
            "checkpoints_failed": str(counters.checkpoints_failed if counters else 0),
            "last_error": last_error,
        }
        return DiagnosticStatus(level=level, name=f"{self.get_fully_qualified_name()}: memory", message=message,
                                hardware_id=str(self._param("device")),
                                values=[KeyValue(key=k, value=v) for k, v in values.items()])

    def _publish_diagnostics(self) -> None:
        try:
            status = self.health()
        except Exception as exc:  # a health report must never take the executor down
            self.get_logger().error(f"health report failed: {type(exc).__name__}: {exc}", throttle_duration_sec=60.0)
            return
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(msg)

    # --- services ----------------------------------------------------------------------------------------
    def _served(self, handler, request, response):
        """Run a service handler counted as in flight; a failure during shutdown says so."""
        with self._serving():
            try:
                response = handler(request, response)
            except Exception as exc:  # every caller gets a response, whatever went wrong
                self.get_logger().error(f"request failed: {type(exc).__name__}: {exc}")
                response.success, response.message = False, f"internal error: {type(exc).__name__}: {exc}"
            if not response.success and self._stopping.is_set():
                response.message = SHUTTING_DOWN
            return response

    def _on_query(self, request: Query.Request, response: Query.Response) -> Query.Response:
        return self._served(self._ask_engine, request, response)

    def _ask_engine(self, request, response, on_token=None, cancel: threading.Event | None = None,
                    cancelled=lambda: False):
        """Answer a Query request or an Ask goal into its response or result (the same fields)."""
        start = time.monotonic()
        engine = self.engine
        unusable = self._lifecycle_refusal(engine, ask=True)
        if unusable:
            return self._query_failed(response, unusable)
        question = request.question.strip()
        max_new = request.max_new_tokens or self._param("max_new_tokens")
        too_long = length_refusal("question", question, self._param("max_text_chars"))
        if too_long:  # a kept question goes in whole before its answer: it must be short enough to stop soon
            return self._query_failed(response, too_long)
        problem = text_problem(question, "question")  # after the length: it reads up to the first visible character
        if problem:
            return self._query_failed(response, problem)
        if max_new > MAX_NEW_TOKENS_LIMIT:
            return self._query_failed(response, f"max_new_tokens {max_new} is above the limit {MAX_NEW_TOKENS_LIMIT}")
        timeout = self._param("query_timeout")
        try:
            future = engine.submit_ask(question, max_new_tokens=max_new, keep_in_memory=request.keep_in_memory,
                                       on_token=on_token, cancel=cancel)
        except EngineNotReadyError as exc:
            return self._query_failed(response, str(exc))
        deadline = time.monotonic() + timeout
        try:
            while cancel is not None:  # an action goal: watch for a cancel request while waiting
                try:
                    answer = future.result(timeout=0.05)
                    break
                except FutureTimeoutError:
                    if cancelled():
                        cancel.set()  # a running answer stops at its next token
                        if future.cancel():  # one still waiting never starts: counted here, not by the engine
                            return self._query_failed(response, "cancelled")
                    elif time.monotonic() >= deadline:
                        raise
            else:
                answer = future.result(timeout=timeout)
        except FutureTimeoutError:
            if cancel is not None:
                cancel.set()
            reason = f"no answer within query_timeout ({timeout:g} s): the model is busy"
            if engine.abandon(future):  # running: the engine counts it failed when it ends, never answered
                response.success, response.message = False, reason
                return response
            return self._query_failed(response, reason)  # never started: the worker skips it
        except AnswerCancelledError:
            response.success, response.message = False, "cancelled"
            return response
        except (EngineNotReadyError, EngineBusyError, ValueError) as exc:
            # The engine counted these itself.
            response.success, response.message = False, str(exc)
            return response
        except Exception as exc:
            response.success, response.message = False, f"model error: {type(exc).__name__}: {exc}"
            self._last_error = response.message
            return response
        response.success = True
        response.answer = answer.text
        if answer.cut_by_headroom:
            response.message = (f"answer cut at {answer.tokens_generated} tokens of {max_new}: the cache's headroom "
                                "bounds an answer not kept in memory (keep_in_memory lifts the bound)")
        response.newest_frame_stamp = self._ros_time(answer.newest_frame_stamp)
        response.tokens_seen = answer.tokens_seen
        response.cache_fill = answer.cache_fill
        response.retrieved_tokens = answer.retrieved_tokens
        response.latency = time.monotonic() - start
        return response

    def _execute_ask(self, goal_handle) -> Ask.Result:
        """The ~/ask action: the answer so far as feedback after each token; cancel stops it at the next one."""
        def feedback(text: str, n: int) -> None:
            goal_handle.publish_feedback(Ask.Feedback(partial_answer=text, tokens_generated=n))

        def answer(request, result: Ask.Result) -> Ask.Result:
            return self._ask_engine(request, result, on_token=feedback, cancel=threading.Event(),
                                    cancelled=lambda: goal_handle.is_cancel_requested)

        with self._serving():  # in flight until the goal's end is out, so that shutdown waits for it
            result = self._served(answer, goal_handle.request, Ask.Result())
            if result.success:
                goal_handle.succeed()
            elif result.message == "cancelled" and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            else:
                goal_handle.abort()
            return result

    def _lifecycle_refusal(self, engine: StreamingEngine | None, *, ask: bool) -> str | None:
        """Why a request cannot be served in the node's state, or None: the same words from every service.
        A question also needs the node active; one asked while the model loads hears why from the engine,
        which counts it."""
        if self._stopping.is_set():
            return SHUTTING_DOWN
        if engine is None:
            return LOADING if self.autostarting else NOT_CONFIGURED
        if not engine.ready.is_set():
            if ask:
                return None
            return f"model failed to load: {engine.load_error}" if engine.load_error else LOADING
        if ask and not self._active:
            return LOADING if self.autostarting else INACTIVE
        return None

    def _query_failed(self, response: Query.Response, reason: str) -> Query.Response:
        with self._lock:
            self._queries_failed += 1
        response.success, response.message = False, reason
        return response

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        return self._served(self._clear, request, response)

    def _clear(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        engine = self.engine
        refusal = self._lifecycle_refusal(engine, ask=False)
        if refusal:
            response.success, response.message = False, refusal
            return response
        done, _ = self._wait_control(engine.submit_reset, response, "reset")
        if not done:
            return response
        self._post("ingested", "reset")  # stats and descriptions follow the empty memory
        response.success, response.message = True, "memory cleared"
        return response

    def _wait_control(self, submit, response, verb: str) -> tuple[bool, object]:
        """Run a control job of the engine (reset, save) within query_timeout; on failure `response` says why.
        One of each kind waits at a time: each holds an executor thread while it waits (see executor_threads)."""
        timeout = self._param("query_timeout")
        with self._lock:
            if verb in self._controls_waiting:
                response.success, response.message = False, f"not {verb}: another request for it is under way"
                return False, None
            self._controls_waiting.add(verb)
        try:
            future = submit()
            return True, future.result(timeout=timeout)
        except FutureTimeoutError:
            # Not started yet: it never will be. Already running: it completes, and the caller is told so.
            if not future.cancel() and future.done() and future.exception() is None:
                return True, future.result()  # it ended just now
            later = "" if future.cancelled() else "; it is under way and will complete"
            response.success, response.message = False, f"not {verb} within query_timeout ({timeout:g} s){later}"
        except Exception as exc:
            response.success, response.message = False, f"not {verb}: {exc}"
        finally:
            with self._lock:
                self._controls_waiting.discard(verb)
        return False, None

    def _on_save_memory(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        return self._served(self._save_memory, request, response)

    def _save_memory(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        engine = self.engine
        refusal = self._lifecycle_refusal(engine, ask=False)
        if refusal:
            response.success, response.message = False, refusal
            return response
        done, info = self._wait_control(engine.submit_save, response, "saved")
        if not done:
            return response
        response.success = True
        response.message = (f"saved {info.fill} tokens ({info.tokens_seen} seen) to {info.path}: "
                            f"{info.bytes / 1e6:.1f} MB in {info.seconds:.2f} s")
        return response


def shut_down(node: InfMLLMNode, executor: MultiThreadedExecutor, grace: float = 5.0) -> None:
    """Stop the model, then keep serving until every caller still waiting has its response.

    Requests that arrive meanwhile are answered at once with "node is shutting down".
    """
    node.close()
    settle = time.monotonic() + 0.3  # requests already on their way get their refusal too
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (node.services_busy or time.monotonic() < settle):
        executor.spin_once(timeout_sec=0.05)
    executor.shutdown(timeout_sec=grace)


def autostart(node: InfMLLMNode, stop: threading.Event, failed: threading.Event) -> None:
    """Configure (load the model) and activate; a failed configure ends the process with code 1."""
    try:
        result = node.trigger_configure()
        if stop.is_set():
            return
        if result != TransitionCallbackReturn.SUCCESS:
            node.get_logger().fatal("configure failed (see above); exiting with code 1")
            failed.set()
            stop.set()
            return
        node.trigger_activate()
    finally:
        node.autostarting = False


def main(args=None) -> int:
    # The node handles SIGINT and SIGTERM itself: rclpy's handler would shut the ROS context down at once,
    # and callers waiting for an answer would never get their response. A second signal (a terminal and a
    # launch file both send one) only repeats the request.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop, failed = threading.Event(), threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    node = executor = None
    try:
        node = InfMLLMNode()
        executor = MultiThreadedExecutor(num_threads=node.executor_threads)
        executor.add_node(node)
        if node.get_parameter("autostart").value:
            threading.Thread(target=autostart, args=(node, stop, failed), name="inf_mllm_autostart",
                             daemon=True).start()
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.1)  # wakes up for a signal within 0.1 s
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except ParameterException as exc:
        get_logger(NODE_NAME).fatal(f"bad parameter: {exc}")
        return 1
    finally:
        if node is not None:
            if executor is not None:
                shut_down(node, executor)
            else:
                node.close()
            node.destroy_node()
        rclpy.try_shutdown()
    return 1 if failed.is_set() else 0


if __name__ == "__main__":
    raise SystemExit(main())
