"""The node's figures and health: `~/cache_stats` and `/diagnostics`.

`Health` is a part the node (node/lifecycle.py) owns. `~/cache_stats` carries the cache's and the node's counters
(`NodeCounters`, written by the node's inputs and services) after every input and every `stats_period`;
`/diagnostics` carries one DiagnosticStatus every `diagnostics_period`, with a level and a one-line message as
robot monitors read them, from a timer in a callback group of its own so that it goes on while a configure
loads the model.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from inf_mllm_interfaces.msg import CacheStats

from .state import NodeState, ParameterReader

STATS_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
DIAGNOSTICS_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
# Seconds a jump back in time (or a reset) that cleared the poses stays the status's message.
POSE_JUMP_REPORT_S = 10.0
# Health: frames the model had no time for (a newer one replaced them while it worked), per second.
WARN_MODEL_DROPS_PER_S = 0.5


@dataclass
class NodeCounters:
    """What the node counts beside the engine, written from several executor threads under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    frames_dropped: int = 0  # held back by frame_rate
    inputs_rejected: int = 0
    queries_failed: int = 0  # failed before or after the engine (empty, timed out)
    last_error: str = ""


@dataclass(frozen=True)
class InputsHealth:
    """What the node's inputs (node/inputs.py, `Inputs.health`) report for /diagnostics."""

    description_error: str | None = None  # the last description's failure, until one succeeds
    silent_cameras: list = field(default_factory=list)  # (name, seconds without a frame)
    pose_jump: tuple[float, str] | None = None  # (time.monotonic, what happened) of the last clearing of the poses
    pose_jumps: int = 0
    pose_frame: str = ""
    cameras: str = ""  # the cameras' names (their topics where unnamed)


class Health:
    """Publishing `~/cache_stats` and `/diagnostics`, and the health report behind the latter.

    ros: the rclpy node it publishes on (its name and clock). state: the node's (its engine and lifecycle).
    param: reads the node's parameters. counters: the node's. The inputs' report (`InputsHealth`: descriptions,
    cameras, poses) is handed over once the inputs exist (`watch`). The /diagnostics publisher and its timer exist
    in every lifecycle state; `~/cache_stats` from configure to cleanup (`open_stats`, `close_stats`).
    """

    def __init__(self, ros: Node, state: NodeState, param: ParameterReader, counters: NodeCounters):
        self.ros, self.state, self.param, self.counters = ros, state, param, counters
        self._inputs_health: Callable[[float], InputsHealth] = lambda camera_timeout: InputsHealth()
        node = ros
        self._previous: tuple[float, int, int] | None = None  # (time, node drops, model drops)
        self._stats_pub = None
        self._diagnostics_pub = node.create_publisher(DiagnosticArray, "/diagnostics", DIAGNOSTICS_QOS)
        self._diagnostics_timer = None
        # Its own group: health goes on while a lifecycle manager's configure holds the default group for as
        # long as the model loads ("model is loading").
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self.set_diagnostics_period(param("diagnostics_period"))

    def watch(self, inputs_health: Callable[[float], InputsHealth]) -> None:
        """The inputs' report (given the camera timeout), which the health report includes."""
        self._inputs_health = inputs_health

    def set_diagnostics_period(self, period: float) -> None:
        if self._diagnostics_timer is not None:
            self.ros.destroy_timer(self._diagnostics_timer)
        self._diagnostics_timer = None
        if period > 0.0:
            self._diagnostics_timer = self.ros.create_timer(period, self.publish_diagnostics,
                                                             callback_group=self._diagnostics_group)

    def open_stats(self) -> None:
        if self._stats_pub is None:
            self._stats_pub = self.ros.create_publisher(CacheStats, "~/cache_stats", STATS_QOS)

    def close_stats(self) -> None:
        if self._stats_pub is not None:
            self.ros.destroy_publisher(self._stats_pub)
        self._stats_pub = None

    @property
    def stats_open(self) -> bool:
        return self._stats_pub is not None

    def publish_stats(self) -> None:
        engine = self.state.engine
        if self._stats_pub is None or engine is None:
            return
        msg = CacheStats(capacity=self.param("cache_size"), eviction_policy=self.param("eviction_policy"),
                         attention_bias=float(engine.settings.policy_settings.get("attention_bias", 0.0)),
                         model_ready=engine.ready.is_set() and self.state.active)
        msg.header.stamp = self.ros.get_clock().now().to_msg()
        s = engine.stats()
        if s is not None:
            msg.capacity, msg.fill = s.capacity, s.fill
            msg.tokens_seen, msg.tokens_evicted = s.tokens_seen, s.tokens_evicted
            msg.frames_ingested, msg.texts_ingested, msg.kv_bytes = s.frames_ingested, s.texts_ingested, s.kv_bytes
            msg.pinned_held = s.pinned_held
            msg.archive_tokens, msg.archive_blocks = s.archive_tokens, s.archive_blocks
            msg.archive_bytes = s.archive_bytes
            msg.eviction_policy = s.policy  # the bias is the config's: the snapshot lags a change until the next input
        counters, own = engine.counters, self.counters
        with own.lock:
            msg.frames_dropped = own.frames_dropped + counters.frames_dropped
            msg.inputs_rejected = own.inputs_rejected
            msg.queries_failed = own.queries_failed + counters.queries_failed
        msg.queries_answered = counters.queries_answered
        pending = engine.pending
        msg.texts_waiting, msg.queries_waiting = pending["texts"], pending["queries"]
        msg.frame_waiting = pending["frame"]
        self._stats_pub.publish(msg)

    def health(self) -> DiagnosticStatus:
        """The node's health as robot monitors read it: a level, a one-line message and the figures."""
        state, param = self.state, self.param
        inputs = self._inputs_health(param("camera_timeout") if state.active else 0.0)
        engine, now = state.engine, time.monotonic()
        stats = engine.stats() if engine is not None else None
        counters = engine.counters if engine is not None else None
        with self.counters.lock:
            own = self.counters
            node_drops, rejected, failed = own.frames_dropped, own.inputs_rejected, own.queries_failed
            last_error = own.last_error
        if not last_error and engine is not None and engine.load_error is not None:
            # The model failed in the engine's thread: the configure that waits for it has not yet said so.
            last_error = f"model failed to load: {engine.load_error}"
        model_drops = counters.frames_dropped if counters is not None else 0
        prev, self._previous = self._previous, (now, node_drops, model_drops)
        span = now - prev[0] if prev else 0.0
        rate_limited = (node_drops - prev[1]) / span if span > 0 else 0.0
        behind = (model_drops - prev[2]) / span if span > 0 else 0.0
        pending = engine.pending if engine is not None else {"texts": 0, "queries": 0, "frame": False}
        silent, jump, description_error = inputs.silent_cameras, inputs.pose_jump, inputs.description_error
        level, message = DiagnosticStatus.OK, "active: taking input and answering"
        if engine is None:
            level, message = DiagnosticStatus.WARN, state.model_download or "not configured: no model loaded"
        elif engine.load_error is not None:
            level, message = DiagnosticStatus.ERROR, f"model failed to load: {engine.load_error}"
        elif not engine.ready.is_set():
            level, message = DiagnosticStatus.WARN, "model is loading"
        elif engine.save_error:
            level, message = DiagnosticStatus.ERROR, f"memory file not saved: {engine.save_error}"
        elif not state.active:
            message = "inactive: the memory is kept, no input is taken"
        elif description_error:
            level, message = DiagnosticStatus.WARN, f"descriptions failing: {description_error}"
        elif jump is not None and now - jump[0] < POSE_JUMP_REPORT_S:
            level, message = DiagnosticStatus.WARN, jump[1]
        elif silent:
            level, message = DiagnosticStatus.WARN, "camera silent: " + ", ".join(
                f"{name} ({seconds:.0f} s without a frame)" for name, seconds in silent)
        elif behind > WARN_MODEL_DROPS_PER_S:
            level, message = DiagnosticStatus.WARN, f"model behind the camera: {behind:.1f} frames/s replaced unseen"
        elif pending["texts"] > param("max_pending_texts") // 2:
            level, message = DiagnosticStatus.WARN, f"model behind the text topic: {pending['texts']} texts waiting"
        elif pending["queries"] >= param("max_pending_queries"):
            level, message = DiagnosticStatus.WARN, f"query queue full ({pending['queries']} waiting)"
        saved = engine.last_saved if engine is not None else None
        values = {
            "state": state.lifecycle_state,
            "model": str(param("model")),
            "model_ready": str(engine is not None and engine.ready.is_set()).lower(),
            "cache_fill": f"{stats.fill if stats else 0}/{param('cache_size')}",
            "tokens_seen": str(stats.tokens_seen if stats else 0),
            "archive_fill": f"{stats.archive_tokens if stats else 0}/{param('archive_size')}",
            "archive_bytes": str(stats.archive_bytes if stats else 0),
            "texts_waiting": str(pending["texts"]),
            "queries_waiting": str(pending["queries"]),
            "frame_waiting": str(pending["frame"]).lower(),
            "frames_dropped_by_rate_per_s": f"{rate_limited:.2f}",
            "frames_dropped_by_model_per_s": f"{behind:.2f}",
            "inputs_rejected": str(rejected),
            "queries_failed": str(failed + (counters.queries_failed if counters else 0)),
            "checkpoints_failed": str(counters.checkpoints_failed if counters else 0),
            # What the last save wrote (the memory file and the archive blocks new since the save before) and took.
            "last_checkpoint_bytes": str(saved.bytes if saved else 0),
            "last_checkpoint_s": f"{saved.seconds if saved else 0.0:.3f}",
            "last_checkpoint_held_s": f"{saved.held_s if saved else 0.0:.3f}",  # the model waited this long
            "longest_text_wait_s": f"{counters.longest_text_wait_s if counters else 0.0:.2f}",
            "pose_frame": inputs.pose_frame,
            "pose_history_cleared": str(inputs.pose_jumps),
            "cameras": inputs.cameras,
            "cameras_silent": ", ".join(name for name, _ in silent),
            "last_error": last_error,
        }
        return DiagnosticStatus(level=level, name=f"{self.ros.get_fully_qualified_name()}: memory", message=message,
                                hardware_id=str(param("device")),
                                values=[KeyValue(key=k, value=v) for k, v in values.items()])

    def publish_diagnostics(self) -> None:
        try:
            status = self.health()
        except Exception as exc:  # a health report must never take the executor down
            self.ros.get_logger().error(f"health report failed: {type(exc).__name__}: {exc}",
                                         throttle_duration_sec=60.0)
            return
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.ros.get_clock().now().to_msg()
        self._diagnostics_pub.publish(msg)
