"""Where and when: a patrol robot's reports asked about later, judged by what the answer says and by the moment and
the place its evidence points to.

The sample bags' shift (bags/warehouse_scenario.py, with its patrol robot: bags/warehouse_patrol.py) goes into a
KVStream in one process: each narration line with the robot's pose at its time (what the node takes from `/odom`),
on the wall clock of the shift (`clock: wall`, as config/demo.yaml), texts only unless `--fps` adds the drawn frames.
At each of the patrol's questions, once the stream has reached its time: `ask` (greedy) with evidence and without
(which goes first alternates), and `recall` with the question's words. Judged:

- descriptive ("What colour was the ladder that the patrol robot saw?"): the answer holds the colour;
- temporal ("At what time ...?"): a time of day in the answer within 2 s of the report's, or the heaviest
  evidence's stamp within 2 s;
- spatial ("Where ...?"): the heaviest evidence's pose within 1 m of the place (and, apart, whether the answer
  names the place).

Settings: `archive` (the shipped settings), `no_archive` (archive_size 0: the cache alone) and `full` (a cache
that holds the whole shift: the ceiling). Seeds: 0 is the shipped bag's, the one its settings were looked at on
(the tune set); 100001 and on (the report set) were never run before the figures were reported.

    python benchmarks/run.py where_when                          # tune and report seeds, every setting
    python benchmarks/run.py where_when --seeds report --resume  # go on where a run stopped
    python benchmarks/run.py where_when --summary                # the summary of the recorded runs

Results: results/where_when.json, {"records": [...], "summary": {...}}; the summary's `spatial_within_1m`,
`temporal_within_2s` and `descriptive` are the report set's with the shipped settings, with every cell beside them
(fractions with their 95 % Wilson intervals); where_when.png: a report seed's route and each spatial question's
heaviest evidence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import RESULTS, machine, wilson

OUT = "where_when.json"
TUNE_SEEDS = [0]
REPORT_SEEDS = [100001, 100002, 100003]
SETTINGS = {"archive": {}, "no_archive": {"archive_size": 0}, "full": {"cache_size": 16384}}
SPATIAL_M = 1.0
TEMPORAL_S = 2.0

# The options of a short run on the small models (run.py --smoke).
SMOKE = ["--model", "smollm2", "--duration", "120", "--seeds", "0", "--settings", "archive", "--cache", "128",
         "--max-new-tokens", "8"]


def judged(probe, answer, evidence, recalled, start_s: float) -> dict:
    """A probe's answer and evidence against its truth (see the module docstring)."""
    from inf_mllm_ros.bags.stream_inputs import times_of_day

    top = evidence[0] if evidence else None
    first = recalled[0] if recalled else None
    said = start_s + probe.about_s  # seconds since midnight of the report
    out = {"correct": probe.expected.lower() in answer.lower()}
    written = times_of_day(answer)
    out["answer_time_error_s"] = min((abs(t - said) for t in written), default=None)
    for name, item in (("evidence", top), ("recall", first)):
        out[f"{name}_time_error_s"] = None if item is None or item.stamp is None else abs(item.stamp - probe.about_s)
        out[f"{name}_distance_m"] = None if item is None or item.pose is None else item.pose.distance_to(*probe.place_xy)
        out[f"{name}_xy"] = None if item is None or item.pose is None else [item.pose.x, item.pose.y]
    return out


def run_one(adapter, model: str, seed: int, setting: str, args) -> list[dict]:
    """One shift into a fresh stream with one setting; a record per patrol question."""
    from inf_mllm_ros.bags.warehouse_frames import render_frame
    from inf_mllm_ros.bags.warehouse_layout import SHIFT_START, START_NS
    from inf_mllm_ros.bags.warehouse_scenario import build_scenario
    from inf_mllm_ros.engine.poses import Pose
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.settings import DEFAULTS, stream_config

    scenario = build_scenario(args.duration, seed)
    values = dict(DEFAULTS) | {"model": model, "cache_size": args.cache, "clock": "wall", "time_zone": "UTC",
                               "max_new_tokens": args.max_new_tokens} | SETTINGS[setting]
    config = stream_config(values)
    stream = KVStream(adapter, config)
    stream.time_origin = START_NS / 1e9
    start_s = SHIFT_START.hour * 3600 + SHIFT_START.minute * 60 + SHIFT_START.second
    inputs = [(e.time_s, 1, e.text) for e in scenario.events]
    if args.fps > 0:
        inputs += [(i / args.fps, 0, None) for i in range(int(args.duration * args.fps))]
    inputs.sort(key=lambda item: (item[0], item[1]))
    probes = [p for p in scenario.probes if p.place is not None]  # the patrol's questions
    records, pushed, started = [], 0, time.monotonic()
    evidence_count = config.evidence
    for index, probe in enumerate(probes):
        while pushed < len(inputs) and inputs[pushed][0] <= probe.time_s:
            t, is_text, text = inputs[pushed]
            pose = Pose(*scenario.robot_xy(t), 0.0)
            if is_text:
                stream.push_text(text, t, pose=pose)
            else:
                stream.push_frame(render_frame(scenario, t), t, pose=pose)
            pushed += 1
        latency = {}
        answers = {}
        for with_evidence in ((True, False) if index % 2 == 0 else (False, True)):
            stream.config.evidence = evidence_count if with_evidence else 0
            answers[with_evidence] = stream.ask(probe.question)
            latency[with_evidence] = answers[with_evidence].latency
        stream.config.evidence = evidence_count
        answer = answers[True]
        t0 = time.perf_counter()
        recalled = stream.recall(probe.question) if stream.archive.enabled else []
        recall_s = time.perf_counter() - t0
        record = {"seed": seed, "set": "tune" if seed in TUNE_SEEDS else "report", "setting": setting,
                  "model": model, "cache": args.cache if setting != "full" else SETTINGS["full"]["cache_size"],
                  "fps": args.fps, "duration_s": args.duration, "kind": probe.kind, "question": probe.question,
                  "expected": probe.expected, "asked_s": round(probe.time_s, 2), "about_s": round(probe.about_s, 2),
                  "place": probe.place, "place_xy": list(probe.place_xy), "answer": answer.text,
                  **judged(probe, answer.text, answer.evidence, recalled, start_s),
                  "answer_without_evidence": answers[False].text, "ask_s": round(latency[True], 3),
                  "ask_without_evidence_s": round(latency[False], 3), "recall_s": round(recall_s, 4),
                  "retrieved_tokens": answer.retrieved_tokens, "tokens_seen": stream.tokens_seen,
                  "machine": machine()}
        records.append(record)
        print(json.dumps({k: record[k] for k in ("seed", "setting", "kind", "expected", "answer", "correct",
                                                 "evidence_time_error_s", "evidence_distance_m", "ask_s")}),
              flush=True)
    print(f"seed {seed} {setting}: {len(records)} questions in {time.monotonic() - started:.0f} s", flush=True)
    return records


def _rate(hits: int, n: int) -> dict:
    low, high = wilson(hits, n)
    return {"fraction": round(hits / n, 3) if n else None, "hits": hits, "n": n, "interval_95": [round(low, 3),
                                                                                                  round(high, 3)]}


def cell(records: list[dict]) -> dict:
    """The fractions and latencies of one set and setting."""
    spatial = [r for r in records if r["kind"] == "spatial"]
    temporal = [r for r in records if r["kind"] == "temporal"]
    descriptive = [r for r in records if r["kind"] == "descriptive"]

    def within(value, bound):
        return value is not None and value <= bound

    out = {
        "spatial_within_1m": _rate(sum(within(r["evidence_distance_m"], SPATIAL_M) for r in spatial), len(spatial)),
        "spatial_answer_names_place": _rate(sum(r["correct"] for r in spatial), len(spatial)),
        "temporal_within_2s": _rate(sum(within(r["answer_time_error_s"], TEMPORAL_S)
                                        or within(r["evidence_time_error_s"], TEMPORAL_S) for r in temporal),
                                    len(temporal)),
        "temporal_answer_within_2s": _rate(sum(within(r["answer_time_error_s"], TEMPORAL_S) for r in temporal),
                                           len(temporal)),
        "temporal_evidence_within_2s": _rate(sum(within(r["evidence_time_error_s"], TEMPORAL_S) for r in temporal),
                                             len(temporal)),
        "descriptive": _rate(sum(r["correct"] for r in descriptive), len(descriptive)),
        "recall_spatial_within_1m": _rate(sum(within(r["recall_distance_m"], SPATIAL_M) for r in spatial),
                                          len(spatial)),
    }
    if records:
        ask = [r["ask_s"] for r in records]
        bare = [r["ask_without_evidence_s"] for r in records]
        out["ask_s_median"] = round(statistics.median(ask), 3)
        out["evidence_overhead"] = round(statistics.median(ask) / statistics.median(bare) - 1, 3)
        out["recall_share_of_ask"] = round(statistics.median(r["recall_s"] for r in records)
                                           / statistics.median(ask), 3)
    return out


def summary(records: list[dict]) -> dict:
    """Every set and setting's cell; on top, the report set with the shipped settings (and its descriptive
    accuracy as a share of the full cache's)."""
    cells = {}
    for key in sorted({(r["set"], r["setting"]) for r in records}):
        cells["/".join(key)] = cell([r for r in records if (r["set"], r["setting"]) == key])
    headline = cells.get("report/archive", {})
    out = {"set": "report", "setting": "archive", "seeds": sorted({r["seed"] for r in records if r["set"] == "report"})}
    for name in ("spatial_within_1m", "temporal_within_2s", "descriptive"):
        out[name] = (headline.get(name) or {}).get("fraction")
    full = (cells.get("report/full", {}).get("descriptive") or {}).get("fraction")
    if full and out["descriptive"] is not None:
        out["descriptive_of_full"] = round(out["descriptive"] / full, 3)
    out["cells"] = cells
    return out


def plot(records: list[dict], path) -> None:
    """A report seed's route and each spatial question's heaviest evidence, numbered (green within 1 m)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from inf_mllm_ros.bags.warehouse_layout import PLACES_M
    from inf_mllm_ros.bags.warehouse_scenario import build_scenario

    chosen = [r for r in records if r["set"] == "report" and r["setting"] == "archive"] or records
    if not chosen:
        return
    seed, duration = chosen[0]["seed"], chosen[0]["duration_s"]
    spatial = [r for r in chosen if r["seed"] == seed and r["kind"] == "spatial"]
    poses = list(build_scenario(duration, seed).robot_poses(2.0))
    fig, ax = plt.subplots(figsize=(8, 6.5))
    ax.plot([p[1] for p in poses], [p[2] for p in poses], color="grey", alpha=0.4, linewidth=1, label="route")
    for name, (x, y) in PLACES_M.items():
        ax.plot(x, y, "+", color="black", alpha=0.5)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(3, -9), fontsize=7, alpha=0.6)
    for number, r in enumerate(spatial, 1):
        if r["evidence_xy"] is None:
            continue
        near = r["evidence_distance_m"] <= SPATIAL_M
        ax.plot(*r["evidence_xy"], "o", color="tab:green" if near else "tab:red", markersize=9, alpha=0.7)
        ax.annotate(str(number), r["evidence_xy"], textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_aspect("equal")
    ax.set_xlabel("x (m)")
    ax.set_ylabel("y (m)")
    ax.set_title(f"seed {seed}: the route and each 'where' question's heaviest evidence (green: within 1 m)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--duration", type=float, default=480.0, help="seconds of the shift")
    p.add_argument("--fps", type=float, default=0.0, help="drawn frames a second beside the texts (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seeds", default="all", help="tune, report, all, or seeds separated by commas")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="keep the recorded runs, run the rest")
    p.add_argument("--summary", action="store_true", help="only print the summary of the recorded runs")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    path = RESULTS / args.out
    recorded = json.loads(path.read_text())["records"] if path.exists() and (args.resume or args.summary) else []
    if not args.summary:
        import torch

        from inf_mllm_ros.engine.models.loading import load_model

        torch.set_num_threads(args.threads)
        seeds = {"tune": TUNE_SEEDS, "report": REPORT_SEEDS, "all": TUNE_SEEDS + REPORT_SEEDS}.get(args.seeds)
        seeds = seeds or [int(s) for s in args.seeds.split(",")]
        adapter = load_model(args.model, device=args.device, dtype=args.dtype)
        done = {(r["seed"], r["setting"]) for r in recorded}
        for seed in seeds:
            for setting in args.settings.split(","):
                if (seed, setting) in done:
                    continue
                with torch.inference_mode():
                    recorded += run_one(adapter, args.model, seed, setting, args)
                RESULTS.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"records": recorded, "summary": summary(recorded)}, indent=1) + "\n")
    result = summary(recorded)
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}, indent=1))
    for name, figures in result["cells"].items():
        print(name, json.dumps({k: v["fraction"] if isinstance(v, dict) else v for k, v in figures.items()}))
    if recorded:
        plot(recorded, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
