"""Perplexity over a long text, per 4K-token bin, for every eviction policy and cache size.

    python benchmarks/long_text.py                 # all policies, caches 256/512/1024, 64K tokens
    python benchmarks/long_text.py --bias-sweep    # inf_mllm at several attention biases
    python benchmarks/long_text.py --plot-only

The text (a Project Gutenberg novel by default, header and footer removed) is pushed in chunks of 64
tokens with eviction after each, exactly as a robot's stream would be; each token's loss comes from the
logits the model gave before seeing it. Each run is its own process so its peak memory is its own.
Results: benchmarks/results/long_text_ppl.json (bias_sweep.json for --bias-sweep), flat records, one per bin.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import (load_records, machine, peak_gpu_bytes, peak_rss_bytes, policy_names, read_text, synchronize,
                    write_records)

BIASES = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 16.0, 64.0]


def cached_age_stats(stream, chunk: int) -> tuple[float, float, float]:
    """Of the cached tokens outside the sinks and the recent window: their mean age (tokens), their share
    from the stream's first half (how far the cache has moved forward), and their share from the second
    half of their chunk (0.5 when the score is fair to every offset)."""
    import torch

    sinks, recent = stream.policy.protected(stream.cache.capacity)
    if stream.policy.name == "streaming_llm":
        sinks, recent = 0, 0  # it keeps no old tokens: its figures are the whole cache's
    ages, early, late = [], [], []
    seen = stream.tokens_seen
    for layer_idx in range(len(stream.cache.layers)):
        seq = stream.cache.cached_seq(layer_idx)
        old = seq[:, sinks : max(seq.shape[1] - recent, sinks)]
        if old.numel():
            ages.append((seen - old).float().mean())
            early.append((old < seen / 2).float().mean())
            late.append(((old % chunk) >= chunk // 2).float().mean())
    if not ages:
        return 0.0, 0.0, 0.0
    return tuple(float(torch.stack(x).mean()) for x in (ages, early, late))


def run_one(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.manual_seed(0)
    adapter = load_model(args.model, device=args.device, dtype=args.dtype)
    ids = adapter.tokenize(read_text(args.text))
    n_tokens = args.tokens
    capacity = args.cache
    if args.policy == "full":
        # The full cache is bounded by the model's context: measure inside it only.
        n_tokens = min(n_tokens, adapter.max_context - args.chunk)
        capacity = n_tokens
    ids = ids[:n_tokens]
    from inf_mllm_ros.engine.memory.policies import POLICIES

    knobs = {**getattr(args, "policy_settings", {}),
             **{k: v for k, v in (("attention_bias", args.bias), ("recent_size", args.recent))
                if v is not None and k in POLICIES[args.policy].knobs()}}
    config = StreamConfig(
        capacity=capacity, policy=args.policy, chunk_size=args.chunk, headroom=args.chunk, system_prompt="",
        position_mode=args.position_mode, policy_settings=knobs,
    )
    stream = KVStream(adapter, config)
    bin_nll, records = [], []
    prev_logit = None
    start = time.perf_counter()
    compute_s = cpu_s = 0.0  # wall and CPU seconds in the model (CPU time is robust on a shared machine)
    kv_first = None
    for pos in range(0, len(ids), args.chunk):
        chunk = ids[pos : pos + args.chunk]
        t0, c0 = time.perf_counter(), time.process_time()
        logits = stream.push_tokens(chunk, return_logits=True)
        synchronize()
        compute_s += time.perf_counter() - t0
        cpu_s += time.process_time() - c0
        kv_first = kv_first or stream.cache.kv_nbytes()
        preds = logits[:-1] if prev_logit is None else torch.cat([prev_logit, logits[:-1]])
        targets = (chunk[1:] if prev_logit is None else chunk).to(preds.device)
        bin_nll.append(F.cross_entropy(preds, targets, reduction="none"))
        prev_logit = logits[-1:]
        done = pos + len(chunk)
        if done % args.bin == 0 or done == len(ids):
            nll = torch.cat(bin_nll)
            age, early, late = cached_age_stats(stream, args.chunk)
            records.append({
                "policy": args.policy,
                "cache_size": capacity if args.policy != "full" else "all",
                "position_mode": args.position_mode,
                "attention_bias": stream.policy.attention_bias if args.policy == "inf_mllm" else None,
                "bin": len(records),
                "bin_first_token": done - len(nll),
                "bin_last_token": done,
                "ppl": round(float(nll.mean().exp()), 3),
                "cache_fill": stream.cache.fill,
                "mean_age_of_cached_non_recent": round(age, 1),
                "share_of_cached_non_recent_from_first_half": round(early, 4),
                "share_of_cached_non_recent_from_second_half_of_chunk": round(late, 4),
                "kv_bytes": stream.cache.kv_nbytes(),
                # Run figures so far: a run cut short still leaves complete records.
                "chunk_size": args.chunk,
                "tokens": done,
                "ms_per_token": round(1000 * compute_s / done, 3),
                "ms_per_chunk": round(1000 * compute_s * args.chunk / done, 2),
                "cpu_ms_per_chunk": round(1000 * cpu_s * args.chunk / done, 2),
                "kv_bytes_constant": stream.cache.kv_nbytes() == kv_first,
                "peak_rss_bytes": peak_rss_bytes(),
                "peak_gpu_bytes": peak_gpu_bytes(),
                "wall_seconds": round(time.perf_counter() - start, 1),
                "dtype": args.dtype,
                "device": machine(),
            })
            if args.partial:
                with open(args.partial, "a") as f:
                    f.write(json.dumps(records[-1]) + "\n")
            bin_nll = []
    return records


def spawn(args, policy: str, cache: int, bias: float | None, position_mode: str) -> list[dict]:
    cmd = [sys.executable, __file__, "--one", "--policy", policy, "--cache", str(cache),
           "--position-mode", position_mode, "--tokens", str(args.tokens), "--chunk", str(args.chunk),
           "--bin", str(args.bin), "--model", args.model, "--dtype", args.dtype, "--device", args.device]
    if args.text:
        cmd += ["--text", args.text]
    if args.recent is not None:
        cmd += ["--recent", str(args.recent)]
    if bias is not None:
        cmd += ["--bias", str(bias)]
    if args.partial:
        cmd += ["--partial", args.partial]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def sweep(args, out_name: str, runs: list[tuple[str, int, float | None, str]]) -> None:
    records = load_records(out_name) if args.resume else []
    done = {(r["policy"], str(r["cache_size"]), r.get("attention_bias"), r["position_mode"]) for r in records}
    for policy, cache, bias, mode in runs:
        key = (policy, "all" if policy == "full" else str(cache), bias if policy == "inf_mllm" else None, mode)
        if key in done:
            continue
        t = time.time()
        new = spawn(args, policy, cache, bias, mode)
        records += new
        write_records(out_name, records)  # after every run, so an interrupted sweep keeps what it measured
        ppl = [r["ppl"] for r in new]
        print(f"{policy:14s} cache={cache:5d} bias={bias} {mode:8s} ppl per bin {ppl} "
              f"({new[0]['ms_per_token']} ms/token, {time.time() - t:.0f} s)", flush=True)


def plot_bias_sweep(out_name: str = "bias_sweep.json", png: str = "bias_sweep.png") -> None:
    """Per cache size: perplexity per bin for each bias, and mean perplexity and cache age against the bias."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import RESULTS

    records = [r for r in load_records(out_name) if r["policy"] == "inf_mllm"]
    if not records:
        return
    caches = sorted({r["cache_size"] for r in records})
    fig, axes = plt.subplots(len(caches), 2, figsize=(11, 4 * len(caches)), squeeze=False)
    for row, cache in zip(axes, caches):
        rs = [r for r in records if r["cache_size"] == cache]
        biases = sorted({r["attention_bias"] for r in rs})
        for i, bias in enumerate(biases):
            run = sorted((r for r in rs if r["attention_bias"] == bias), key=lambda r: r["bin"])
            row[0].plot([r["bin_last_token"] / 1000 for r in run], [r["ppl"] for r in run], marker="o", ms=3,
                        color=plt.cm.viridis(i / max(1, len(biases) - 1)), label=f"bias {bias:g}")
        row[0].set_title(f"inf_mllm, cache {cache}: perplexity per 4K-token bin")
        row[0].set_xlabel("tokens streamed (thousands)")
        row[0].set_ylabel("perplexity")
        row[0].legend(fontsize=8)
        row[0].grid(alpha=0.3)
        xs = [max(b, 0.1) for b in biases]  # bias 0 drawn at 0.1 on the log axis
        mean_ppl = [sum(r["ppl"] for r in rs if r["attention_bias"] == b) / sum(1 for r in rs if r["attention_bias"] == b)
                    for b in biases]
        last_age = [max((r for r in rs if r["attention_bias"] == b), key=lambda r: r["bin"])["mean_age_of_cached_non_recent"]
                    for b in biases]
        row[1].plot(xs, mean_ppl, marker="o", color="C0", label="mean perplexity")
        row[1].set_xscale("log")
        row[1].set_xlabel("attention_bias (0 drawn at 0.1)")
        row[1].set_ylabel("mean perplexity", color="C0")
        age_axis = row[1].twinx()
        age_axis.plot(xs, last_age, marker="s", color="C3", label="mean age of kept candidates at the end")
        age_axis.set_yscale("log")
        age_axis.set_ylabel("mean age of kept candidates (tokens)", color="C3")
        row[1].set_title(f"cache {cache}: perplexity and cache age against the bias")
        row[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / png, dpi=110)


def plot(out_name: str, png: str, group_key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import RESULTS

    records = load_records(out_name)
    if not records:
        return
    panels = sorted({str(r[group_key]) for r in records if r["cache_size"] != "all"}, key=lambda x: float(x))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False)
    full = [r for r in records if r["policy"] == "full"]
    colours: dict[str, str] = {}  # one colour per run label across the panels
    for ax, panel in zip(axes[0], panels):
        runs = {}
        for r in records:
            if r["policy"] != "full" and str(r[group_key]) == panel:
                label = r["policy"] if group_key == "cache_size" else f"bias {r['attention_bias']:g}"
                if r["position_mode"] != "cache":
                    label += f" ({r['position_mode']} positions)"
                runs.setdefault(label, []).append(r)
        if full:
            runs["full cache (in context)"] = full
        for label, rs in sorted(runs.items()):
            ax.plot([r["bin_last_token"] / 1000 for r in rs], [r["ppl"] for r in rs], marker="o", ms=3, label=label,
                    color=colours.setdefault(label, f"C{len(colours)}"))
        ax.set_title(f"{group_key} = {panel}")
        ax.legend(fontsize=8)
        ax.set_xlabel("tokens streamed (thousands)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity per 4K-token bin")
    fig.tight_layout()
    fig.savefig(RESULTS / png, dpi=110)


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--model", "smollm2", "--tokens", "384", "--chunk", "64", "--bin", "128", "--caches", "128", "--policies", "full",
         "inf_mllm", "--out", "long_text_ppl.json"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=None, help="text file (default: the shared Gutenberg novel)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--bin", type=int, default=4096)
    p.add_argument("--caches", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--policies", nargs="+", default=None, help="default: every registered policy")
    p.add_argument("--bias", type=float, default=None, help="attention bias of inf_mllm (default: the shipped one)")
    p.add_argument("--biases", type=float, nargs="+", default=BIASES, help="biases of --bias-sweep")
    p.add_argument("--recent", type=int, default=None)
    p.add_argument("--bias-sweep", action="store_true")
    p.add_argument("--no-original-positions", dest="original_positions", action="store_false",
                   help="skip the streaming_llm run with original positions")
    p.add_argument("--resume", action="store_true", help="skip runs already in the results file")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--out", default="long_text_ppl.json", help="results file name (merge several with --merge)")
    p.add_argument("--merge", nargs="*", default=None, help="merge these results files into --out, then plot")
    # internal: one run in this process, records printed as JSON
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="inf_mllm", help=argparse.SUPPRESS)
    p.add_argument("--cache", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--position-mode", default="cache", help=argparse.SUPPRESS)
    p.add_argument("--partial", default=None, help="also append each bin's record to this JSONL file as it is measured")
    args = p.parse_args(argv)
    args.policies = args.policies or policy_names()
    if args.bias is None:
        from inf_mllm_ros.engine.memory.policies import policy_defaults

        args.bias = policy_defaults("inf_mllm")["attention_bias"]
    if args.one:
        print(json.dumps(run_one(args)))
        return
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    if args.merge is not None:
        merged = []
        for name in args.merge:
            if name.endswith(".jsonl"):  # the bins of a run cut short
                merged += [json.loads(line) for line in open(name) if line.strip()]
            else:
                merged += load_records(name)
        write_records(args.out, merged)
        plot(args.out, args.out.replace(".json", ".png"), "cache_size")
        return
    if args.bias_sweep:
        if not args.plot_only:
            runs = [("inf_mllm", c, b, "cache") for c in args.caches for b in args.biases]
            sweep(args, "bias_sweep.json", runs)
        plot_bias_sweep()
        return
    if not args.plot_only:
        runs = [("full", args.tokens, args.bias, "cache")] if "full" in args.policies else []
        runs += [(pol, c, args.bias, "cache") for pol in args.policies if pol != "full" for c in args.caches]
        if "streaming_llm" in args.policies and 512 in args.caches and args.original_positions:
            # Original positions run past the 8K training context: the reason positions are re-packed.
            runs.append(("streaming_llm", 512, args.bias, "original"))
        sweep(args, args.out, runs)
    plot(args.out, args.out.replace(".json", ".png"), "cache_size")


if __name__ == "__main__":
    main()
