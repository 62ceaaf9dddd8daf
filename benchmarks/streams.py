"""Several streams on one model (engine/runtime/pool.py) against the same streams one after the other.

Each stream is a robot of its own: its own texts (a patrol's reports, its facts its own), a camera frame every round
and a question at the end of each round, each with `--answer-tokens` as its max_new_tokens. For each count of streams
(`--streams`, 1 2 4 8):

- pooled: one process loads the model once and holds every stream in a `StreamPool`; each round every stream's texts
  are given at once, then every stream's frame (`StreamPool.push_texts_together`, `push_frames_together`: blocks that
  fit one pass go in as one batch), then every stream's question is asked at once
  (`StreamPool.ask_together`: the questions go in one by one, the answers decode as one batch);
- one after the other: each of the same streams alone in a process of its own (a pool of one: the same code path,
  the batch of one), the processes run in turn; the figures of the first n of them add up to n streams' baseline.

- engines (`--engines`): the streams as the node holds several robots' memories (`streams`), a `StreamingEngine` each
  on one `SharedModel`, fed from one thread, every stream's question asked right after another's: their answers
  go through the model together on the bench (engine/runtime/model_bench.py) where they wait at once; latency is each question's
  own.

Throughput all streams together: input tokens a second (the time spent taking texts and frames in), answer tokens a
second (the whole answer: question in, retrieval, decoding) and decoded tokens a second (the batched decoding alone);
question latency (median, 95th percentile; pooled: the batch's call, which every question of the round waits for);
the process's peak resident memory and each stream's cache and archive bytes. Rates come with a 95 % interval by
resampling rounds (a percentile bootstrap). Records in results/streams.json, one per (mode, streams), and one of the
time of one of the model's linear layers by the rows it takes at once (`--linear-only`: that alone), which sets what
a batch can gain on this machine's BLAS; with `--linear-memory`, also the memory a packed linear holds after many
counts of rows.

    python benchmarks/streams.py                         # the default model, cache 512, 1 2 4 8 streams
    python benchmarks/streams.py --streams 1 4 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import load_records, machine, peak_rss_bytes, write_records

OUT = "streams.json"
MODEL = "onevision-qwen2.5-0.5b"
PLACES = ["dock 3", "aisle 7", "the charging bay", "the north door", "shelf B2", "the loading ramp", "bay 12",
          "the cold store"]
THINGS = ["a red pallet", "a blue crate", "a forklift", "a spill of oil", "a stack of boxes", "a broken cone",
          "a trolley", "a yellow barrel"]
SMOKE = ["--model", "smolvlm-smollm2", "--engines", "--streams", "2", "--rounds", "1", "--texts", "2",
         "--answer-tokens", "4", "--cache", "256", "--label", "smoke"]


def texts(stream: int, round_: int, n: int) -> list[str]:
    """The reports of one robot in one round: its own facts, seeded by the robot and the round."""
    rng = random.Random(stream * 1000 + round_)
    return [f"Robot {stream} reports {rng.choice(THINGS)} at {rng.choice(PLACES)}, "
            f"seen {rng.randint(2, 59)} minutes into its patrol." for _ in range(n)]


def question(stream: int, round_: int) -> str:
    rng = random.Random(stream * 1000 + round_ + 500)
    return f"Robot {stream}, what did you see at {rng.choice(PLACES)}?"


def frame(stream: int, round_: int):
    import numpy as np

    return np.random.default_rng(stream * 1000 + round_).integers(0, 256, (96, 128, 3), dtype=np.uint8)


def interval(rounds: list[tuple[float, float]], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95 % interval of sum(amount) / sum(seconds) over rounds, resampling rounds (percentile bootstrap)."""
    rng = random.Random(seed)
    rates = []
    for _ in range(resamples):
        drawn = [rounds[rng.randrange(len(rounds))] for _ in rounds]
        seconds = sum(s for _, s in drawn)
        rates.append(sum(a for a, _ in drawn) / seconds if seconds else 0.0)
    rates.sort()
    return rates[int(0.025 * resamples)], rates[int(0.975 * resamples) - 1]


def rate(rounds: list[tuple[float, float]]) -> dict:
    seconds = sum(s for _, s in rounds)
    value = sum(a for a, _ in rounds) / seconds if seconds else 0.0
    low, high = interval(rounds) if len(rounds) > 1 else (value, value)
    return {"per_s": round(value, 2), "ci95": [round(low, 2), round(high, 2)], "seconds": round(seconds, 2)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def rss_bytes() -> int:
    """Resident memory of this process now (the peak is the model's loading, whatever the streams hold)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def trimmed_rss_bytes() -> int | None:
    """Resident memory once the C heap has handed its free pages back (glibc's malloc_trim): what the process holds,
    apart from memory freed (a batch's copies, say) but kept by the allocator. None where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_bytes()


def run_streams(args, ids: list[int]) -> dict:
    """The streams `ids` in one pool in this process, round by round; its figures."""
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.pool import Question, StreamPool
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # other work on the machine shows in every figure
    start = time.monotonic()
    adapter = load_model(args.model, device="cpu", dtype="float32")
    load_s = time.monotonic() - start
    gc.collect()
    rss_model = rss_bytes()
    pool = StreamPool(adapter, [str(i) for i in ids], StreamConfig(capacity=args.cache))
    for name in pool:  # what the first answer would build on first use, as the node does while loading
        pool[name].prepare_first_answer()
    ingest, answers, decoded, latencies, answer_tokens = [], [], [], [], 0
    for r in range(args.rounds):
        tokens, start = 0, time.monotonic()
        pushed = pool.push_texts_together({str(i): [(t, 60.0 * r + k) for k, t in enumerate(texts(i, r, args.texts))]
                                           for i in ids})
        if adapter.supports_frames:
            pushed.update({f"{name} frame": n for name, n in pool.push_frames_together(
                {str(i): (frame(i, r), 60.0 * r + args.texts) for i in ids}).items()})
        for n in pushed.values():
            if isinstance(n, BaseException):
                raise n
            tokens += sum(n) if isinstance(n, list) else n
        ingest.append((tokens, time.monotonic() - start))
        decode_s, steps = pool.decode_seconds, pool.decoder.steps
        start = time.monotonic()
        out = pool.ask_together({str(i): Question(question(i, r), max_new_tokens=args.answer_tokens) for i in ids})
        seconds = time.monotonic() - start
        for name, answer in out.items():
            if isinstance(answer, BaseException):
                raise answer
        n = sum(a.tokens_generated for a in out.values())
        answer_tokens += n
        answers.append((n, seconds))
        decoded.append((n, pool.decode_seconds - decode_s))
        latencies += [seconds] * len(ids)
        print(f"[streams] {len(ids)} stream(s) {ids[0]}..: round {r}: {tokens} tokens in {ingest[-1][1]:.1f} s, "
              f"{n} answer tokens in {seconds:.1f} s ({pool.decoder.steps - steps} steps)", file=sys.stderr, flush=True)
    stats = [pool[str(i)].stats() for i in ids]
    gc.collect()
    rss_end = rss_bytes()  # the model and every stream's memory, after the last round
    rss_trimmed = trimmed_rss_bytes()
    return {
        "streams": len(ids), "ids": ids, "load_s": round(load_s, 1),
        "input_tokens": sum(a for a, _ in ingest), "answer_tokens": answer_tokens,
        "ingest": rate(ingest), "answers": rate(answers), "decoding": rate(decoded),
        # Blocks of several streams taken in one pass, and the passes.
        "ingest_batches": {"passes": pool.ingester.batches, "blocks": pool.ingester.blocks},
        "latency_s": {"median": round(statistics.median(latencies), 2), "p95": round(percentile(latencies, 0.95), 2)},
        "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1), "rss_after_model_mb": round(rss_model / 2**20, 1),
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_trimmed_mb": None if rss_trimmed is None else round(rss_trimmed / 2**20, 1),
        "memory_per_stream_mb": round(statistics.mean((s.cache_bytes + s.archive_bytes) for s in stats) / 2**20, 2),
        # What each stream holds now: its cache, and of its archive (allocated, touched as it fills) the tokens held.
        "held_per_stream_mb": round(statistics.mean(
            s.cache_bytes + s.archive_bytes * s.archive_tokens / max(s.archive_size, 1) for s in stats) / 2**20, 2),
        "evictions": sum(s.evictions for s in stats),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rounds": {"ingest": ingest, "answers": answers, "decoded": decoded}, "latencies": latencies,
    }


def run_engines(args, ids: list[int]) -> dict:
    """The streams `ids` as the node holds several robots' memories: a `StreamingEngine` each on one `SharedModel`,
    fed from this thread, each round's questions asked one right after another (their answers decode together on
    the bench: engine/runtime/model_bench.py); its figures. Latency: each question's own, from its submission."""
    from inf_mllm_ros.engine.runtime.shared_model import SharedModel
    from inf_mllm_ros.engine.stream_config import StreamConfig

    load_before = os.getloadavg()[0]
    shared = SharedModel()
    start = time.monotonic()
    engines = {i: shared.engine(args.model, StreamConfig(capacity=args.cache), device="cpu", dtype="float32",
                                torch_threads=args.threads, max_pending_texts=1000) for i in ids}
    for engine in engines.values():  # loaded once; each worker prepares its first answer while loading
        engine.wait_ready(1800)
    load_s = time.monotonic() - start
    supports_frames = next(iter(engines.values())).adapter.supports_frames
    ingest, answers, latencies, answer_tokens = [], [], [], 0
    try:
        for r in range(args.rounds):
            start = time.monotonic()
            pending = []
            for i, engine in engines.items():
                pending += [engine.submit_text(t, 60.0 * r + k) for k, t in enumerate(texts(i, r, args.texts))]
                if supports_frames:
                    pending.append(engine.submit_frame(frame(i, r), 60.0 * r + args.texts))
            tokens = sum(f.result(timeout=3600) for f in pending)
            ingest.append((tokens, time.monotonic() - start))
            batches = shared.bench.batches
            start = time.monotonic()
            done: dict[int, float] = {}
            futures = {}
            for i, engine in engines.items():
                futures[i] = engine.submit_ask(question(i, r), max_new_tokens=args.answer_tokens)
                futures[i].add_done_callback(lambda _f, i=i: done.setdefault(i, time.monotonic()))
            out = {i: f.result(timeout=3600) for i, f in futures.items()}
            seconds = time.monotonic() - start
            n = sum(a.tokens_generated for a in out.values())
            answer_tokens += n
            answers.append((n, seconds))
            latencies += [done[i] - start for i in ids]
            print(f"[streams] engines {len(ids)}: round {r}: {tokens} tokens in {ingest[-1][1]:.1f} s, {n} answer "
                  f"tokens in {seconds:.1f} s ({shared.bench.batches - batches} batch(es))", file=sys.stderr,
                  flush=True)
        stats = [engine.stats() for engine in engines.values()]
    finally:
        for engine in engines.values():
            engine.close(timeout=60)
    gc.collect()
    return {
        "streams": len(ids), "ids": ids, "load_s": round(load_s, 1), "loads": shared.loads,
        "input_tokens": sum(a for a, _ in ingest), "answer_tokens": answer_tokens,
        "ingest": rate(ingest), "answers": rate(answers), "batches": shared.bench.batches,
        # How the bench's work went through the model: jobs taken off it at once, answers decoded together, passes of
        # several memories' forwards.
        "bench": {"jobs_together": dict(shared.bench.work_sizes), "answers_together": dict(shared.bench.batch_sizes),
                  "forward_batches": shared.bench.forward_batches},
        "latency_s": {"median": round(statistics.median(latencies), 2), "p95": round(percentile(latencies, 0.95), 2)},
        "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1), "rss_end_mb": round(rss_bytes() / 2**20, 1),
        "evictions": sum(s.evictions for s in stats),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rounds": {"ingest": ingest, "answers": answers}, "latencies": latencies,
    }


def child(args, ids: list[int], through: str = "pool") -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--child", *map(str, ids), "--through", through, "--model", args.model,
           "--cache",
           str(args.cache), "--rounds", str(args.rounds), "--texts", str(args.texts), "--answer-tokens",
           str(args.answer_tokens), "--threads", str(args.threads)]
    printed = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(printed.strip().splitlines()[-1])


def one_after_the_other(alone: list[dict], n: int) -> dict:
    """The first n single-stream runs, one after the other: their times add up, rounds matched by index."""
    runs = alone[:n]
    def summed(key: str) -> list[tuple[float, float]]:
        return [(sum(r["rounds"][key][k][0] for r in runs), sum(r["rounds"][key][k][1] for r in runs))
                for k in range(len(runs[0]["rounds"][key]))]
    latencies = [x for r in runs for x in r["latencies"]]
    return {"streams": n, "ids": [r["ids"][0] for r in runs],
            "input_tokens": sum(r["input_tokens"] for r in runs), "answer_tokens": sum(r["answer_tokens"] for r in runs),
            "ingest": rate(summed("ingest")), "answers": rate(summed("answers")), "decoding": rate(summed("decoded")),
            "latency_s": {"median": round(statistics.median(latencies), 2),
                          "p95": round(percentile(latencies, 0.95), 2)},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def linear_rows(threads: int, rows=(1, 2, 4, 8), repeats: int = 40) -> dict:
    """ms of one of the 0.5B model's MLP projections ([rows, 896] by [4864, 896]) for a few rows, as the engine
    prepares it (engine/ops/few_rows.py) and as torch's own linear: what a decode step of that many streams pays per
    layer and projection on this machine (median of `repeats` calls each)."""
    import torch

    from inf_mllm_ros.engine.ops.few_rows import prepare_linears

    torch.set_num_threads(threads)
    plain = torch.nn.Linear(896, 4864, bias=False).requires_grad_(False)
    prepared = torch.nn.Linear(896, 4864, bias=False).requires_grad_(False)
    prepared.weight.copy_(plain.weight)
    prepare_linears(prepared)
    out = {}
    for name, module in (("prepared", prepared), ("torch", plain)):
        for n in rows:
            x = torch.randn(n, 896)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                module(x)
                times.append(time.perf_counter() - start)
            out[str(n) if name == "prepared" else f"torch_{n}"] = round(statistics.median(times[3:]) * 1e3, 2)
    return out


def linear_rows_memory(way: str, threads: int, calls: int = 1000, most_rows: int = 1200) -> float:
    """Resident memory (MB, trimmed) a packed projection ([rows, 896] by [128, 896]) leaves held after `calls` calls
    of counts of rows from 1 to `most_rows` drawn at random: `way` "onednn", through oneDNN as it is, or "prepared",
    as the engine prepares it (engine/ops/few_rows.py: more than ROW_BUCKET rows padded). oneDNN keeps state for
    every count of rows it has seen; the padding bounds how many. Each way in a process of its own (`--memory-way`)."""
    import random

    import torch

    from inf_mllm_ros.engine.ops.few_rows import onednn_linear, prepare_linears

    torch.set_num_threads(threads)
    module = torch.nn.Linear(896, 128).requires_grad_(False)
    prepare_linears(module)
    call = module if way == "prepared" else (lambda x: onednn_linear(x, module.weight, module.bias))
    rng = random.Random(0)
    before = trimmed_rss_bytes() or rss_bytes()
    for _ in range(calls):
        call(torch.randn(rng.randint(1, most_rows), 896))
    return round(((trimmed_rss_bytes() or rss_bytes()) - before) / 2**20, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--texts", type=int, default=4, help="texts per stream per round")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=OUT)
    p.add_argument("--child", type=int, nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--through", choices=["pool", "engines"], default="pool", help=argparse.SUPPRESS)
    p.add_argument("--engines", action="store_true",
                   help="also the streams as the node's memories: an engine each on one shared model")
    p.add_argument("--linear-only", action="store_true", help="only the linear's time by rows, added to --out")
    p.add_argument("--linear-memory", action="store_true",
                   help="with it, the memory a packed linear holds after many counts of rows")
    p.add_argument("--memory-way", choices=["onednn", "prepared"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_way:
        print(json.dumps(linear_rows_memory(args.memory_way, args.threads)))
        return
    if args.child:
        result = (run_engines if args.through == "engines" else run_streams)(args, args.child)
        print(json.dumps(result))
        return
    settings = {"model": args.model, "cache": args.cache, "rounds": args.rounds, "texts": args.texts,
                "answer_tokens": args.answer_tokens, "threads": args.threads, "machine": machine(),
                "label": args.label}
    linear = {**settings, "mode": "linear_rows_ms", "rows": linear_rows(args.threads),
              "load_average": round(os.getloadavg()[0], 2)}
    if args.linear_memory:
        linear["memory_added_mb"] = {
            way: json.loads(subprocess.run([sys.executable, str(Path(__file__)), "--memory-way", way, "--threads",
                                            str(args.threads)], check=True, stdout=subprocess.PIPE,
                                           text=True).stdout.strip().splitlines()[-1])
            for way in ("onednn", "prepared")}
    if args.linear_only:
        write_records(args.out, load_records(args.out) + [linear])
        return
    records = [r for r in load_records(args.out) if r.get("label") != args.label] + [linear]
    alone: list[dict] = []
    for i in range(max(args.streams)):  # each stream alone, in a process of its own, one after the other
        alone.append(child(args, [i]))
    for n in args.streams:
        records.append({**settings, "mode": "one_after_the_other", **one_after_the_other(alone, n)})
        write_records(args.out, records)
    for n in args.streams:
        pooled = child(args, list(range(n)))
        pooled.pop("rounds"), pooled.pop("latencies")
        records.append({**settings, "mode": "pooled", **pooled})
        write_records(args.out, records)
        print(f"[streams] {n}: pooled {pooled['answers']['per_s']} answer tok/s, "
              f"{pooled['decoding']['per_s']} decoded tok/s, {pooled['ingest']['per_s']} input tok/s, "
              f"{pooled['peak_rss_mb']} MB", flush=True)
    for n in args.streams if args.engines else []:
        engines = child(args, list(range(n)), "engines")
        engines.pop("rounds"), engines.pop("latencies")
        records.append({**settings, "mode": "engines", **engines})
        write_records(args.out, records)
        print(f"[streams] {n}: engines {engines['answers']['per_s']} answer tok/s, {engines['batches']} batches, "
              f"{engines['ingest']['per_s']} input tok/s, {engines['peak_rss_mb']} MB", flush=True)


if __name__ == "__main__":
    main()
