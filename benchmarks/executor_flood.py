"""rclpy's MultiThreadedExecutor against the node's OnceQueuedExecutor under one flood (inf_mllm_ros.testing
.executor_flood): three topics at 300 Hz each from another process, callbacks holding the GIL 2 ms, a thread wanting
the GIL beside them. Runs alternate the two executors; each is a record in results/executor_flood.json (appended).

    python benchmarks/executor_flood.py --runs 5
"""

from __future__ import annotations

import argparse
import json

from common import load_records, machine, write_records
from inf_mllm_ros.testing.executor_flood import run_flood

OUT = "executor_flood.json"

# The options of a few seconds' run (run.py --smoke).
SMOKE = ["--runs", "1", "--seconds", "1", "--label", "smoke"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs of each executor, alternating")
    p.add_argument("--seconds", type=float, default=5.0, help="of flood per run")
    p.add_argument("--label", default="current", help="names the code measured")
    args = p.parse_args(argv)
    records = load_records(OUT)
    for run in range(args.runs):
        for kind in ("rclpy", "once_queued"):
            result = run_flood(kind, seconds=args.seconds)
            record = {"run": run, "code": args.label, **result,
                      "turns_per_callback": round(result["turns"] / max(result["handled"], 1), 2),
                      "spin_share_of_callback_cpu": round(
                          result["spin_cpu_s"] / max(result["handled"] * result["callback_s"], 1e-9), 3),
                      "device": machine()}
            print(json.dumps(record), flush=True)
            records.append(record)
            write_records(OUT, records)


if __name__ == "__main__":
    main()
