"""One process of a burst of callers, as a planner's code would make them: `clients` Query clients with the
default client settings, made at once, each calling once at the wall-clock time `start_at`; then the
responses are awaited until `timeout` seconds after the call. Prints one JSON line: per caller, whether a
response came, after how long, and its success and message.

    python burst_callers.py SERVICE CLIENTS START_AT TIMEOUT
"""

from __future__ import annotations

import json
import sys
import time

import rclpy
from rclpy.executors import SingleThreadedExecutor

from inf_mllm_interfaces.srv import Query


def main() -> None:
    service, clients, start_at, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    rclpy.init()
    node = rclpy.create_node(f"burst_callers_{time.monotonic_ns() % 1_000_000}")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    made = [node.create_client(Query, service) for _ in range(clients)]
    deadline = time.time() + 60
    while not all(c.service_is_ready() for c in made) and time.time() < deadline:
        executor.spin_once(timeout_sec=0.05)
    while time.time() < start_at:
        executor.spin_once(timeout_sec=min(0.05, max(start_at - time.time(), 0.0)))
    start = time.monotonic()
    futures = [c.call_async(Query.Request(question=f"What is {i} plus one?", max_new_tokens=2))
               for i, c in enumerate(made)]
    heard: dict[int, float] = {}  # caller -> seconds from the call to its response
    while len(heard) < len(futures) and time.monotonic() - start < timeout:
        executor.spin_once(timeout_sec=0.05)
        for i, f in enumerate(futures):
            if f.done() and i not in heard:
                heard[i] = time.monotonic() - start
    out = []
    for i, f in enumerate(futures):
        r = f.result() if f.done() else None
        out.append({"responded": r is not None, "latency_s": heard.get(i),
                    "success": bool(r and r.success), "message": r.message if r else ""})
    print(json.dumps(out), flush=True)
    node.destroy_node()
    rclpy.shutdown()


if __name__ == "__main__":
    main()
