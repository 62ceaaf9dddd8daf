"""How long should the score remember? Inf-MLLM's `memory_decay` on prose and on recall.

    python benchmarks/experiments/memory_decay_sweep.py [--decays 0.8 0.9 0.95 0.97 0.99] [--seeds 0 1] [--resume]

The score memory keeps `memory_decay` of a token's remembered attention at each eviction: at 0.9 a
token's attention is remembered for about ten blocks, at 0.97 for about thirty. A longer memory should
hold a fact whose subject comes up now and then for longer, and lets older tokens hold the cache. Per
decay, cache 512, float32, Inf-MLLM otherwise as shipped:
- perplexity over 16K tokens of the novel on SmolLM2-135M (as `long_text.py --bias-sweep`), with the mean
  age of the kept candidates at the end;
- recall on the twenty-facts stream, subjects mentioned (as `recall.py --settings mentioned`), on the
  0.5B evaluation model, per seed.
Results: benchmarks/results/memory_decay_sweep.json (flat records, `benchmark` perplexity or recall),
written after each run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: recall.py, common.py

from common import load_records, write_records  # noqa: E402
from tracing import MENTIONED_CACHE as CACHE  # noqa: E402

OUT = "memory_decay_sweep.json"


def perplexity(decay: float, threads: int) -> dict:
    import torch

    import long_text

    torch.set_num_threads(threads)
    run = SimpleNamespace(model="smollm2", device="cpu", dtype="float32", text=None, tokens=16384, chunk=64,
                          bin=4096, cache=CACHE, policy="inf_mllm", bias=None, recent=None, position_mode="cache",
                          partial=None, policy_settings={"memory_decay": decay})
    bins = long_text.run_one(run)
    ppl = [r["ppl"] for r in bins]
    return {"benchmark": "perplexity", "policy": "inf_mllm", "cache_size": CACHE, "memory_decay": decay,
            "model": "smollm2", "tokens": bins[-1]["tokens"], "ppl_bins": ppl, "ppl_mean": round(sum(ppl) / len(ppl), 3),
            "mean_age_of_cached_non_recent": bins[-1]["mean_age_of_cached_non_recent"], "dtype": "float32"}


def recall(decay: float, seed: int, threads: int) -> dict:
    from recall import DISTANCES
    from tracing import mentioned_run

    found = mentioned_run("inf_mllm", seed, {"memory_decay": decay}, threads=threads)
    per = {d: [r for r in found if r["distance"] == d] for d in DISTANCES}
    return {"benchmark": "recall", "policy": "inf_mllm", "cache_size": CACHE, "memory_decay": decay,
            "setting": "mentioned", "seed": seed, "model": "qwen2.5-0.5b", "dtype": "float32",
            "recalled": {str(d): sum(r["recalled"] for r in rs) for d, rs in per.items()},
            "asked": {str(d): len(rs) for d, rs in per.items()},
            "value_kept_in_layer_heads": {str(d): round(sum(r["value_kept_in_layer_heads"] for r in rs) / len(rs), 4)
                                          for d, rs in per.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decays", type=float, nargs="+", default=[0.8, 0.9, 0.95, 0.97, 0.99])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="keep the records already in the results file")
    args = p.parse_args()
    records = load_records(OUT) if args.resume else []
    done = {(r["benchmark"], r["memory_decay"], r.get("seed")) for r in records}
    for decay in args.decays:
        runs = [("perplexity", None)] + [("recall", seed) for seed in args.seeds]
        for benchmark, seed in runs:
            if (benchmark, decay, seed) in done:
                continue
            record = perplexity(decay, args.threads) if seed is None else recall(decay, seed, args.threads)
            records.append(record)
            write_records(OUT, records)
            print({k: v for k, v in record.items() if k not in ("model", "dtype", "policy")}, flush=True)


if __name__ == "__main__":
    main()
