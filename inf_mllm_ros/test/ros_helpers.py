"""Test-side ROS plumbing: a node spinning in its own thread and context, waits with deadlines."""

from __future__ import annotations

import threading
import time
from typing import Callable

import rclpy
from rcl_interfaces.srv import SetParameters
from rclpy.executors import ExternalShutdownException
from rclpy.parameter import Parameter

from inf_mllm_ros.node.executor import OnceQueuedExecutor


class RosProbe:
    """One rclpy node for the test process; `alive` is checked while waiting (e.g. the node process)."""

    def __init__(self, name: str, alive: Callable[[], None] = lambda: None):
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(name, context=self.context)
        self.executor = OnceQueuedExecutor(num_threads=4, context=self.context)
        self.executor.add_node(self.node)
        self.alive = alive
        self._closed = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self._thread.join(5)

    def wait_for(self, condition: Callable[[], object], timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            self.alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.05)

    def call(self, client, request, timeout: float = 120.0):
        self.wait_for(lambda: client.service_is_ready(), timeout, f"service {client.srv_name}")
        future = client.call_async(request)
        self.wait_for(future.done, timeout, f"an answer from {client.srv_name}")
        return future.result()

    def send_goal(self, client, goal, timeout: float = 120.0):
        """Send an action goal; returns (goal handle, feedback list that fills as it comes, result future)."""
        self.wait_for(lambda: client.server_is_ready(), timeout, "the action server")
        feedback = []
        sent = client.send_goal_async(goal, feedback_callback=lambda msg: feedback.append(msg.feedback))
        handle = self.wait_for(lambda: sent.done() and sent.result(), timeout, "the goal accepted or rejected")
        return handle, feedback, handle.get_result_async()

    def set_parameters(self, node_fqn: str, timeout: float = 30.0, **values):
        """Set parameters on another node; returns its SetParametersResult list."""
        client = self.node.create_client(SetParameters, f"{node_fqn}/set_parameters")
        try:
            request = SetParameters.Request(
                parameters=[Parameter(name, value=value).to_parameter_msg() for name, value in values.items()])
            return self.call(client, request, timeout).results
        finally:
            self.node.destroy_client(client)


class Latest:
    """Messages received on one subscription, with a wait for one that matches."""

    def __init__(self, probe: RosProbe, msg_type, topic: str, qos):
        self.probe = probe
        self.messages: list = []
        self._lock = threading.Lock()
        self.subscription = probe.node.create_subscription(msg_type, topic, self._on_msg, qos)

    def _on_msg(self, msg) -> None:
        with self._lock:
            self.messages.append(msg)

    def clear(self) -> None:
        """Forget the messages received so far."""
        with self._lock:
            self.messages.clear()

    @property
    def last(self):
        with self._lock:
            return self.messages[-1] if self.messages else None

    def wait(self, predicate: Callable[[object], bool] = lambda m: True, timeout: float = 60.0, what: str = "a message"):
        def match():
            with self._lock:
                for msg in reversed(self.messages):
                    if predicate(msg):
                        return msg
            return None

        return self.probe.wait_for(match, timeout, what)
