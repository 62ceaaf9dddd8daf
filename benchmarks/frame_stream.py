"""A camera stream into the bounded cache: ingest time, KV bytes and process memory over a long run.

    python benchmarks/frame_stream.py                         # 1 h at 1 fps (3,600 frames), every policy, CPU
    python benchmarks/frame_stream.py --frames 300            # a shorter run
    python benchmarks/frame_stream.py --device cuda --model-config qwen2-vl-2b
    python benchmarks/frame_stream.py --plot-only

Frames are synthetic (a fixed scene with a box moving across it, 640x480), one per second of stream
time, each pushed as one prompt (in blocks of --chunk tokens, evicting after each). Models have random
weights built from their config classes (see inf_mllm_ros/testing/random_models.py), so the numbers are
costs, not answer quality:
  smolvlm-small     SmolVLM/Idefics3 shape, 4-layer 256-wide decoder: the default on CPU;
  smolvlm-smollm2   the small embedded model (SmolLM2-135M decoder, untrained vision part);
  qwen2-vl-2b       Qwen2-VL-2B sizes (1.5B decoder, 675M vision tower): for a GPU;
  qwen2-vl-tiny     the same code path at a tiny size, runnable anywhere.
The full cache runs for as long as the stream fits in the model's context. Each policy runs in its own
process, so its peak memory is its own. Results: benchmarks/results/frame_stream.json (flat records,
one every --record-every frames), frame_stream.png and a summary table, frame_stream.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import RESULTS, load_records, machine, peak_rss_bytes, policy_names, write_records

POLICIES = policy_names()
MODEL_CONFIGS = {  # name: (family, size) for random_models; None: the small embedded model
    "smolvlm-small": ("idefics3", "small"),
    "qwen2-vl-tiny": ("qwen2_vl", "tiny"),
    "qwen2-vl-2b": ("qwen2_vl", "qwen2-vl-2b"),
    "smolvlm-smollm2": None,
}
OUT = "frame_stream.json"


def model_folder(name: str, dtype: str) -> str:
    """Build the benchmark's random-weight model once into the engine's model cache; reuse it after."""
    import torch

    from inf_mllm_ros.engine.models.embedded_models import home
    from inf_mllm_ros.testing.random_models import build_model_folder

    if MODEL_CONFIGS[name] is None:
        return "smolvlm-smollm2"
    family, size = MODEL_CONFIGS[name]
    folder = home() / "bench_models" / name
    if not (folder / "config.json").exists():
        # Store big models in half precision (what a GPU runs); small ones in float32.
        store = torch.bfloat16 if size == "qwen2-vl-2b" and dtype != "float32" else torch.float32
        build_model_folder(family, folder, size=size, seed=0, dtype=store)
    return str(folder)


class Scene:
    """Synthetic camera frames: a fixed textured background and a bright box crossing it."""

    def __init__(self, height: int, width: int, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.background = rng.integers(40, 200, (height, width, 3), dtype=np.uint8)
        self.height, self.width = height, width

    def frame(self, index: int):
        rgb = self.background.copy()
        size = max(self.height // 6, 1)
        x = (index * 7) % max(self.width - size, 1)
        y = (index * 3) % max(self.height - size, 1)
        rgb[y : y + size, x : x + size] = (250, 30 + index % 200, 30)
        return rgb


def run_one(args) -> list[dict]:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = model_folder(args.model_config, args.dtype) if args.model is None else args.model
    adapter = load_model(folder, device=args.device, dtype=args.dtype)
    cuda = adapter.device.type == "cuda"
    headroom = max(args.chunk, 256)
    capacity = args.cache
    if args.policy == "full":  # as much as the model's context takes
        capacity = adapter.max_context - headroom
    config = StreamConfig(capacity=capacity, policy=args.policy, chunk_size=args.chunk, headroom=headroom,
                          max_frame_pixels=args.max_frame_pixels, scoring_backend=args.scoring)
    stream = KVStream(adapter, config)
    height, width = args.frame_size
    scene = Scene(height, width)
    kv_per_token = None
    try:
        import psutil

        process = psutil.Process()
    except ImportError:
        process = None

    def sync():
        if cuda:
            torch.cuda.synchronize()

    records, window, cpu_window, frame_tokens = [], [], [], 0
    stopped = ""
    start = time.perf_counter()
    for index in range(args.frames):
        rgb = scene.frame(index)
        if args.policy == "full" and frame_tokens and stream.cache.fill + frame_tokens > stream.cache.slots:
            stopped = "context full"
            break
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        frame_tokens = stream.push_frame(rgb, float(index) / args.fps)
        sync()
        window.append(time.perf_counter() - t0)
        cpu_window.append(time.process_time() - c0)
        if kv_per_token is None:
            kv_per_token = stream.cache.kv_nbytes() // stream.cache.slots
        done = index + 1
        # The full cache fills its context within minutes: sample it more often.
        every = args.record_every if args.policy != "full" else max(args.record_every // 6, 1)
        if done % every == 0 or done == args.frames:
            records.append(record(args, stream, adapter, window, cpu_window, done, frame_tokens, kv_per_token,
                                  capacity, process, cuda, start))
            window, cpu_window = [], []
    if stopped and window:
        records.append(record(args, stream, adapter, window, cpu_window, stream.frames_ingested, frame_tokens,
                              kv_per_token, capacity, process, cuda, start))
    sync()
    t0 = time.perf_counter()
    answer = stream.ask("What moved across the scene?", max_new_tokens=8)
    sync()
    for r in records:
        r.update(stopped=stopped, answer_ms=round(1000 * (time.perf_counter() - t0), 1),
                 answer_tokens=answer.tokens_generated)
    return records


def record(args, stream, adapter, window, cpu_window, frames, frame_tokens, kv_per_token, capacity, process, cuda,
           start):
    import torch

    stats = stream.stats()
    r = {
        "policy": args.policy,
        "frames": frames,
        "seconds": round(frames / args.fps, 1),  # stream time
        "ms_per_frame": round(1000 * sum(window) / len(window), 2),  # wall clock
        "ms_per_frame_max": round(1000 * max(window), 2),
        # CPU time of this process: on a shared machine, what the frame cost whatever else was running.
        "cpu_ms_per_frame": round(1000 * sum(cpu_window) / len(cpu_window), 2),
        "frames_per_second": round(len(window) / sum(window), 2),
        "kv_bytes": stats.kv_bytes,  # allocated once, never grows
        "kv_used_bytes": stats.fill * kv_per_token,  # what the cache holds (what a growing cache would)
        "cache_bytes": stats.cache_bytes,
        "process_peak_bytes": peak_rss_bytes(),
        "process_rss_bytes": process.memory_info().rss if process else None,
        "cache_fill": stats.fill,
        "tokens_seen": stats.tokens_seen,
        "next_position": stats.next_position,
        "frame_tokens": frame_tokens,
        "cache_size": capacity,
        "chunk_size": args.chunk,
        "model": args.model or args.model_config,
        "layers": adapter.num_layers,
        "dtype": str(adapter.dtype).replace("torch.", ""),
        "device": machine(),
        "threads": torch.get_num_threads() if not cuda else None,
        "frame_size": f"{args.frame_size[1]}x{args.frame_size[0]}",
        "max_frame_pixels": args.max_frame_pixels,
        "scoring_backend": args.scoring,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time(), 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if cuda:
        r["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        r["device_allocated_bytes"] = torch.cuda.memory_allocated()
    return r


def command(args, policy: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--policy", policy, "--frames", str(args.frames),
           "--fps", str(args.fps), "--cache", str(args.cache), "--chunk", str(args.chunk),
           "--record-every", str(args.record_every), "--model-config", args.model_config,
           "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
           "--frame-size", f"{args.frame_size[1]}x{args.frame_size[0]}", "--scoring", args.scoring]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_frame_pixels:
        cmd += ["--max-frame-pixels", str(args.max_frame_pixels)]
    return cmd


def run_policies(args):
    """Each policy in its own process (its peak memory is its own), --parallel of them at a time."""
    waiting, running = list(args.policies), []
    while waiting or running:
        while waiting and len(running) < args.parallel:
            policy = waiting.pop(0)
            proc = subprocess.Popen(command(args, policy), stdout=subprocess.PIPE, text=True)
            running.append((policy, proc, time.time()))
        policy, proc, started = running.pop(0)
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"the {policy} run failed (exit {proc.returncode})")
        yield policy, json.loads(out.strip().splitlines()[-1]), time.time() - started


def timing(device: str) -> str:
    """The per-frame time compared: CPU time on a CPU (robust to other load on the machine), else wall clock."""
    return "cpu_ms_per_frame" if device.startswith("cpu") else "ms_per_frame"


def summary(records: list[dict]) -> list[dict]:
    """Per run: early and late ingest time, memory at fill and at the end (flatness), time vs streaming_llm."""
    runs = {}
    for r in records:
        runs.setdefault((r["model"], r["device"], r["policy"]), []).append(r)
    rows = []
    for key in sorted(runs):
        rs = runs[key]
        metric = timing(key[1])
        filled = [r for r in rs if r["cache_fill"] >= r["cache_size"]] or rs[-1:]
        tenth = max(len(rs) // 10, 1)
        row = {
            "model": key[0], "device": key[1], "policy": key[2], "frames": rs[-1]["frames"],
            "stream_minutes": round(rs[-1]["seconds"] / 60, 1), "frame_tokens": rs[-1]["frame_tokens"],
            "cache_size": rs[-1]["cache_size"], "timing": metric.replace("_per_frame", ""),
            "ms_per_frame_early": round(sum(r[metric] for r in rs[:tenth]) / tenth, 1),
            "ms_per_frame_late": round(sum(r[metric] for r in rs[-tenth:]) / tenth, 1),
            "ms_per_frame_mean": round(sum(r[metric] for r in rs) / len(rs), 1),
            "kv_used_mb_at_fill": round(filled[0]["kv_used_bytes"] / 2**20, 2),
            "kv_used_mb_end": round(rs[-1]["kv_used_bytes"] / 2**20, 2),
            "peak_mb_at_fill": round(filled[0]["process_peak_bytes"] / 2**20, 1),
            "peak_mb_end": round(rs[-1]["process_peak_bytes"] / 2**20, 1),
            "stopped": rs[-1].get("stopped", ""),
        }
        rows.append(row)
    by = {(row["model"], row["device"], row["policy"]): row for row in rows}
    for row in rows:
        base = by.get((row["model"], row["device"], "streaming_llm"))
        if base and row["policy"] != "full":
            row["time_vs_streaming_llm"] = round(row["ms_per_frame_mean"] / base["ms_per_frame_mean"], 3)
    return rows


def summary_markdown(rows: list[dict]) -> str:
    """The summary as Markdown tables, one per model and device (also printed)."""
    cols = ["policy", "frames", "stream_minutes", "frame_tokens", "cache_size", "timing", "ms_per_frame_early",
            "ms_per_frame_late", "ms_per_frame_mean", "time_vs_streaming_llm", "kv_used_mb_at_fill", "kv_used_mb_end",
            "peak_mb_at_fill", "peak_mb_end", "stopped"]
    lines = ["# Frame-stream benchmark", "",
             "Early/late/mean: ingest time per frame over the first tenth, the last tenth and all of the run; on a",
             "CPU it is the process's CPU time (the machine may be shared), on a GPU wall-clock time. time vs",
             "streaming_llm: ratio of the means. KV MiB: what the cache holds (its storage is allocated once). Peak:",
             "the process's peak resident memory. Random weights: costs only. Produced by benchmarks/frame_stream.py",
             "from frame_stream.json."]
    for model in sorted({(r["model"], r["device"]) for r in rows}):
        lines += ["", f"## {model[0]} on {model[1]}", "", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]
        for row in rows:
            if (row["model"], row["device"]) == model:
                lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({(r["model"], r["device"]) for r in records})
    fig, axes = plt.subplots(len(runs), 3, figsize=(15, 3.8 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        for policy in POLICIES:
            rs = [r for r in records if (r["model"], r["device"]) == run and r["policy"] == policy]
            if not rs:
                continue
            minutes = [r["seconds"] / 60 for r in rs]
            row[0].plot(minutes, [r[timing(run[1])] for r in rs], label=policy)
            row[1].plot(minutes, [r["kv_used_bytes"] / 2**20 for r in rs], label=policy)
            row[2].plot(minutes, [r["process_peak_bytes"] / 2**20 for r in rs], label=policy)
        kind = "CPU" if timing(run[1]).startswith("cpu") else "wall-clock"
        titles = (f"ingest time per frame, {kind} (ms)", "KV bytes held (MiB)", "process peak memory (MiB)")
        for ax, title in zip(row, titles):
            ax.set_title(f"{title}\n{run[0]}, {run[1]}", fontsize=9)
            ax.set_xlabel("stream time (minutes at 1 frame/s)")
            ax.grid(alpha=0.3)
        row[0].set_yscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / png, dpi=100)


def frame_size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return height, width


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--frames", "6", "--record-every", "3", "--frame-size", "96x64", "--cache", "256", "--chunk", "64", "--policies", "inf_mllm"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="smolvlm-small", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--model", default=None, help="a model folder instead of a built one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (small models gain nothing from more)")
    p.add_argument("--frames", type=int, default=3600)
    p.add_argument("--fps", type=float, default=1.0)
    p.add_argument("--frame-size", type=frame_size, default=(480, 640), help="WIDTHxHEIGHT")
    p.add_argument("--max-frame-pixels", type=int, default=None)
    p.add_argument("--cache", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--record-every", type=int, default=60)
    p.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    p.add_argument("--scoring", default="auto", choices=["auto", "torch", "triton"], help="inf_mllm/h2o scoring")
    p.add_argument("--parallel", type=int, default=1, help="policies run at the same time (one process each)")
    p.add_argument("--keep", action="store_true", help="keep other runs' records in the results file")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="inf_mllm", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return
    records = load_records(OUT) if (args.keep or args.plot_only) else []
    if not args.plot_only:
        if args.model is None:
            model_folder(args.model_config, args.dtype)  # build once, before the runs
        name = args.model or args.model_config
        for policy, new, seconds in run_policies(args):
            records = [r for r in records if not (r["model"] == name and r["policy"] == policy
                                                  and r["device"] == new[0]["device"])] + new
            write_records(OUT, records)  # after every run, so an interrupted sweep keeps what it measured
            last = new[-1]
            print(f"{policy:14s} {last['frames']:5d} frames of {last['frame_tokens']} tokens: "
                  f"{last[timing(last['device'])]} ms/frame at the end, peak {last['process_peak_bytes'] / 2**20:.0f} "
                  f"MiB ({seconds:.0f} s){' [' + last['stopped'] + ']' if last['stopped'] else ''}", flush=True)
    text = summary_markdown(summary(records))
    print(text)
    (RESULTS / "frame_stream.md").write_text(text)
    plot(records, "frame_stream.png")


if __name__ == "__main__":
    main()
