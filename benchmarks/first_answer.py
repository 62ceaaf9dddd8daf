"""The first answer after activation against the answers after it: the installed node started as its own process over
DDS (testing/node_process.py), the default model in float32 and the shipped settings otherwise (no descriptions, so
that none competes with a question), told a few short facts and then asked eleven different questions one after the
other, each with the same max_new_tokens. Whatever the model needs before its first answer is meant to be done while
configuring (or read from the cache folder): the first answer should take no longer than 1.2 times the median of the
ten after it.

Each run starts the node twice, in a fresh node folder each time (no memory file before it):

- fresh: an empty cache folder (`INF_MLLM_CACHE_DIR`), so that configure finds the retrieval heads itself;
- warm: the same cache folder again, so that configure reads them.

A record per start (variant) in results/first_answer.json (appended, so that runs on other days or trees stay beside
it): configure's time (from the process's start to `model_ready` on `~/cache_stats`, and the node's own "model ready
in" figure), what configure spent on each preparation where the node logs it, every question's latency as the caller
saw it and as the answer reports it, the first, the median of the next ten, their ratio and whether it is within 1.2,
and the machine's load average (1 min) before the first question and after the last: other work on the machine
shows in every latency.

    python benchmarks/first_answer.py                 # the default model, 3 runs
    python benchmarks/first_answer.py --runs 1 --variants warm
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, load_records, machine, write_records
from inf_mllm_ros.testing.node_process import Driver, NodeProcess, default_domain_id

OUT = "first_answer.json"
MODEL = "onevision-qwen2.5-0.5b"
TARGET = 1.2  # the first answer within this many times the median of the next ten
# The shipped settings but for: the model's precision named, no descriptions (none competes with a question), no
# checkpoint but the last (a save between two questions would time the save), stats twice a second (configure's end
# and each text's ingestion are seen sooner).
NODE_PARAMS = {"dtype": "float32", "description_period": 0.0, "checkpoint_period": 0.0, "stats_period": 0.5}
FACTS = [
    "The spare key to the workshop is under the blue flower pot.",
    "The delivery robot R2 charges in bay seven every night.",
    "Maria moved the first aid kit to the shelf beside the window.",
    "The freezer in the north kitchen is set to minus eighteen degrees.",
    "The visitors from Lyon arrive on Thursday at ten in the morning.",
]
QUESTIONS = [
    "Where is the spare key to the workshop?",
    "Where does the delivery robot R2 charge?",
    "Where did Maria move the first aid kit?",
    "What temperature is the freezer in the north kitchen set to?",
    "When do the visitors from Lyon arrive?",
    "Who moved the first aid kit?",
    "Which robot charges in bay seven?",
    "What is under the blue flower pot?",
    "Where are the visitors coming from?",
    "Which kitchen has the freezer?",
    "On which day do the visitors arrive?",
]
QUESTION_TOKENS = 16  # every question's max_new_tokens
READY_TIMEOUT_S = 900.0  # configure, which may find the retrieval heads on a CPU
QUERY_TIMEOUT_S = 300.0

# The options of a short run on the small model (run.py --smoke).
SMOKE = ["--runs", "1", "--model", "smolvlm-smollm2", "--questions", "3", "--label", "smoke"]


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head


def ask(driver: Driver, question: str, max_new_tokens: int) -> tuple[float, object]:
    """One question through `~/query`: the caller's seconds from the call to the response, and the response."""
    done = threading.Event()
    start = time.monotonic()
    future = driver.ask(question, max_new_tokens)
    future.add_done_callback(lambda _: done.set())
    if not done.wait(QUERY_TIMEOUT_S):
        raise RuntimeError(f"no answer to {question!r} after {QUERY_TIMEOUT_S:g} s")
    seconds = time.monotonic() - start
    response = future.result()
    if not response.success:
        raise RuntimeError(f"{question!r} failed: {response.message}")
    return seconds, response


def wait_for(driver: Driver, node: NodeProcess, done, timeout: float, what: str):
    """The first stats message that `done` accepts; RuntimeError if the node dies or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        stats, at = driver.latest_stats()
        if stats is not None and done(stats):
            return stats, at
        if not node.alive:
            raise RuntimeError(f"the node exited before {what}: {node.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout:g} s: {node.log()[-3000:]}")
        time.sleep(0.02)


def configure_log(log: str) -> dict:
    """What the node's log says configure took: the whole ("model ready in"), and each preparation it names
    ("prepared ... in X s" lines, or "<step> X s" pieces of such a line)."""
    out: dict = {}
    ready = re.search(r"model ready in ([0-9.]+) s", log)
    if ready:
        out["node_ready_s"] = float(ready.group(1))
    for line in log.splitlines():
        if "prepared" not in line:
            continue
        for name, seconds in re.findall(r"([a-z_ ]+?):? ([0-9.]+) s", line.split("prepared", 1)[1]):
            out.setdefault("prepared_s", {})[name.strip().replace(" ", "_")] = float(seconds)
    return out


def one_start(args, variant: str, cache_dir: Path, questions: list[str]) -> dict:
    """Start the node with `cache_dir` as its cache folder, tell the facts, ask the questions; the record."""
    domain = default_domain_id()
    params = dict(NODE_PARAMS, model=args.model)
    with tempfile.TemporaryDirectory(prefix="inf_mllm_first_answer_") as folder:
        node = NodeProcess(domain, params, Path(folder), extra_env={"INF_MLLM_CACHE_DIR": str(cache_dir)})
        driver = Driver(domain, name="first_answer_driver")
        try:
            heads_before = sorted(p.name for p in cache_dir.glob("retrieval_heads-*"))
            _, ready_at = wait_for(driver, node, lambda s: s.model_ready, READY_TIMEOUT_S, "model_ready")
            configure_s = ready_at - node.started
            if not driver.query.wait_for_service(timeout_sec=60):
                raise RuntimeError("~/query did not appear")
            for fact in FACTS:
                driver.publish_text(fact)
            wait_for(driver, node, lambda s: s.texts_ingested >= len(FACTS) and s.texts_waiting == 0, 300,
                     "the facts ingested")
            load_before = os.getloadavg()[0]
            latencies, node_latencies, answers = [], [], []
            for question in questions:
                seconds, response = ask(driver, question, args.question_tokens)
                latencies.append(round(seconds, 4))
                node_latencies.append(round(float(response.latency), 4))
                answers.append(response.answer)
                print(f"[{variant}] {seconds:6.2f} s (node {response.latency:.2f} s) {question!r} -> "
                      f"{response.answer!r}", flush=True)
            stats, _ = driver.latest_stats()
            load_after = os.getloadavg()[0]
        finally:
            driver.close()
            code, _, killed = node.stop(60)
        log = node.log()
    first, rest = latencies[0], latencies[1:]
    median = statistics.median(rest) if rest else first
    node_median = statistics.median(node_latencies[1:]) if rest else node_latencies[0]
    ratio = first / median
    return {
        "variant": variant, "model": args.model, "code": args.label, "commit": commit(), "device": machine(),
        "node_params": json.dumps(params), "question_tokens": args.question_tokens, "facts": len(FACTS),
        "heads_in_cache_folder_before": bool(heads_before), "configure_s": round(configure_s, 3),
        **configure_log(log), "first_s": first, "next_median_s": round(median, 4), "ratio": round(ratio, 3),
        "node_first_s": node_latencies[0], "node_next_median_s": round(node_median, 4),
        "node_ratio": round(node_latencies[0] / node_median, 3), "target": TARGET, "passed": ratio <= TARGET,
        "latencies_s": latencies, "node_latencies_s": node_latencies, "answers": answers,
        "archive_tokens": stats.archive_tokens if stats is not None else None,
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "exit_code": code, "killed": killed,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=["fresh", "warm"], default=["fresh", "warm"],
                   help="warm alone reuses the cache folder of a fresh start made first, unrecorded")
    p.add_argument("--questions", type=int, default=len(QUESTIONS), help="questions asked (the first and the rest)")
    p.add_argument("--question-tokens", type=int, default=QUESTION_TOKENS, help="each question's max_new_tokens")
    p.add_argument("--label", default="current", help="names the code measured")
    args = p.parse_args(argv)
    questions = QUESTIONS[: max(2, args.questions)]
    records = load_records(OUT)
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="inf_mllm_cache_") as cache:
            for variant in ["fresh", "warm"]:
                if variant not in args.variants and not (variant == "fresh" and "warm" in args.variants):
                    continue
                record = one_start(args, variant, Path(cache), questions)
                if variant not in args.variants:
                    continue  # the start that filled the cache folder for a warm one
                record["run"] = run
                print(json.dumps({k: v for k, v in record.items() if k != "answers"}), flush=True)
                print(f"[{variant}] run {run}: configure {record['configure_s']:.1f} s, first {record['first_s']:.2f} s"
                      f" vs median of the next {len(questions) - 1} {record['next_median_s']:.2f} s: ratio "
                      f"{record['ratio']:.2f} ({'pass' if record['passed'] else 'FAIL'} against {TARGET})", flush=True)
                records.append(record)
                write_records(OUT, records)


if __name__ == "__main__":
    main()
