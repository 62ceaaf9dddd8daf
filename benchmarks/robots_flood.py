"""Several robots on one model over DDS: one robot's flood leaves another's questions answered in their own time.

One node process serves two robots (`streams: [a, b]`, docs/node.md "Several robots on one model"), the installed node
in its own process, the model loaded once. Robot b is told a few facts; then b's question is asked `--questions`
times one after another, each over `~/query` with `--answer-tokens`:

- quiet: nothing else is sent (b's own time);
- flooded: robot a's text topic gets 50 texts a second from this process (the flood's pace, testing/flood.py), from
  the first message on, while b's questions are asked the same way.

Each question's time is from the call to its response, over DDS. The figures: median and 95th percentile of each,
with a 95 % interval of the median (percentile bootstrap over questions); what the flood adds (flooded less quiet);
the bound a text call of a's has while b's question waits (`max_text_delay` of the model's time, engine/runtime/
work_queue.py); and a's texts taken, refused and sent. Records in results/robots_flood.json.

    python benchmarks/robots_flood.py                             # the default model, cache 512, 20 questions
    python benchmarks/robots_flood.py --model smolvlm-smollm2 --questions 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import load_records, machine, write_records
from inf_mllm_ros.settings import BY_NAME
from inf_mllm_ros.testing.flood import TEXT_EVERY, text
from inf_mllm_ros.testing.node_process import NAMESPACE, Driver, NodeProcess, default_domain_id

OUT = "robots_flood.json"
SMOKE = ["--model", "smolvlm-smollm2", "--questions", "2", "--cache", "256", "--label", "smoke"]
FACTS = ["Crate 41 left through door D3 at the start of the shift.", "Forklift F2 parked at dock 7.",
         "The spill near aisle 4 was cleaned up."]
QUESTION = "Where did forklift F2 park?"


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choice(values) for _ in values) for _ in range(resamples))
    return [round(medians[int(0.025 * resamples)], 3), round(medians[int(0.975 * resamples) - 1], 3)]


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "median_s": round(statistics.median(values), 3), "median_ci95": median_interval(values),
            "p95_s": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3),
            "max_s": round(ordered[-1], 3)}


def wait_for(condition, timeout: float, what: str, node: NodeProcess) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not node.alive:
            raise RuntimeError(f"the node ended while waiting for {what}: {node.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}: {node.log()[-3000:]}")
        time.sleep(0.05)


def ask(driver: Driver, tokens: int, flood=None) -> float:
    """b's question over DDS; its time from the call to the response (the flood, if any, kept up meanwhile)."""
    start = time.monotonic()
    future = driver.ask(QUESTION, tokens)
    while not future.done():
        if flood is not None:
            flood()
        time.sleep(0.004)
        if time.monotonic() - start > 600:
            raise RuntimeError("a question was not answered in 600 s")
    response = future.result()
    if not response.success:
        raise RuntimeError(f"robot b's question failed: {response.message}")
    return time.monotonic() - start


def run(args, folder: Path) -> dict:
    domain = default_domain_id()
    params = {"model": args.model, "cache_size": args.cache, "torch_threads": args.threads, "stats_period": 0.5,
              "description_period": 0.0, "streams": ["a", "b"],
              "a": {"memory_file": str(folder / "a.safetensors")}, "b": {"memory_file": str(folder / "b.safetensors")}}
    node = NodeProcess(domain, params, folder)
    a = Driver(domain, namespace=f"{NAMESPACE}/a", name="flood_a")
    b = Driver(domain, namespace=f"{NAMESPACE}/b", name="asker_b")
    try:
        for driver, name in ((a, "a"), (b, "b")):
            wait_for(lambda d=driver: (s := d.latest_stats()[0]) is not None and s.model_ready, 900, f"{name} ready",
                     node)
        wait_for(lambda: a.text.get_subscription_count() and b.text.get_subscription_count()
                 and b.query.service_is_ready(), 60, "the topics and the service", node)
        for fact in FACTS:
            b.publish_text(fact)
        wait_for(lambda: b.latest_stats()[0].texts_ingested >= len(FACTS), 300, "b's facts", node)
        quiet = [ask(b, args.answer_tokens) for _ in range(args.questions)]

        sent = 0
        start = time.monotonic()

        def flood() -> None:  # 50 texts a second into robot a, on the clock
            nonlocal sent
            while sent * TEXT_EVERY <= time.monotonic() - start:
                a.publish_text(text(sent))
                sent += 1

        flooded = []
        for _ in range(args.questions):
            flooded.append(ask(b, args.answer_tokens, flood))
            pause = time.monotonic() + 0.5  # the flood alone a moment between questions
            while time.monotonic() < pause:
                flood()
                time.sleep(0.004)
        flood_s = time.monotonic() - start
        stats = a.latest_stats()[0]
        if not node.alive:
            raise RuntimeError(f"the node ended under the flood: {node.log()[-3000:]}")
    finally:
        a.close()
        b.close()
        code = node.stop(120)[0]
    quiet_s, flooded_s = summary(quiet), summary(flooded)
    return {"quiet": quiet_s, "flooded": flooded_s,
            "added_median_s": round(flooded_s["median_s"] - quiet_s["median_s"], 3),
            "added_p95_s": round(flooded_s["p95_s"] - quiet_s["p95_s"], 3),
            "text_call_bound_s": BY_NAME["max_text_delay"].default,
            "flood_s": round(flood_s, 1), "a_texts_sent": sent, "a_texts_per_s": round(sent / flood_s, 1),
            "a_texts_ingested": stats.texts_ingested, "a_texts_waiting": stats.texts_waiting,
            "a_inputs_rejected": stats.inputs_rejected, "exit_code": code,
            "quiet_times": [round(x, 3) for x in quiet], "flooded_times": [round(x, 3) for x in flooded]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="the node's torch_threads (0: its default)")
    p.add_argument("--label", default="current")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="inf_mllm_robots_flood_") as folder:
        result = run(args, Path(folder))
    record = {"model": args.model, "cache": args.cache, "answer_tokens": args.answer_tokens, "threads": args.threads,
              "label": args.label, "machine": machine(), **result}
    records = [r for r in load_records(OUT) if r.get("label") != args.label] + [record]
    write_records(OUT, records)
    print(f"[robots_flood] b's question quiet {result['quiet']['median_s']} s median ({result['quiet']['p95_s']} p95), "
          f"flooded {result['flooded']['median_s']} s ({result['flooded']['p95_s']}); a took "
          f"{result['a_texts_ingested']} of {result['a_texts_sent']} texts", flush=True)


if __name__ == "__main__":
    main()
