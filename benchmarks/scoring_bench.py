#!/usr/bin/env python3
"""Micro-benchmark of retrieval-window scoring: blocked PyTorch vs Triton.

Shape of one Qwen2-VL-2B layer: 12 query heads, 2 kv heads, head_dim 128, 4096 cached keys,
and a window of 784 queries (one prefill chunk of image tokens) or 64 (a text prompt).
On CUDA both backends run; elsewhere only the PyTorch path. Prints a table and writes
benchmarks/results/scoring_bench.json, a list of flat records.

    python benchmarks/scoring_bench.py            # full shapes
    python benchmarks/scoring_bench.py --small    # a few seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS
from inf_mllm_ros.engine.ops import triton_scoring
from inf_mllm_ros.engine.ops.scoring import window_scores

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small shapes, a few seconds on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=64, help="PyTorch path query block")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "scoring_bench.json")
    return parser.parse_args(argv)


def shapes(small: bool) -> list[tuple[int, int]]:
    """(n_past, q) pairs."""
    if small:
        return [(512, 64), (512, 16), (512, 1)]
    return [(4096, 784), (4096, 64), (4096, 1)]


def backends(device: torch.device) -> list[str]:
    # Triton on CPU only runs in the (very slow) interpreter: not worth timing.
    if device.type == "cuda" and triton_scoring.available():
        return ["torch", "triton"]
    return ["torch"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn in milliseconds, after one warm-up call (compilation, caches)."""
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_mib(fn, device: torch.device) -> float | None:
    """Peak extra CUDA memory of one call, to show the attention matrix is never built whole."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def bench_shape(n_past, q, device, dtype, block_size, repeats) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    query = torch.randn(NUM_HEADS, q, HEAD_DIM, generator=gen).to(device, dtype)
    key = torch.randn(NUM_KV_HEADS, n_past + q, HEAD_DIM, generator=gen).to(device, dtype)
    scaling = HEAD_DIM**-0.5
    reference = None
    records = []
    for backend in backends(device):
        def run(backend=backend):
            return window_scores(query, key, n_past, scaling, backend=backend, block_size=block_size)

        result = run()
        if reference is None:
            reference = result
        records.append(
            {
                "backend": backend,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype).replace("torch.", ""),
                "num_heads": NUM_HEADS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "n_past": n_past,
                "q": q,
                "threads": torch.get_num_threads() if device.type == "cpu" else None,
                "ms": round(time_ms(run, device, repeats), 4),
                "peak_mib": peak_mib(run, device),
                "max_abs_diff_vs_torch": (result - reference).abs().max().item(),
            }
        )
    return records


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--small", "--device", "cpu", "--dtype", "float32", "--repeats", "1"]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    repeats = args.repeats or (3 if args.small or device.type == "cpu" else 20)
    if args.threads:
        # On a busy CPU extra threads mostly wait on each other: pin the count to compare runs.
        torch.set_num_threads(args.threads)
    records = []
    for n_past, q in shapes(args.small):
        records += bench_shape(n_past, q, device, dtype, args.block_size, repeats)
    print(f"{'backend':8} {'device':24} {'n_past':>7} {'q':>5} {'ms':>10} {'peak MiB':>9} {'diff':>9}")
    for r in records:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        print(
            f"{r['backend']:8} {r['device'][:24]:24} {r['n_past']:7d} {r['q']:5d} "
            f"{r['ms']:10.3f} {peak:>9} {r['max_abs_diff_vs_torch']:9.2e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
