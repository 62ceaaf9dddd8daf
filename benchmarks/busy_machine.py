"""The installed node on a machine it shares, as a robot's is: CPU-bound processes beside it (as many as the cores
less one, testing/cpu_load.py) while, over DDS from other processes,

- burst: 100 concurrent `~/query` calls from 10 processes of 10 default clients each (testing/burst.py): how many
  callers heard back (an answer, or a refusal or a timeout with its reason), answered, refused, the slowest;
- flood: texts at 50 a second and 320x240 frames at 5 Hz for 30 s, a question at 10 s, the small model, cache 256,
  frame_rate 1, published from timers by a node spinning rclpy's MultiThreadedExecutor (testing/flood.py), beside
  the reference: the same engine in one process beside the same load under the same traffic and question.

Each run is a record in results/busy_machine.json (appended, so that runs on other days or trees stay beside it).

    python benchmarks/busy_machine.py                          # both, 5 runs each
    python benchmarks/busy_machine.py --part burst --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from common import load_records, machine, write_records
from inf_mllm_ros.testing.burst import burst_figures, burst_of_callers
from inf_mllm_ros.testing.cpu_load import busy_cores, cores_less_one
from inf_mllm_ros.testing.flood import (NODE_PARAMS, QUESTION_TOKENS, node_under_flood, reference_flood,
                                        shared_cpu_figures)
from inf_mllm_ros.testing.node_process import Driver, NodeProcess, default_domain_id

OUT = "busy_machine.json"
MODEL = "smolvlm-smollm2"
# The burst's node: the small model with the shipped settings otherwise (max_pending_queries 8, query_timeout 120 s).
BURST_PARAMS = {"model": MODEL, "cache_size": 256, "description_period": 0.0, "stats_period": 0.5}
BURST_TIMEOUT_S = 150.0  # each caller waits this long for its response

# The options of a short run (run.py --smoke): one small burst. The flood part is the suite's own serial test
# (test_node_flood.py: the same node_under_flood and reference_flood beside the same load), so its smoke would run
# the same minute twice.
SMOKE = ["--part", "burst", "--runs", "1", "--processes", "2", "--clients", "5", "--label", "smoke"]


def burst_runs(args, records: list) -> None:
    domain = default_domain_id()
    with tempfile.TemporaryDirectory(prefix="inf_mllm_burst_") as folder:
        node = NodeProcess(domain, BURST_PARAMS, Path(folder))
        driver = Driver(domain, name="burst_watcher")
        env = dict(os.environ, ROS_DOMAIN_ID=str(domain), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
        try:
            deadline = time.monotonic() + 300
            while not ((stats := driver.latest_stats()[0]) is not None and stats.model_ready):
                if not node.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"the node did not become ready: {node.log()[-3000:]}")
                time.sleep(0.1)
            service = f"{node_namespace()}/query"
            for run in range(args.runs):
                before = driver.latest_stats()[0]
                with busy_cores(args.busy, seconds=BURST_TIMEOUT_S + 180) as load:
                    results = burst_of_callers(service, env, args.processes, args.clients, BURST_TIMEOUT_S)
                    cores = load.cores_taken()
                if results is None:
                    raise RuntimeError("a calling process died")
                figures = burst_figures(results)
                total = before.queries_answered + before.queries_failed + figures["callers"]
                deadline = time.monotonic() + 30
                while (after := driver.latest_stats()[0]).queries_answered + after.queries_failed < total:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                record = {"part": "burst", "model": MODEL, "run": run, "code": args.label,
                          "node_params": json.dumps(BURST_PARAMS), "processes": args.processes,
                          "clients": args.clients, **figures,
                          "node_answered": after.queries_answered - before.queries_answered,
                          "node_failed": after.queries_failed - before.queries_failed,
                          "busy_processes": args.busy, "busy_cores": round(cores, 2), "device": machine()}
                print(json.dumps(record), flush=True)
                records.append(record)
                write_records(OUT, records)
        finally:
            driver.close()
            node.stop(60)


def node_namespace() -> str:
    from inf_mllm_ros.testing.node_process import NAMESPACE, NODE_NAME

    return f"{NAMESPACE}/{NODE_NAME}"


def flood_runs(args, records: list) -> None:
    for run in range(args.runs):
        reference = reference_flood(MODEL, busy=args.busy, question_tokens=args.question_tokens)
        with tempfile.TemporaryDirectory(prefix="inf_mllm_flood_") as folder:
            flood = node_under_flood(MODEL, Path(folder), default_domain_id(), publisher="timers", busy=args.busy,
                                     question_tokens=args.question_tokens)
        figures = shared_cpu_figures(reference, flood)
        record = {"part": "flood", "model": MODEL, "run": run, "code": args.label,
                  "node_params": json.dumps(NODE_PARAMS), "publisher": "timers, rclpy MultiThreadedExecutor",
                  "question_tokens": args.question_tokens,
                  **{k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()},
                  "busy_processes": args.busy, "device": machine()}
        print(json.dumps(record), flush=True)
        records.append(record)
        write_records(OUT, records)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["burst", "flood", "both"], default="both")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--processes", type=int, default=10, help="calling processes in a burst")
    p.add_argument("--clients", type=int, default=10, help="clients in each calling process")
    p.add_argument("--busy", type=int, default=cores_less_one(), help="CPU-bound processes beside")
    p.add_argument("--question-tokens", type=int, default=QUESTION_TOKENS,
                   help="the flood question's max_new_tokens, in the node and the reference alike")
    p.add_argument("--label", default="current", help="names the code measured")
    args = p.parse_args(argv)
    records = load_records(OUT)
    if args.part in ("burst", "both"):
        burst_runs(args, records)
    if args.part in ("flood", "both"):
        flood_runs(args, records)


if __name__ == "__main__":
    main()
