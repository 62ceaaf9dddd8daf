"""Tensor operations that each policy runs after the layers have attended: a count of GPU kernels.

    python benchmarks/eviction_ops.py [--cache 512] [--out eviction_ops.json]

On a GPU a small model's chunk time is mostly the host launching kernels, one per tensor operation, so
the count of operations the cache runs per layer (scoring bookkeeping, eviction, re-packing positions)
says what a policy costs there, and it can be counted on any machine. Counted here on the CPU, with the
operations that only make a view (slices, reshapes) left out. On a GPU the scoring itself adds a Triton
kernel or a few matmuls per layer for inf_mllm and h2o (on the CPU it shares the attention's softmax and
is not counted). One 64-token chunk of text through SmolLM2-135M once the cache is full, the shipped
settings. `ops_per_chunk` is everything the cache runs after attention in the chunk, every layer
together; `ops_per_layer` the same per layer (since layers of one shape are evicted and re-packed in one
pass, a fixed count per chunk spread over them). Results: benchmarks/results/eviction_ops.json.
"""

from __future__ import annotations

import argparse
from collections import Counter

from common import load_records, machine, read_text, write_records

PHASES = {"observe": "observe", "evict": "evict", "pack_positions": "pack"}


def count_ops(stream, chunk) -> dict[str, Counter]:
    """Operations run in each phase of every layer while `chunk` is pushed, by aten name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from inf_mllm_ros.engine.memory.cache import BoundedKVCache, BoundedLayer

    counts = {phase: Counter() for phase in PHASES.values()}
    total = counts["all"] = Counter()

    class Counting(TorchDispatchMode):
        def __init__(self, into: Counter):
            super().__init__()
            self.into = into

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.into[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(BoundedLayer, name) for name in PHASES}

    def counted(name):
        def method(self, *args, **kwargs):
            with Counting(counts[PHASES[name]]):
                return originals[name](self, *args, **kwargs)
        return method

    after_attention = BoundedKVCache.after_attention

    def counted_after_attention(self, *args, **kwargs):
        with Counting(total):
            return after_attention(self, *args, **kwargs)

    try:
        for name in PHASES:
            setattr(BoundedLayer, name, counted(name))
        BoundedKVCache.after_attention = counted_after_attention
        stream.push_tokens(chunk)
    finally:
        for name, original in originals.items():
            setattr(BoundedLayer, name, original)
        BoundedKVCache.after_attention = after_attention
    return counts


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--cache", "128"]


def main(argv: list[str] | None = None) -> None:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.memory.policies import POLICIES
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--text", default=None)
    p.add_argument("--out", default="eviction_ops.json")
    p.add_argument("--one-layer-at-a-time", action="store_true",
                   help="evict and re-pack layer by layer (the cache's stack_layers=False), for comparison")
    p.add_argument("--label", default="current", help="names the code measured (records of other labels are kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    adapter = load_model(args.model, device="cpu", dtype="float32")
    ids = adapter.tokenize(read_text(args.text))
    records = []
    for policy in sorted(name for name, cls in POLICIES.items() if cls.evicts):
        stream = KVStream(adapter, StreamConfig(capacity=args.cache, policy=policy, chunk_size=64, headroom=64,
                                                system_prompt=""))
        stream.cache.stack_layers = not args.one_layer_at_a_time  # before the first token allocates storage
        stream.push_tokens(ids[: 2 * args.cache])  # the cache is full and has evicted
        counts = count_ops(stream, ids[2 * args.cache : 2 * args.cache + 64])
        layers = adapter.num_layers
        total = counts.pop("all")
        per_layer = {phase: sum(c.values()) / layers for phase, c in counts.items()}
        records.append({"policy": policy, "cache_size": args.cache, "chunk_size": 64, "model": args.model,
                        "ops_per_chunk": sum(total.values()),
                        **{f"ops_per_layer_{phase}": round(n, 2) for phase, n in per_layer.items()},
                        "ops_per_layer": round(sum(total.values()) / layers, 2),
                        **{f"{phase}.{name}": round(n / layers, 2) for phase, c in counts.items()
                           for name, n in c.most_common()},
                        "code": args.label, "device": machine()})
        print(f"{policy:14s} {sum(total.values()):6d} ops per chunk ({sum(total.values()) / layers:.1f} per layer) "
              + " ".join(f"{phase} {n:.1f}" for phase, n in per_layer.items()), flush=True)
    kept = [r for r in load_records(args.out) if r.get("code") != args.label]
    write_records(args.out, kept + records)


if __name__ == "__main__":
    main()
