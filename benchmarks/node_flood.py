"""The node under a flood, counted from the first message (inf_mllm_ros.testing.flood): texts at 50 a second and
320x240 frames at 5 Hz for 30 s from another process into a fresh node, a question at 10 s; beside it the same
engine in one process under the same traffic, its inputs stamped as the node stamps them (and once more without
the time, for comparison). Each run is a record in results/node_flood.json (appended, so that
runs on other days or trees stay beside it).

    python benchmarks/node_flood.py                        # the small model, 3 runs
    python benchmarks/node_flood.py --model onevision-qwen2.5-0.5b --runs 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import load_records, machine, write_records
from inf_mllm_ros.testing.flood import NODE_PARAMS, flood_figures, node_under_flood, reference_pace
from inf_mllm_ros.testing.node_process import default_domain_id

OUT = "node_flood.json"

# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--runs", "1", "--label", "smoke"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smolvlm-smollm2")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--label", default="current", help="names the code measured")
    args = p.parse_args(argv)
    records = load_records(OUT)
    for run in range(args.runs):
        reference = reference_pace(args.model)
        unstamped = reference_pace(args.model, stamped=False)
        with tempfile.TemporaryDirectory(prefix="inf_mllm_flood_") as folder:
            flood = node_under_flood(args.model, Path(folder), default_domain_id())
        record = {"model": args.model, "run": run, "code": args.label, "node_params": json.dumps(NODE_PARAMS),
                  **{k: round(v, 3) if isinstance(v, float) else v for k, v in flood_figures(reference, flood).items()},
                  "reference_unstamped_texts_per_s": round(unstamped["texts_per_s"], 3), "device": machine()}
        print(json.dumps(record), flush=True)
        records.append(record)
        write_records(OUT, records)


if __name__ == "__main__":
    main()
