"""The soak: the installed node under a live camera, texts and questions for a long time, sampled as it goes (the
run, its samples and its summary; benchmarks/soak.py is its command line, results and plot, test_soak.py a short
run of it).

The node runs as its own process (the installed inf_mllm_node), with its default parameters except
stats_period 1.0 and a memory_file in a temporary folder with checkpoint_period 60, so checkpoints are
part of the run. description_period keeps its default (10 s): descriptions are periodic generation
work the node does in the field, and a soak should carry all of it. The node gets a ROS domain of its
own (derived from this process's id, localhost discovery only).

This process plays the sensors and the user, from one rclpy node spinning in its own thread:
  camera     640x480 rgb8 sensor_msgs/Image at --fps (30), best effort, depth 1, as a camera driver
             publishes; a textured background with a square moving across it, so no two frames match;
  text       std_msgs/String at 1 Hz, reliable: varied sentences with a counter, a fact every tenth;
  questions  ~/query every --question-every s (30), about the facts, each waited for query_timeout
             (the node's, 120 s by default) plus 5 s for the response to travel.
After --duration s (counted from the node's start, model loading included) no more questions are
asked; camera and texts go on until every question has its response or has passed its deadline
("drain"), then stop while the node takes in what it still holds ("settle", 30 s at most). Every
--sample-every s (5), in every phase, it records the node's resident memory (VmRSS, VmHWM from /proc),
threads, open files and CPU time, the latest ~/cache_stats and what it has published. Samples and
questions go to a partial file (benchmarks/results/soak.partial.jsonl) as they are taken, so a run cut short
leaves its data. At the end the node is stopped with SIGINT (it must exit 0); benchmarks/results/soak.json (flat
records: kind "sample", "question", one "summary"), soak.png and the node's log, soak_node.log, are
written.

Memory is judged from a reference: the median of the samples in the minute from the first sample
after 5 minutes (after 1/12 of the duration for runs shorter than an hour; the summary says which) at
which the model is loaded and frames are going in, against the median of the last minute's samples
(a checkpoint save briefly holds about 2.5 times the memory file; medians keep one such sample from
deciding). `rss_within_2_percent`: the end is within 2% of the reference. The maximum after the
reference is recorded beside it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from ..fastdds import large_frames_env
from .node_process import Driver, NodeProcess, Scene, default_domain_id, node_executable, open_files
from .node_process import proc_cpu_seconds, proc_status

QUERY_TIMEOUT = 120.0  # the node's default query_timeout (kept)
RESPONSE_GRACE = 5.0  # beyond query_timeout, for the response to travel back
REFERENCE_AFTER = 300.0  # memory is judged from 5 minutes on ...
REFERENCE_FRACTION = 1 / 12  # ... or from 1/12 of a shorter run
RSS_WINDOW = 60.0  # seconds of samples whose median is the reference (and the end) value, at most
STATS_FIELDS = ("fill", "capacity", "tokens_seen", "tokens_evicted", "frames_ingested", "frames_dropped",
                "texts_ingested", "inputs_rejected", "queries_answered", "queries_failed", "texts_waiting",
                "queries_waiting", "frame_waiting", "kv_bytes", "model_ready")
NODE_PARAMS = {"stats_period": 1.0, "checkpoint_period": 60.0}  # memory_file: added per run


PLACES = ["dock 1", "dock 2", "dock 3", "the charging bay", "aisle 7", "the loading ramp", "bay 12", "the gate"]
THINGS = ["forklift F{k}", "pallet P{k}", "cart C{k}", "robot R{k}"]
SENTENCES = [
    "Update {n}: conveyor {line} runs at {rate} boxes per minute.",
    "Update {n}: the temperature in hall {line} is {temp} degrees.",
    "Update {n}: {people} people are on the floor near {place}.",
    "Update {n}: the lights in aisle {line} were switched {onoff}.",
    "Update {n}: a truck is expected at {place} in {rate} minutes.",
    "Update {n}: nothing unusual to report.",
]


def text_message(n: int) -> tuple[str, tuple[str, str] | None]:
    """The n-th text (a fact every tenth, about a thing and a place); the fact as (thing, place) or None."""
    if n % 10 == 0:
        thing = THINGS[(n // 10) % len(THINGS)].format(k=n // 10 % 9 + 1)
        place = PLACES[(n * 7 // 10) % len(PLACES)]
        return f"Update {n}: {thing[0].upper() + thing[1:]} is now at {place}.", (thing, place)
    template = SENTENCES[n % len(SENTENCES)]
    return template.format(n=n, line=n % 5 + 1, rate=20 + n % 37, temp=18 + n % 9, people=n % 12,
                           place=PLACES[n % len(PLACES)], onoff="on" if n % 2 else "off"), None


def question_for(index: int, fact: tuple[str, str] | None) -> str:
    if fact is not None and index % 3 != 2:
        return f"Where is {fact[0]}?"
    return ["What has changed on the floor recently?", "What do you see in the camera image?",
            "Summarise the last few updates."][index % 3]


# --- the run ----------------------------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else round((values[middle - 1] + values[middle]) / 2, 1)


def reference_after(duration: float) -> tuple[float, str]:
    if duration >= REFERENCE_AFTER * 12:
        return REFERENCE_AFTER, "after 5 minutes"
    return duration * REFERENCE_FRACTION, "after 1/12 of the duration (short run)"


def run_soak(duration: float = 3600.0, *, fps: float = 30.0, question_every: float = 30.0,
             sample_every: float = 5.0, text_every: float = 1.0, partial: Path | None = None,
             domain_id: int | None = None, node_params: dict | None = None, query_timeout: float = QUERY_TIMEOUT,
             stop_timeout: float = 60.0, node_log: Path | None = None, torch_threads: int | None = None,
             machine: str | None = None, log=print) -> list[dict]:
    """Run the soak for `duration` seconds (from the node's start, model loading included).

    Returns the records: samples, questions, one summary (see the module docstring). `partial`: a JSONL
    file that gets each record as it is taken (None: none). `node_params` are added to NODE_PARAMS (the
    node's defaults otherwise). `node_log`: where the node's log is copied at the end (None: nowhere).
    `torch_threads`: the node's torch CPU threads (OMP_NUM_THREADS in its environment; None: torch's
    default, one per core). `machine`: the machine's description for the summary."""
    node_executable()  # installed, or a clear error before anything starts
    domain_id = default_domain_id() if domain_id is None else domain_id
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    # Raw 640x480 frames need the large-frames profile on the publishing side too (scripts/env.sh exports it).
    os.environ.update(large_frames_env())
    params = dict(NODE_PARAMS, **(node_params or {}))
    query_timeout = float(params.get("query_timeout", query_timeout))
    folder = Path(tempfile.mkdtemp(prefix="inf_mllm_soak_"))
    partial_file = None
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial_file = open(partial, "w")

    def keep(record: dict) -> None:
        if partial_file is not None:
            partial_file.write(json.dumps(record) + "\n")
            partial_file.flush()

    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    node = NodeProcess(domain_id, params, folder,
                       extra_env=None if torch_threads is None else {"OMP_NUM_THREADS": str(torch_threads)})
    driver = None
    samples: list[dict] = []
    questions: list[dict] = []
    try:
        driver = Driver(domain_id)
        records = _drive(node, driver, samples, questions, keep, duration, fps, question_every, sample_every,
                         text_every, query_timeout, log)
        alive_at_end = node.alive
        exit_code, stop_seconds, killed = node.stop(stop_timeout)
        records["node_alive_at_end"] = alive_at_end
        records["node_exit_code"] = exit_code
        records["node_stop_seconds"] = round(stop_seconds, 2)
        records["node_killed"] = killed
        records["machine"] = machine
        records["memory_file_bytes_after_stop"] = (node.memory_file.stat().st_size
                                                   if node.memory_file.exists() else None)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        records["driver_cpu_s"] = round(usage.ru_utime + usage.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime, 1)
        log_text = node.log()
        lines = log_text.splitlines()
        records["node_log_errors"] = sum(line.startswith(("[ERROR]", "[FATAL]")) or line.startswith("Traceback")
                                         for line in lines)
        records["node_log_warnings"] = sum(line.startswith("[WARN]") for line in lines)
        if exit_code != 0 or not alive_at_end:
            log(f"node log (end):\n{log_text[-3000:]}")
        summary = summarize(samples, questions, records, duration=duration, fps=fps, question_every=question_every,
                            sample_every=sample_every, query_timeout=query_timeout, params=params,
                            domain_id=domain_id, torch_threads=torch_threads)
        keep(summary)
        return samples + questions + [summary]
    finally:
        if driver is not None:
            driver.close()
        if node.alive:
            node.stop(10)
        if node_log is not None and node.log_path.exists():
            node_log.parent.mkdir(parents=True, exist_ok=True)
            # Without this machine's folders, so the log can sit beside the results.
            node_log.write_text(node.log().replace(str(folder), "<temporary folder>").replace(os.getcwd(), ".")
                                .replace(str(Path.home()), "~"))
        if partial_file is not None:
            partial_file.close()
        shutil.rmtree(folder, ignore_errors=True)


def _drive(node, driver, samples, questions, keep, duration, fps, question_every, sample_every, text_every,
           query_timeout, log) -> dict:
    """The loop: frames at fps, texts, questions and samples on their schedules; then the drain. Returns extras."""
    scene = Scene()
    start = node.started
    frames_published = texts_published = 0
    last_fact = None
    pending: list[tuple[dict, object, float]] = []  # (record, future, deadline)
    done_at: dict[int, float] = {}  # question index: when its response arrived (set in the executor's thread)
    checkpoints: list[float] = []  # memory file modification times seen
    extras = {"model_ready_after_s": None, "first_frame_ingested_after_s": None, "drain_s": None,
              "settle_s": None}

    def elapsed() -> float:
        return time.monotonic() - start

    def settle_questions(force: bool = False) -> None:
        for item in list(pending):
            record, future, deadline = item
            now = time.monotonic()
            if future.done():
                response = future.result()
                latency = done_at.get(record["index"], now) - record.pop("_sent")
                record.update(responded=True, success=bool(response.success), message=response.message,
                              answer=response.answer[:300], latency_s=round(latency, 3),
                              node_latency_s=round(float(response.latency), 3), tokens_seen=int(response.tokens_seen),
                              cache_fill=int(response.cache_fill))
            elif now > deadline or force:
                record.update(responded=False, success=False, message="", answer="",
                              latency_s=round(now - record.pop("_sent"), 3))
                driver.query.remove_pending_request(future)
            else:
                continue
            pending.remove(item)
            keep(record)
            log(f"[{elapsed():7.1f} s] question {record['index']}: "
                + (f"answered in {record['latency_s']:.1f} s" if record["success"] else
                   f"refused: {record['message']}" if record["responded"] else "NO RESPONSE"))

    def take_sample(phase: str) -> dict:
        stats, stats_at = driver.latest_stats()
        status = proc_status(node.pid)
        t = elapsed()
        record = {"kind": "sample", "phase": phase, "elapsed_s": round(t, 1),
                  "rss_mb": round(status["VmRSS"], 1) if "VmRSS" in status else None,
                  "hwm_mb": round(status["VmHWM"], 1) if "VmHWM" in status else None,
                  "threads": status.get("Threads"), "open_files": open_files(node.pid),
                  "cpu_s": proc_cpu_seconds(node.pid), "node_alive": node.alive,
                  "stats_age_s": None if stats_at is None else round(time.monotonic() - stats_at, 2)}
        for field in STATS_FIELDS:
            value = getattr(stats, field, None) if stats is not None else None
            record[field] = value if isinstance(value, (bool, type(None))) else int(value)
        record.update(frames_published=frames_published, texts_published=texts_published,
                      questions_asked=len(questions), questions_pending=len(pending),
                      load_average_1min=round(os.getloadavg()[0], 2))
        try:
            mtime = node.memory_file.stat().st_mtime
            record["memory_file_bytes"] = node.memory_file.stat().st_size
            if not checkpoints or mtime != checkpoints[-1]:
                checkpoints.append(mtime)
        except OSError:
            record["memory_file_bytes"] = None
        record["checkpoints_seen"] = len(checkpoints)
        if stats is not None and stats.model_ready and extras["model_ready_after_s"] is None:
            extras["model_ready_after_s"] = round(t, 1)
        if stats is not None and stats.frames_ingested and extras["first_frame_ingested_after_s"] is None:
            extras["first_frame_ingested_after_s"] = round(t, 1)
        samples.append(record)
        keep(record)
        return record

    # Publish once the node listens (its subscriptions exist before the model has loaded, as a camera would find it).
    while not (driver.camera.get_subscription_count() and driver.text.get_subscription_count()):
        if not node.alive:
            raise RuntimeError(f"node exited with {node.proc.returncode} before subscribing:\n{node.log()[-3000:]}")
        if elapsed() > 60:
            raise RuntimeError(f"the node did not subscribe within 60 s:\n{node.log()[-3000:]}")
        time.sleep(0.05)
    log(f"[{elapsed():7.1f} s] node {node.pid} subscribed; streaming for {duration:.0f} s")

    # Phases: "run" (camera, texts, questions), "drain" (no new questions; the streams go on until every
    # question asked has its response or has passed its deadline), "settle" (streams stopped; the node
    # takes in what it still holds, 30 s at most). Samples are taken all along; the last one is "end".
    frame_period, now0 = 1.0 / fps, time.monotonic()
    next_frame, next_text = now0, now0
    next_question = start + question_every
    take_sample("run")
    next_sample = now0 + sample_every
    next_report = start + 60
    end = start + duration
    phase, phase_start = "run", now0
    while node.alive:
        now = time.monotonic()
        if phase == "run" and now >= end:
            phase, phase_start = "drain", now
        if phase == "drain" and not pending:
            extras["drain_s"] = round(now - phase_start, 1)
            phase, phase_start = "settle", now
        if phase == "settle":
            stats, stats_at = driver.latest_stats()
            if now - phase_start > 30 or (
                    stats is not None and stats_at > phase_start + 1.5 and not stats.texts_waiting
                    and not stats.frame_waiting and stats.texts_ingested + stats.inputs_rejected >= texts_published):
                extras["settle_s"] = round(now - phase_start, 1)
                break
        if phase != "settle" and now >= next_frame:
            driver.publish_frame(scene.frame(frames_published), time.time_ns())
            frames_published += 1
            # Late (a busy machine): the next frame a period from now, as a camera would, not a burst.
            next_frame = max(next_frame + frame_period, now)
        if phase != "settle" and now >= next_text:
            text, fact = text_message(texts_published)
            driver.publish_text(text)
            texts_published += 1
            last_fact = fact or last_fact
            next_text = max(next_text + text_every, now)
        if phase == "run" and now >= next_question:
            question = question_for(len(questions), last_fact)
            record = {"kind": "question", "index": len(questions), "asked_at_s": round(elapsed(), 1),
                      "question": question, "_sent": time.monotonic()}
            questions.append(record)
            future = driver.ask(question)
            future.add_done_callback(lambda _f, i=record["index"]: done_at.setdefault(i, time.monotonic()))
            pending.append((record, future, time.monotonic() + query_timeout + RESPONSE_GRACE))
            next_question += question_every
        settle_questions()
        if now >= next_sample:
            sample = take_sample(phase)
            next_sample = max(next_sample + sample_every, now)
            if now >= next_report:
                log(f"[{sample['elapsed_s']:7.1f} s] {phase}: rss {sample['rss_mb']} MiB, fill {sample['fill']}, "
                    f"frames {sample['frames_ingested']} in / {sample['frames_dropped']} dropped / "
                    f"{frames_published} sent, texts {sample['texts_ingested']}/{texts_published}, "
                    f"questions {len(questions)} ({len(pending)} waiting)")
                next_report += 60
        wake = [next_sample] + ([next_frame, next_text] if phase != "settle" else [now + 0.2])
        if phase == "run":
            wake.append(min(next_question, end))
        time.sleep(min(max(0.0, min(wake) - time.monotonic()), 0.05 if pending else 1.0))
    settle_questions(force=True)  # the node is gone: what is still waiting gets no response
    take_sample("end")
    extras["checkpoints_seen"] = len(checkpoints)
    return extras


def summarize(samples: list[dict], questions: list[dict], extras: dict, *, duration, fps, question_every,
              sample_every, query_timeout, params, domain_id, torch_threads=None) -> dict:
    after, rule = reference_after(duration)
    window = min(RSS_WINDOW, after)
    ready = [s for s in samples if s["rss_mb"] is not None and s["model_ready"] and s["frames_ingested"]]
    reference = next((s for s in ready if s["elapsed_s"] >= after), ready[0] if ready else None)
    last = samples[-1] if samples else {}
    summary = {"kind": "summary", "duration_s": duration, "elapsed_s": last.get("elapsed_s"), "fps": fps,
               "question_every_s": question_every, "sample_every_s": sample_every, "query_timeout_s": query_timeout,
               "node_params": json.dumps(dict(params, memory_file="<temporary folder>/memory.safetensors"),
                                         sort_keys=True), "ros_domain_id": domain_id,
               "model_ready_after_s": extras.get("model_ready_after_s"),
               "first_frame_ingested_after_s": extras.get("first_frame_ingested_after_s"),
               "rss_reference_rule": rule + ", once the model is loaded and frames are going in",
               "rss_reference_after_s": round(after, 1),
               "rss_window_s": round(window, 1),
               "rss_rule": "reference and end: median of the samples in the window from the reference sample and in "
                           "the last window (a checkpoint save briefly holds about 2.5 times the memory file); "
                           "within 2 percent: the end differs from the reference by at most 2 percent"}
    if reference is not None:
        later = [s for s in samples if s["elapsed_s"] >= reference["elapsed_s"] and s["rss_mb"] is not None]
        ref = median([s["rss_mb"] for s in later if s["elapsed_s"] <= reference["elapsed_s"] + window])
        end = median([s["rss_mb"] for s in later if s["elapsed_s"] >= later[-1]["elapsed_s"] - window])
        peak = max(s["rss_mb"] for s in later)
        summary.update(rss_reference_at_s=reference["elapsed_s"], rss_reference_mb=ref, rss_end_mb=end,
                       rss_first_sample_mb=reference["rss_mb"], rss_last_sample_mb=later[-1]["rss_mb"],
                       rss_max_after_reference_mb=peak, rss_min_after_reference_mb=min(s["rss_mb"] for s in later),
                       rss_change_relative=round((end - ref) / ref, 4),
                       rss_max_change_relative=round((peak - ref) / ref, 4),
                       rss_within_2_percent=abs(end - ref) / ref <= 0.02,
                       threads_reference=reference["threads"], threads_end=later[-1]["threads"],
                       threads_max=max(s["threads"] or 0 for s in later),
                       open_files_reference=reference["open_files"], open_files_end=later[-1]["open_files"],
                       open_files_max=max(s["open_files"] or 0 for s in later))
    else:
        summary.update(rss_reference_at_s=None, rss_reference_mb=None, rss_end_mb=last.get("rss_mb"),
                       rss_within_2_percent=False)
    summary["hwm_end_mb"] = max((s["hwm_mb"] for s in samples if s["hwm_mb"] is not None), default=None)
    answered = [q for q in questions if q.get("success")]
    refused = [q for q in questions if q.get("responded") and not q.get("success")]
    reasons: dict[str, int] = {}
    for q in refused:
        reasons[q["message"]] = reasons.get(q["message"], 0) + 1
    latencies = sorted(q["latency_s"] for q in answered)
    summary.update(
        questions_asked=len(questions), questions_answered=len(answered), questions_refused=len(refused),
        questions_refused_reasons="; ".join(f"{n} x {r!r}" for r, n in sorted(reasons.items())),
        questions_without_response=sum(not q.get("responded") for q in questions),
        question_latency_median_s=latencies[len(latencies) // 2] if latencies else None,
        question_latency_max_s=latencies[-1] if latencies else None)
    summary.update(extras)
    for field in ("frames_published", "frames_ingested", "frames_dropped", "texts_published", "texts_ingested",
                  "inputs_rejected", "queries_answered", "queries_failed", "tokens_seen", "fill", "capacity",
                  "kv_bytes", "cpu_s", "memory_file_bytes"):
        summary[field] = last.get(field)
    if last.get("cpu_s") and last.get("elapsed_s"):
        summary["node_cpu_share"] = round(last["cpu_s"] / last["elapsed_s"], 2)
    summary["max_texts_waiting"] = max((s["texts_waiting"] or 0 for s in samples), default=None)
    summary["max_queries_waiting"] = max((s["queries_waiting"] or 0 for s in samples), default=None)
    summary["fastdds_profile"] = Path(os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or "none").name
    summary["machine"] = extras.pop("machine", None) or "not recorded"
    param_threads = (params or {}).get("torch_threads")
    summary["node_torch_threads"] = (param_threads or torch_threads
                                     or f"default ({os.environ.get('OMP_NUM_THREADS') or os.cpu_count()})")
    summary["cpu_cores"] = os.cpu_count()
    summary["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    return summary
