"""A burst of callers across processes, as planners' code would make them: `processes` processes of `clients`
`~/query` clients each, with the default client settings (a 10-deep history), made at once and each calling once at
the same wall-clock moment; each process then spins a plain `SingleThreadedExecutor` until every one of its callers
heard back or `timeout` seconds passed. `test_node.py` runs one burst beside a busy core; `benchmarks/busy_machine.py`
records runs of it.

A calling process (`python -m inf_mllm_ros.testing.burst SERVICE CLIENTS START_AT TIMEOUT`) prints one JSON line:
per caller, whether a response came, after how long, and its success and message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

QUESTION = "What is {i} plus one?"
MATCH_S = 6.0  # the clients are made and matched with the service before the moment they call


def caller_process(service: str, clients: int, start_at: float, timeout: float) -> list[dict]:
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from inf_mllm_interfaces.srv import Query

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
    futures = [c.call_async(Query.Request(question=QUESTION.format(i=i), max_new_tokens=2)) for i, c in enumerate(made)]
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
    node.destroy_node()
    rclpy.shutdown()
    return out


def burst_of_callers(service: str, env: dict, processes: int = 10, clients: int = 10,
                     timeout: float = 120.0) -> list[dict] | None:
    """One burst; its callers' results (processes x clients of them), or None if a calling process died without
    reporting (its stderr printed)."""
    start_at = time.time() + MATCH_S
    callers = [subprocess.Popen([sys.executable, "-m", "inf_mllm_ros.testing.burst", service, str(clients),
                                 str(start_at), str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
               for _ in range(processes)]
    results, died = [], False
    try:
        for c in callers:
            out, err = c.communicate(timeout=timeout + 90)
            lines = out.strip().splitlines()
            if c.returncode != 0 or not lines:
                print(f"a calling process ended with {c.returncode} and no report: {err[-2000:]}")
                died = True
            else:
                results += json.loads(lines[-1])
    finally:
        for c in callers:
            if c.poll() is None:
                c.kill()
                c.wait()
    return None if died else results


def burst_figures(results: list[dict]) -> dict:
    """What a burst shows: callers, those that heard back, answered, refused (by reason), the slowest response."""
    heard = [r for r in results if r["responded"]]
    refused: dict[str, int] = {}
    for r in heard:
        if not r["success"]:
            reason = r["message"].split(":")[0].split("(")[0].strip()
            refused[reason] = refused.get(reason, 0) + 1
    latencies = sorted(r["latency_s"] for r in heard)
    return {"callers": len(results), "heard_back": len(heard), "answered": sum(r["success"] for r in heard),
            "refused": refused, "never_heard": len(results) - len(heard),
            "slowest_s": round(latencies[-1], 2) if latencies else None,
            "median_s": round(latencies[len(latencies) // 2], 2) if latencies else None}


def main() -> None:
    service, clients, start_at, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    print(json.dumps(caller_process(service, clients, start_at, timeout)), flush=True)


if __name__ == "__main__":
    main()
