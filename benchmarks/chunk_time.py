"""Time per 64-token chunk for each policy, once the cache is full.

    python benchmarks/chunk_time.py [--cache 512] [--rounds 3]
    python benchmarks/chunk_time.py --device cuda --dtype bfloat16 --out chunk_time_gpu.json

Policies are measured in turns (round robin, same text). On a CPU they are timed in process CPU seconds,
so the ratios hold on a machine shared with other work; on a GPU in wall seconds up to the end of the
chunk's GPU work. Results: benchmarks/results/chunk_time.json (or --out).
"""

from __future__ import annotations

import argparse
import time

from common import machine, read_text, synchronize, write_records

# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--cache", "128", "--chunks", "2", "--rounds", "1"]


def main(argv: list[str] | None = None) -> None:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.memory.policies import POLICIES
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16, help="timed chunks per policy and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--text", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="chunk_time.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    on_gpu = adapter.device.type == "cuda"
    clock = "wall" if on_gpu else "cpu"

    def now() -> float:
        if on_gpu:
            synchronize()
            return time.perf_counter()
        return time.process_time()

    ids = adapter.tokenize(read_text(args.text))
    streams = {}
    bounded = sorted(name for name, cls in POLICIES.items() if cls.evicts)
    for policy in bounded:
        streams[policy] = KVStream(adapter, StreamConfig(capacity=args.cache, policy=policy, chunk_size=64,
                                                         headroom=64, system_prompt=""))
        streams[policy].push_tokens(ids[: 2 * args.cache])  # fill the cache first
    times = {policy: [] for policy in bounded}
    pos = 2 * args.cache
    for _ in range(args.rounds):
        for policy in bounded:
            for i in range(args.chunks):
                chunk = ids[pos + 64 * i : pos + 64 * (i + 1)]
                c0 = now()
                streams[policy].push_tokens(chunk)
                times[policy].append(now() - c0)
        pos += 64 * args.chunks
    base = sorted(times["streaming_llm"])[len(times["streaming_llm"]) // 2]
    records = []
    for policy, taken in times.items():
        median = sorted(taken)[len(taken) // 2]
        records.append({"policy": policy, "cache_size": args.cache, "chunk_size": 64, "chunks": len(taken),
                        f"{clock}_ms_per_chunk_median": round(1000 * median, 2),
                        f"{clock}_ms_per_chunk_mean": round(1000 * sum(taken) / len(taken), 2),
                        "relative_to_streaming_llm": round(median / base, 3),
                        "dtype": args.dtype, "device": machine()})
        print(f"{policy:14s} {1000 * median:8.1f} ms/chunk ({clock}, median)  x{median / base:.2f}", flush=True)
    write_records(args.out, records)


if __name__ == "__main__":
    main()
