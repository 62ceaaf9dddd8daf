#!/usr/bin/env python3
"""One runner for every benchmark: the benchmark's own options after its name, or a smoke run of them all.

    python benchmarks/run.py list                     # the benchmarks, a line each
    python benchmarks/run.py recall --caches 512      # a benchmark with its own options (its --help lists them)
    python benchmarks/run.py --smoke                  # every benchmark on the small embedded models, a few steps
    python benchmarks/run.py --smoke recall dialogue  # some of them

Each benchmark is a module here with `main(argv)` and `SMOKE`, the options that make it a few seconds' run on the
small models (`smollm2`, `smolvlm-smollm2`). A smoke run writes its results to a scratch folder (BENCHMARK_RESULTS),
never over `results/`, and fails when a benchmark fails or writes no result: the suite runs it, so that no benchmark
rots between the runs whose figures the docs report. Run after `bash scripts/setup.sh` and `source scripts/env.sh`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: what it measures (docs/benchmarks.md has each one's results).
BENCHMARKS = {
    "long_text": "perplexity over a long text per policy and cache size (and the attention-bias sweep)",
    "recall": "facts told once and asked later, per policy, cache size and distance",
    "archive_recall": "recall from the archive on the tuning and report sets; answer latency with an archive",
    "told_long_ago": "six facts of every kind told more than four caches back, asked with and without the archive",
    "dialogue": "a dialogue that tells facts and asks them many rounds later",
    "camera_flood": "facts told among a flood of camera frames",
    "cache_alone": "what the bounded cache alone keeps: pinned facts, and facts through a flood of frames",
    "frame_stream": "an endless camera stream: memory and time per frame stay flat",
    "chunk_time": "time per chunk of input per policy",
    "eviction_ops": "the eviction's own operations per chunk",
    "memory_file": "saving and loading the memory, and checkpoint writes",
    "gpu_speed": "decode and ingest steps eager, static and compiled; bandwidth floor",
    "scoring_bench": "retrieval-window scoring, blocked PyTorch against Triton",
    "soak": "the installed node for an hour under a camera, texts and questions over DDS",
    "node_flood": "the installed node under a flood of texts and frames over DDS, from the first message",
    "executor_flood": "rclpy's multi-threaded executor against the node's under a flood over DDS",
    "busy_machine": "the node beside CPU-bound processes: a burst of 100 callers, and the flood from a busy publisher",
    "first_answer": "the installed node's first answer after activation against the ten after it, fresh and warm cache",
    "demo_bag": "the demo's answers over the shipped sample bag, with the demo's parameters, as a record",
    "locomo": "LoCoMo's long conversations (written by others) asked at the end: F1, evidence hit@5, against BM25",
    "where_when": "a patrol robot's reports asked about later: what, when (time) and where (evidence's pose)",
    "route_recall": "the route bags' questions in other words as recalls in-process, per variant of the ranking",
    "streams": "several robots' streams on one model, answers decoded in one batch, against one after the other",
    "robots_flood": "two robots on one model in one node over DDS: one robot's flood against the other's questions",
    "summarize": "markdown tables of the recorded results",
}


def module(name: str):
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


def wrote_something(path: Path) -> bool:
    """A result file with something in it: a JSON file that holds records, any other file that is not empty."""
    if path.suffix == ".json":
        try:
            return bool(json.loads(path.read_text()))
        except ValueError:
            return False
    return path.stat().st_size > 0


def smoke(names: list[str]) -> int:
    """Run each benchmark's SMOKE options in a child process over a scratch results folder; 1 if any failed."""
    failed = []
    for name in names or list(BENCHMARKS):
        options = module(name).SMOKE
        with tempfile.TemporaryDirectory(prefix=f"smoke_{name}_") as scratch:
            env = dict(os.environ, BENCHMARK_RESULTS=scratch)
            start = time.monotonic()
            done = subprocess.run([sys.executable, str(HERE / "run.py"), name, *options], env=env)
            written = sorted(p.name for p in Path(scratch).iterdir() if wrote_something(p))
            seconds = time.monotonic() - start
            ok = done.returncode == 0 and (written or name == "summarize")
            print(f"[smoke] {name}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s, wrote {written or 'nothing'}",
                  flush=True)
            if not ok:
                failed.append(name)
    if failed:
        print(f"[smoke] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--smoke"]:
        return smoke(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "list":
        width = max(map(len, BENCHMARKS))
        for name, what in BENCHMARKS.items():
            print(f"{name:<{width}}  {what}")
        return 0
    return module(argv[0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
