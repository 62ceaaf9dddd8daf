"""An executor under a flood, across processes: what `test_executor.py` checks and `benchmarks/executor_flood.py`
records.

A publishing process floods `topics` topics at `rate_hz` each; this process spins one executor over a node that
subscribes to them, each subscription in a group of its own (as the node's inputs are), with callbacks that hold
the GIL for `callback_s` and a thread that wants the GIL in short bursts (as the model's thread does between
torch's operations). Counted from the first message to the last: callbacks run, turns of `spin_once`, and the CPU
time of the spinning thread.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

PUBLISHER = """
import sys, time
import rclpy
from rclpy.qos import QoSProfile
from std_msgs.msg import String
topics, rate_hz, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
rclpy.init()
node = rclpy.create_node("executor_flood_publisher")
pubs = [node.create_publisher(String, f"executor_flood_{i}", QoSProfile(depth=50)) for i in range(topics)]
deadline = time.monotonic() + 60
while any(p.get_subscription_count() == 0 for p in pubs):
    if time.monotonic() > deadline:
        raise SystemExit("no subscriber came")
    time.sleep(0.05)
time.sleep(0.5)
start, sent = time.monotonic(), 0
while time.monotonic() - start < seconds:
    for p in pubs:
        p.publish(String(data="x" * 60))
    sent += 1
    time.sleep(max(start + sent / rate_hz - time.monotonic(), 0.0))
print(sent * topics, flush=True)
"""


def _hold_gil(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def run_flood(executor_kind: str, *, seconds: float = 5.0, topics: int = 3, rate_hz: float = 300.0,
              callback_s: float = 0.002, threads: int = 8) -> dict:
    """One flood with `executor_kind` "once_queued" (this package's) or "rclpy" (rclpy's MultiThreadedExecutor)."""
    import rclpy
    from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.qos import QoSProfile
    from std_msgs.msg import String

    from ..node.executor import OnceQueuedExecutor

    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("executor_flood_subscriber", context=context)
    lock = threading.Lock()
    handled, first, last = [0], [None], [None]

    def on_message(_msg) -> None:
        _hold_gil(callback_s)
        with lock:
            now = time.monotonic()
            first[0] = first[0] or now
            last[0] = now
            handled[0] += 1

    for i in range(topics):
        node.create_subscription(String, f"executor_flood_{i}", on_message, QoSProfile(depth=50),
                                 callback_group=MutuallyExclusiveCallbackGroup())
    if executor_kind == "once_queued":
        executor = OnceQueuedExecutor(threads, context=context)
    elif executor_kind == "rclpy":
        executor = MultiThreadedExecutor(num_threads=threads, context=context)
    else:
        raise ValueError(f"unknown executor {executor_kind!r}")
    executor.add_node(node)
    stop, model_steps = threading.Event(), [0]

    def model() -> None:
        while not stop.is_set():
            _hold_gil(0.0005)
            time.sleep(0.0005)
            model_steps[0] += 1

    model_thread = threading.Thread(target=model, daemon=True)
    model_thread.start()
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(topics), str(rate_hz), str(seconds)],
                                 stdout=subprocess.PIPE, text=True)
    turns, cpu = 0, 0.0
    try:
        while publisher.poll() is None or (last[0] is not None and time.monotonic() - last[0] < 0.5):
            before = time.thread_time()
            executor.spin_once(timeout_sec=0.1)
            if first[0] is not None:  # from the first message on
                turns += 1
                cpu += time.thread_time() - before
    finally:
        stop.set()
        model_thread.join()
        published = publisher.communicate()[0].strip()
        executor.shutdown(timeout_sec=5)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    if publisher.returncode != 0:
        raise RuntimeError(f"the publishing process failed ({publisher.returncode})")
    span = (last[0] - first[0]) if first[0] is not None else 0.0
    return {"executor": executor_kind, "published": int(published or 0), "handled": handled[0], "turns": turns,
            "spin_cpu_s": round(cpu, 3), "span_s": round(span, 2), "callback_s": callback_s, "threads": threads,
            "topics": topics, "rate_hz": rate_hz, "model_steps": model_steps[0]}
