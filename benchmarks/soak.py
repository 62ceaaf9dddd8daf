"""Soak: the installed node for an hour under a live camera, a text a second and a question every 30 s.

    python benchmarks/soak.py                        # 1 h (--duration 3600)
    python benchmarks/soak.py --duration 240         # a short check
    python benchmarks/soak.py --torch-threads 1      # the node on one CPU thread (a busy or small machine)
    python benchmarks/soak.py --params inf_mllm_bringup/config/cpu.yaml   # another starting point than the defaults
    python benchmarks/soak.py --plot-only            # the plot again from benchmarks/results/soak.json

The run itself (the node's process, the sensors and questions this process plays, the samples and the summary) is
`inf_mllm_ros.testing.soak`, whose docstring says what is measured and how memory is judged; this file writes
benchmarks/results/soak.json (flat records: kind "sample", "question", one "summary"), soak.png and the node's log,
soak_node.log, and keeps benchmarks/results/soak.partial.jsonl while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import RESULTS, machine, shown
from inf_mllm_ros.testing.node_process import default_domain_id
from inf_mllm_ros.testing.soak import NODE_PARAMS, run_soak

OUT = "soak.json"
PARTIAL = "soak.partial.jsonl"


# --- results ------------------------------------------------------------------------------------------------------


def write_results(records: list[dict], folder: Path = RESULTS, name: str = OUT) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(records, indent=1) + "\n")
    png = folder / (Path(name).stem + ".png")
    plot(records, png)
    return path, png


def plot(records: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [r for r in records if r["kind"] == "sample"]
    questions = [r for r in records if r["kind"] == "question"]
    summary = next((r for r in records if r["kind"] == "summary"), {})
    long_run = (samples[-1]["elapsed_s"] if samples else 0) > 600
    scale, unit = (60.0, "minutes") if long_run else (1.0, "seconds")
    t = [s["elapsed_s"] / scale for s in samples]

    def series(field):
        return [s[field] if s[field] is not None else float("nan") for s in samples]

    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    ax = axes[0][0]
    ax.plot(t, series("rss_mb"), label="resident (VmRSS)")
    ax.plot(t, series("hwm_mb"), linestyle=":", label="peak (VmHWM)")
    ref = summary.get("rss_reference_mb")
    if ref:
        at = summary["rss_reference_at_s"] / scale
        ax.axvline(at, color="grey", linewidth=0.8)
        ax.fill_between([at, t[-1]], ref * 0.98, ref * 1.02, color="green", alpha=0.15, label="reference \u00b1 2%")
    saves = [s["elapsed_s"] / scale for prev, s in zip(samples, samples[1:])
             if (s.get("checkpoints_seen") or 0) > (prev.get("checkpoints_seen") or 0)]
    for i, x in enumerate(saves):
        ax.axvline(x, color="purple", linestyle=":", linewidth=0.8, label="memory file written" if i == 0 else None)
    ax.set_title("node resident memory (MiB)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(t, series("fill"), label="fill")
    ax.plot(t, series("capacity"), linestyle="--", color="grey", label="capacity")
    ax.set_title("KV cache fill (tokens)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.step(t, series("texts_waiting"), where="post", label="texts waiting")
    ax.step(t, series("queries_waiting"), where="post", label="queries waiting")
    ax.step(t, [float(s["frame_waiting"]) if s["frame_waiting"] is not None else float("nan") for s in samples],
            where="post", label="frame waiting", alpha=0.5)
    marks = {"answered": ("green", [q for q in questions if q.get("success")]),
             "refused": ("orange", [q for q in questions if q.get("responded") and not q.get("success")]),
             "no response": ("red", [q for q in questions if not q.get("responded")])}
    for label, (colour, qs) in marks.items():
        if qs:
            ax.plot([q["asked_at_s"] / scale for q in qs], [-0.3] * len(qs), "|", color=colour, markersize=10,
                    label=f"question {label}")
    ax.set_title("work waiting for the model; questions asked", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(t, series("frames_ingested"), label="frames ingested")
    ax.plot(t, series("texts_ingested"), label="texts ingested")
    ax.set_title("frames and texts ingested", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax2 = ax.twinx()
    ax2.plot(t, series("frames_dropped"), color="grey", linestyle=":", label="frames dropped (right)")
    ax2.legend(fontsize=8, loc="lower right")
    spans = {}  # phase: (its first sample, the sample after its last) in time
    for i, (sample, x) in enumerate(zip(samples, t)):
        first, _ = spans.get(sample["phase"], (x, x))
        spans[sample["phase"]] = (first, t[min(i + 1, len(t) - 1)])
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
            for phase, colour in (("drain", "0.85"), ("settle", "0.7")):
                if phase in spans:
                    a.axvspan(*spans[phase], color=colour, alpha=0.4, linewidth=0,
                              label=f"{phase} (no new questions)" if phase == "drain" else "settle (streams stopped)")
    axes[0][1].legend(fontsize=8)
    for a in axes[1]:
        a.set_xlabel(f"time since the node started ({unit})")
    fig.suptitle(f"soak: {summary.get('duration_s', '?')} s at {summary.get('fps', '?')} fps, "
                 f"{summary.get('questions_answered', '?')}/{summary.get('questions_asked', '?')} questions answered, "
                 f"exit {summary.get('node_exit_code', '?')} ({summary.get('machine', '')}; node torch threads "
                 f"{summary.get('node_torch_threads', '?')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--duration", "40", "--fps", "5", "--question-every", "15", "--sample-every", "5"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=3600.0, help="seconds from the node's start")
    p.add_argument("--fps", type=float, default=30.0, help="camera frames per second")
    p.add_argument("--question-every", type=float, default=30.0, help="seconds between questions")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--params", type=Path, default=None,
                   help="a parameters file (/**: ros__parameters:) for the node instead of its defaults, "
                        "e.g. inf_mllm_bringup/config/cpu.yaml; stats_period, checkpoint_period, memory_file stay the soak's")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="the node's torch CPU threads (OMP_NUM_THREADS); default: torch's own (one per core)")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    if args.plot_only:
        records = json.loads((RESULTS / OUT).read_text())
        plot(records, RESULTS / (Path(OUT).stem + ".png"))
        return
    domain_id = default_domain_id()
    os.environ["ROS_DOMAIN_ID"] = str(domain_id)
    node_params = {}
    if args.params is not None:
        import yaml

        node_params = {k: v for k, v in yaml.safe_load(args.params.read_text())["/**"]["ros__parameters"].items()
                       if k not in NODE_PARAMS and k != "memory_file"}
    records = run_soak(args.duration, fps=args.fps, question_every=args.question_every,
                       sample_every=args.sample_every, domain_id=domain_id, node_params=node_params,
                       node_log=RESULTS / "soak_node.log", torch_threads=args.torch_threads,
                       partial=RESULTS / PARTIAL, machine=machine())
    path, png = write_results(records)
    (RESULTS / PARTIAL).unlink(missing_ok=True)  # the full results are written
    summary = records[-1]
    print(json.dumps(summary, indent=1))
    print(f"wrote {shown(path)} and {shown(png)}")
    if summary["node_exit_code"] != 0:
        raise SystemExit(f"the node exited with {summary['node_exit_code']} after SIGINT")


if __name__ == "__main__":
    main()
