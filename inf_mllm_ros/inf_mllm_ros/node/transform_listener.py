"""/tf and /tf_static taken on a thread of their own: `TransformListener`.

A robot's /tf carries tens to hundreds of messages a second. Taken on the node's executor, each message is one
turn of its wait set (every subscription, service, timer and guard condition of the node, built again in Python),
a few milliseconds: a burst of /tf (a bag replayed in lockstep, a link that caught up) reached the node seconds
after the input that needed it, and the input was kept without a pose (route bags through the node: 9 of the 162
narration lines among the answers' evidence, the right sighting among them; `benchmarks/where_when.py`). As
tf2_ros's listener does with its own thread, the transforms are taken by a node of their own
(`<node name>_transforms`, in the node's namespace, with just the two subscriptions) that an executor spins on a
thread of its own, so they come in as fast as they arrive, whatever the node's other callbacks are doing.

The topics are the node's names for /tf and /tf_static, its remaps applied (a robot in a namespace often remaps
them); the listener's node takes none of the process's arguments, so that a `__node:=` given to the memory's node
does not name this one too.
"""

from __future__ import annotations

import threading
from typing import Callable

import rclpy
from rclpy.executors import ExternalShutdownException, ShutdownException, SingleThreadedExecutor
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

# As tf2_ros's listener takes them (its DynamicListenerQoS and StaticListenerQoS): /tf reliable and deep enough
# for many frames at tens of Hz, /tf_static latched. Best effort lost the newest transforms of a burst (the
# receiver's buffers full as they came), which are the ones the input after it needs.
TF_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE)
TF_STATIC_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                           durability=DurabilityPolicy.TRANSIENT_LOCAL)
# Seconds `stop` waits for the listener's thread to end.
STOP_TIMEOUT_S = 5.0
# The longest the thread waits for a message before it looks whether it is to stop.
SPIN_PERIOD_S = 0.1


def resolved_name(node, topic: str) -> str:
    """The topic's full name as `node` would subscribe to it, its remaps applied (rclpy's resolve_topic_name; a
    release without it gets the name as given)."""
    resolve = getattr(node, "resolve_topic_name", None)
    return resolve(topic) if resolve is not None else topic


class TransformListener:
    """Takes /tf and /tf_static for `node` on a thread of its own and hands each message to
    `on_transforms(message, static)`, on that thread."""

    def __init__(self, node, message_type, on_transforms: Callable[[object, bool], None]):
        self._node = node
        self._type = message_type
        self._on_transforms = on_transforms
        self._listener = None
        self._executor: SingleThreadedExecutor | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def node_name(self) -> str:
        return f"{self._node.get_name()}_transforms"

    def start(self) -> None:
        if self._listener is not None:
            return
        context = self._node.context
        listener = rclpy.create_node(self.node_name, namespace=self._node.get_namespace(), context=context,
                                     use_global_arguments=False, start_parameter_services=False)
        for topic, static, qos in (("/tf", False, TF_QOS), ("/tf_static", True, TF_STATIC_QOS)):
            listener.create_subscription(self._type, resolved_name(self._node, topic),
                                         lambda msg, s=static: self._on_transforms(msg, s), qos)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(listener)
        self._listener, self._executor = listener, executor
        self._stop.clear()
        self._thread = threading.Thread(target=self._spin, args=(executor,), name="inf_mllm_transforms", daemon=True)
        self._thread.start()

    def _spin(self, executor: SingleThreadedExecutor) -> None:
        try:
            while not self._stop.is_set() and self._node.context.ok():
                executor.spin_once(timeout_sec=SPIN_PERIOD_S)
        except (ExternalShutdownException, ShutdownException):
            pass
        except Exception as exc:  # noqa: BLE001 - said, not lost: inputs then get the pose topic's poses only
            self._node.get_logger().error(f"transforms are no longer taken: {exc!r}")

    def stop(self) -> None:
        """Stop taking transforms: the thread ends before its executor and node go, so that nothing is destroyed
        under a wait in progress (a node shut down while active, then the process, would otherwise race it)."""
        if self._listener is None:
            return
        self._stop.set()
        self._thread.join(STOP_TIMEOUT_S)
        self._executor.shutdown(timeout_sec=0)
        self._listener.destroy_node()
        self._listener = self._executor = self._thread = None
