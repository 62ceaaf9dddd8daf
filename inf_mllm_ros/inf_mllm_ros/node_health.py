"""The node's figures and health: `~/cache_stats` and `/diagnostics`.

`NodeHealth` is a part of `InfMLLMNode` (node.py). `~/cache_stats` carries the cache's and the node's
counters after every input and every `stats_period`; `/diagnostics` carries one DiagnosticStatus every
`diagnostics_period`, with a level and a one-line message as robot monitors read them, from a timer in
a callback group of its own so that it goes on while a configure loads the model.
"""

from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from inf_mllm_interfaces.msg import CacheStats

STATS_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
DIAGNOSTICS_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
# Health: frames the model had no time for (a newer one replaced them while it worked), per second.
WARN_MODEL_DROPS_PER_S = 0.5


class NodeHealth:
    """Publishing `~/cache_stats` and `/diagnostics`, and the health report behind the latter.

    A mixin of `InfMLLMNode`: it reads the node's `engine`, `_active`, `_lifecycle_state`, `_stats_pub`,
    the counters kept under `_lock` (`_frames_dropped`, `_inputs_rejected`, `_queries_failed`,
    `_last_error`) and `_description_error`.
    """

    def _init_health(self) -> None:
        """The /diagnostics publisher and its timer; they exist in every lifecycle state."""
        self._health_prev: tuple[float, int, int] | None = None  # (time, node drops, model drops)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", DIAGNOSTICS_QOS)
        self._diagnostics_timer = None
        # Its own group: health goes on while a lifecycle manager's configure holds the default group for as
        # long as the model loads ("model is loading").
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self._set_diagnostics_period(self._param("diagnostics_period"))

    def _set_diagnostics_period(self, period: float) -> None:
        if self._diagnostics_timer is not None:
            self.destroy_timer(self._diagnostics_timer)
        self._diagnostics_timer = self.create_timer(period, self._publish_diagnostics,
                                                    callback_group=self._diagnostics_group) if period > 0.0 else None

    def _publish_stats(self) -> None:
        if self._stats_pub is None or self.engine is None:
            return
        msg = CacheStats(capacity=self._param("cache_size"), eviction_policy=self._param("eviction_policy"),
                         attention_bias=float(self.engine.settings.policy_settings.get("attention_bias", 0.0)),
                         model_ready=self.engine.ready.is_set() and self._active)
        msg.header.stamp = self.get_clock().now().to_msg()
        s = self.engine.stats()
        if s is not None:
            msg.capacity, msg.fill = s.capacity, s.fill
            msg.tokens_seen, msg.tokens_evicted = s.tokens_seen, s.tokens_evicted
            msg.frames_ingested, msg.texts_ingested, msg.kv_bytes = s.frames_ingested, s.texts_ingested, s.kv_bytes
            msg.pinned_held = s.pinned_held
            msg.archive_tokens, msg.archive_blocks = s.archive_tokens, s.archive_blocks
            msg.archive_bytes = s.archive_bytes
            msg.eviction_policy = s.policy  # the bias is the config's: the snapshot lags a change until the next input
        counters = self.engine.counters
        with self._lock:
            msg.frames_dropped = self._frames_dropped + counters.frames_dropped
            msg.inputs_rejected = self._inputs_rejected
            msg.queries_failed = self._queries_failed + counters.queries_failed
        msg.queries_answered = counters.queries_answered
        pending = self.engine.pending
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
        if not last_error and engine is not None and engine.load_error is not None:
            # The model failed in the engine's thread: the configure that waits for it has not yet said so.
            last_error = f"model failed to load: {engine.load_error}"
        model_drops = counters.frames_dropped if counters is not None else 0
        prev, self._health_prev = self._health_prev, (now, node_drops, model_drops)
        span = now - prev[0] if prev else 0.0
        rate_limited = (node_drops - prev[1]) / span if span > 0 else 0.0
        behind = (model_drops - prev[2]) / span if span > 0 else 0.0
        pending = engine.pending if engine is not None else {"texts": 0, "queries": 0, "frame": False}
        level, message = DiagnosticStatus.OK, "active: taking input and answering"
        if engine is None:
            level, message = DiagnosticStatus.WARN, "not configured: no model loaded"
        elif engine.load_error is not None:
            level, message = DiagnosticStatus.ERROR, f"model failed to load: {engine.load_error}"
        elif not engine.ready.is_set():
            level, message = DiagnosticStatus.WARN, "model is loading"
        elif engine.save_error:
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
        saved = engine.last_saved if engine is not None else None
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
            # What the last save wrote (the memory file and the archive blocks new since the save before) and took.
            "last_checkpoint_bytes": str(saved.bytes if saved else 0),
            "last_checkpoint_s": f"{saved.seconds if saved else 0.0:.3f}",
            "longest_text_wait_s": f"{counters.longest_text_wait_s if counters else 0.0:.2f}",
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
