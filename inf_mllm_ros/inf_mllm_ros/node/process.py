"""The node's process: its nodes (one, or one per memory on a shared model: node/streams.py), the executor that
serves them, signals and shutdown.

Runnable as `ros2 run inf_mllm_ros inf_mllm_node`.
"""

from __future__ import annotations

import signal
import threading
import time

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.logging import get_logger
from rclpy.signals import SignalHandlerOptions

from .executor import OnceQueuedExecutor
from .lifecycle import NODE_NAME, InfMLLMNode
from .streams import memory_nodes


def shut_down(nodes: list[InfMLLMNode], executor: OnceQueuedExecutor, grace: float = 5.0) -> None:
    """Stop the models, then keep serving until every caller still waiting has its response.

    Requests that arrive meanwhile are answered at once with "node is shutting down".
    """
    for node in nodes:
        node.close()
    settle = time.monotonic() + 0.3  # requests already on their way get their refusal too
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(node.services_busy for node in nodes) or time.monotonic() < settle):
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
        node.end_autostart()


def main(args=None) -> int:
    # The node handles SIGINT and SIGTERM itself: rclpy's handler would shut the ROS context down at once,
    # and callers waiting for an answer would never get their response. A second signal (a terminal and a
    # launch file both send one) only repeats the request.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop, failed = threading.Event(), threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    nodes: list[InfMLLMNode] = []
    executor = None
    try:
        nodes = memory_nodes()
        if len(nodes) > 1:
            get_logger(NODE_NAME).info(f"{len(nodes)} memories on one model: "
                                       + ", ".join(node.get_fully_qualified_name() for node in nodes))
        executor = OnceQueuedExecutor(num_threads=sum(node.executor_threads for node in nodes))
        for node in nodes:
            executor.add_node(node)
        for node in nodes:
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
        if executor is not None:
            shut_down(nodes, executor)
        else:
            for node in nodes:
                node.close()
        for node in nodes:
            node.destroy_node()
        rclpy.try_shutdown()
    return 1 if failed.is_set() else 0


if __name__ == "__main__":
    raise SystemExit(main())
