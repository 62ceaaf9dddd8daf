"""Where and when through the node: route bags (bags/route_bag.py) replayed into the installed node over DDS, and
the node asked afterwards through `~/query` and `~/recall`, each answer judged against the drive's truth.

For each seed and setting, a route bag of `--duration` seconds is written (bags/route_bag.py: the robot's drive
round a warehouse floor, /tf with odometry that drifts and a localiser's map -> odom that corrects it, /tf_static,
narration that names no place), the node (`inf_mllm_node`, a process of its own, `use_sim_time`, `clock: wall`
in UTC so that the model reads times of day: the bag starts at 08:00:00, `frame_rate` 0, no descriptions, poses
through tf2 alone: `map_frame` map, `base_frame` base_link, no pose topic) is started, and `inf_mllm_replay
--lockstep` plays the bag into it (its /clock, /tf, /tf_static latched, /narration; the camera only with
`--frames`, so texts and tf by default) and asks every question of the drive at its end (`asked_s` = the bag's
end) through `~/query`. Then each question's words go to `~/recall`. The questions are the drive's
(`build_route(..., questions="every")`: every thing seen asked where_last, where_first, when_first, when_last
and how_long_ago, and never_seen for every thing not seen, those off the route and those not on the floor; then
seen_check, never_seen's questions about every thing seen, its control).

Judged, each on its own (not OR'ed), per kind:

- `answer_time`: when_first, when_last: the first time of day the answer writes (bags.stream_inputs.times_of_day)
  within 2 s of the sighting's wall-clock time; how_long_ago: the seconds the answer gives (every "N seconds /
  minutes / hours" in it added up; else a time of day in it, taken from the time asked) within 10 % of the
  expected seconds or 5 s, whichever is more;
- `evidence_stamp`: the heaviest evidence's stamp within 2 s of the sighting's (every kind but never_seen);
- `evidence_pose`: the heaviest evidence's pose (map) within 1 m of where the robot truly was at the sighting;
- `right_sighting`: for where_first, where_last, when_first and when_last about a thing seen more than once, the
  heaviest evidence's stamp is nearer the asked sighting than any other sighting of that thing, and within 2 s of
  it (`answer_right_sighting`: the same of the answer's time, when_* only);
- `not_seen`: never_seen: the answer says no ("no", "not", "never", "none", "nothing" or a word ending in "n't")
  and claims no time (no time of day in it) and does not begin with "yes";
- `said_seen`: seen_check: the answer does not say so of a thing seen (`not_seen` false): beside `not_seen`, what a
  memory that says "no" more often pays for it.

Beside them: the same of the heaviest evidence that has a stamp (`stamped_*`: an input, where the heaviest is the
system prompt, which has none), and of the first moment `~/recall` gives (`recall_*`); how often the system prompt
is the heaviest evidence; whether the evidence has a pose, and how far the evidence's pose is from the robot's true
pose at the evidence's own stamp (what tf2 gives the node, whatever was retrieved).

Settings: `archive` (the shipped settings), `no_archive` (archive_size 0: the cache alone; no evidence), `full` (a
cache that holds the whole bag: the ceiling); `loop`: the shipped settings with the bag played twice into one
node, the questions asked after each pass (the replay run twice back to back, each from the bag's start, which is
the jump back in time that `--loop` makes at its end; `--loop` itself plays on without end and asks in its first
pass only), with the node's refused inputs (`~/cache_stats` inputs_rejected) and pose clearings (/diagnostics
pose_history_cleared) after each pass. `no_when_prompt`: the shipped settings with `when_prompt` "" (a question that
asks when told the answer prompt, as before the when prompt existed). `no_check_seen`: the shipped settings with
`check_seen` off (every did-you-see question answered by the model, as before the check existed). `no_time_note`:
the shipped settings with `time_note` off (nothing restated after a question that asks when or how long ago).

`--names said` asks the same questions in the narration's words ("the pallet jack", not "the pump truck"; a
diagnostic, never the report): what is left to miss where the vocabulary is not.

Seeds are declared before they run: `--declare` writes the report and tuning seeds, the commit, the date and the
settings into the results file (`declared`), to be committed before the first report run; a report run whose
misses lead to a change makes its seeds tuning seeds (declare again, with new report seeds).

    python benchmarks/run.py where_when --declare                 # declare the seeds (then commit the file)
    python benchmarks/run.py where_when --seeds tune --settings archive --out where_when_route_tune.json
    python benchmarks/run.py where_when --seeds report --resume   # archive, no_archive, full; goes on where it stopped
    python benchmarks/run.py where_when --seeds 200001 --settings loop --resume   # the loop check, on one bag
    python benchmarks/run.py where_when --summary                 # the summary of the recorded runs

Results: results/where_when_route.json, {"declared", "records" (one per question and pass), "bags" (one per run of a
bag: times, the node's counters, tf_static received), "summary"}; the summary's cells are per set, setting and
pass, each score per kind with hits, n and its 95 % Wilson interval. Records are written after each bag, so that
`--resume` goes on from the last bag done.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import RESULTS, ROOT, wilson

from inf_mllm_ros.bags.route_scenario import SEEN_CHECK

OUT = "where_when_route.json"
TUNE_SEEDS = [0, 1, 2]
REPORT_SEEDS = [200001, 200002, 200003, 200004, 200005, 200006]
FULL_CACHE = 8192  # a 300 s bag's texts are about 3,000 tokens
SETTINGS = {"archive": {}, "no_archive": {"archive_size": 0}, "full": {"cache_size": FULL_CACHE}, "loop": {},
            "no_when_prompt": {"when_prompt": ""},  # the shipped settings, questions that ask when told the answer prompt
            "no_check_seen": {"check_seen": False},  # the shipped settings, every did-you-see left to the model
            "no_time_note": {"time_note": False}}  # the shipped settings, no moment restated after a when question
PASSES = {"loop": 2}
SEEN_KINDS = ("where_last", "where_first", "when_first", "when_last", "how_long_ago")
FIRST_LAST_KINDS = ("where_last", "where_first", "when_first", "when_last")
TIME_S, STAMP_S, POSE_M = 2.0, 2.0, 1.0
ELAPSED_SHARE, ELAPSED_S = 0.10, 5.0
NAMESPACE = "/where_when_route"
FQN = f"{NAMESPACE}/inf_mllm"
CAMERA = "/camera/image_raw/compressed"
# The shipped node settings but for: the model and cache named, bag time, the wall clock in UTC, every frame taken
# in lockstep, no descriptions (none competes with a question), no memory file, a long query timeout (a CPU).
NODE_PARAMS = {"use_sim_time": True, "clock": "wall", "time_zone": "UTC", "frame_rate": 0.0,
               "description_period": 0.0, "checkpoint_period": 0.0, "memory_file": "", "query_timeout": 1800.0,
               "pose_topic": "", "map_frame": "map", "base_frame": "base_link"}

# The options of a short run on the small models (run.py --smoke): one bag played twice, a question of three kinds.
SMOKE = ["--model", "smollm2", "--duration", "40", "--seeds", "0", "--settings", "loop", "--per-kind", "1",
         "--kinds", "where_first,when_last,never_seen,seen_check", "--max-new-tokens", "8", "--no-plot"]

NEGATIVE = re.compile(r"\b(no|not|never|none|nothing|nowhere)\b|n't\b", re.IGNORECASE)
ELAPSED = re.compile(r"(\d+(?:\.\d+)?)\s*(hours?|hrs?|minutes?|mins?|seconds?|secs?|s)\b", re.IGNORECASE)
UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}


# --- judging ------------------------------------------------------------------------------------------------------

def says_not_seen(answer: str) -> bool:
    """The answer says the thing was not seen: a negative word, no time of day, not a "yes"."""
    from inf_mllm_ros.bags.stream_inputs import times_of_day

    text = answer.strip()
    return bool(NEGATIVE.search(text)) and not times_of_day(text) and not text.lower().startswith("yes")


def elapsed_seconds(answer: str, asked_clock_s: float) -> float | None:
    """The seconds an answer says have passed: its "N seconds / minutes / hours" added up, else the time asked
    less the first time of day it writes; None where it says neither."""
    from inf_mllm_ros.bags.stream_inputs import times_of_day

    found = ELAPSED.findall(answer)
    if found:
        return sum(float(n) * UNIT_S[unit[0].lower()] for n, unit in found)
    written = times_of_day(answer)
    return asked_clock_s - written[0] if written else None


def elapsed_bound(expected_s: float) -> float:
    """How far an answer's "how long ago" may be from the truth and count: 10 % of it, or 5 s."""
    return max(ELAPSED_S, ELAPSED_SHARE * expected_s)


def nearest_sighting(stamp: float | None, sightings) -> int | None:
    """The index (in `sightings`) of the sighting nearest a stamp."""
    if stamp is None or not sightings:
        return None
    return min(range(len(sightings)), key=lambda i: abs(sightings[i].time_s - stamp))


def _moment(item: dict | None, start_s: float) -> tuple[float | None, list | None]:
    """An evidence entry's stamp (seconds from the bag's start) and pose."""
    if item is None:
        return None, None
    stamp = None if item.get("stamp") is None else item["stamp"] - start_s
    return stamp, item.get("pose")


def judged(question, scenario, answer: str, evidence: list, recalled: list, start_s: float) -> dict:
    """One question's answer, evidence and recall against the drive's truth (see the module docstring)."""
    from inf_mllm_ros.bags.stream_inputs import times_of_day
    from inf_mllm_ros.bags.warehouse_layout import SHIFT_START

    midnight = SHIFT_START.hour * 3600 + SHIFT_START.minute * 60 + SHIFT_START.second
    out: dict = {"evidence_n": len(evidence), "evidence_with_pose": sum(e.get("pose") is not None for e in evidence),
                 "evidence_top_is_stampless": bool(evidence) and evidence[0].get("stamp") is None}
    narration = [n.time_s for n in scenario.narration]
    stamps = [s for s in (_moment(e, start_s)[0] for e in evidence) if s is not None]
    out["evidence_on_narration"] = sum(min((abs(s - t) for t in narration), default=math.inf) < 0.05 for s in stamps)
    errors = []
    for e in evidence:
        stamp, pose = _moment(e, start_s)
        if stamp is not None and pose is not None:
            x, y, _ = (float(v) for v in scenario.pose_at(stamp))
            errors.append(math.hypot(pose[0] - x, pose[1] - y))
    out["evidence_pose_error_m"] = round(max(errors), 4) if errors else None  # against the truth at its own stamp
    if question.kind in ("never_seen", SEEN_CHECK):
        out["not_seen"] = says_not_seen(answer)
        return out
    sightings = scenario.sightings_of(question.thing)
    asked = next(i for i, s in enumerate(sightings) if s.time_s == question.expected["time_s"])
    truth = sightings[asked]
    out |= {"sightings": len(sightings), "sighting": asked, "truth_time_s": truth.time_s,
            "truth_xy": [truth.pose[0], truth.pose[1]]}
    stamped = next((e for e in evidence if e.get("stamp") is not None), None)  # an input, not the system prompt
    for name, item in (("evidence", evidence[0] if evidence else None), ("stamped", stamped),
                       ("recall", recalled[0] if recalled else None)):
        stamp, pose = _moment(item, start_s)
        out[f"{name}_stamp_s"] = None if stamp is None else round(stamp, 3)
        out[f"{name}_stamp_error_s"] = None if stamp is None else round(abs(stamp - truth.time_s), 3)
        out[f"{name}_xy"] = None if pose is None else [round(pose[0], 3), round(pose[1], 3)]
        out[f"{name}_distance_m"] = None if pose is None else round(math.hypot(pose[0] - truth.pose[0],
                                                                                pose[1] - truth.pose[1]), 3)
        picked = nearest_sighting(stamp, sightings)
        out[f"{name}_right_sighting"] = (None if picked is None else
                                         picked == asked and abs(stamp - truth.time_s) <= STAMP_S)
    written = times_of_day(answer)
    if question.kind in ("when_first", "when_last"):
        said = written[0] - midnight if written else None
        out["answer_time_s"] = said
        out["answer_time_error_s"] = None if said is None else round(abs(said - truth.time_s), 3)
        picked = nearest_sighting(said, sightings)
        out["answer_right_sighting"] = None if picked is None else picked == asked and abs(said - truth.time_s) <= TIME_S
    if question.kind == "how_long_ago":
        said = elapsed_seconds(answer, midnight + question.asked_s)
        expected = question.expected["seconds"]
        out["answer_elapsed_s"] = None if said is None else round(said, 3)
        out["answer_elapsed_error_s"] = None if said is None else round(abs(said - expected), 3)
    return out


def scores(record: dict) -> dict:
    """A record's scores, each True, False, or absent where it does not apply."""
    kind = record["kind"]
    out = {}

    def within(value, bound):
        return value is not None and value <= bound

    if kind == "never_seen":
        out["not_seen"] = record["not_seen"]
        return out
    if kind == SEEN_CHECK:
        out["said_seen"] = not record["not_seen"]
        return out
    if kind in ("when_first", "when_last"):
        out["answer_time"] = within(record["answer_time_error_s"], TIME_S)
    if kind == "how_long_ago":
        bound = elapsed_bound(record["expected"]["seconds"])
        out["answer_time"] = within(record["answer_elapsed_error_s"], bound)
    out["evidence_stamp"] = within(record["evidence_stamp_error_s"], STAMP_S)
    out["evidence_pose"] = within(record["evidence_distance_m"], POSE_M)
    out["stamped_stamp"] = within(record["stamped_stamp_error_s"], STAMP_S)
    out["stamped_pose"] = within(record["stamped_distance_m"], POSE_M)
    out["recall_stamp"] = within(record["recall_stamp_error_s"], STAMP_S)
    out["recall_pose"] = within(record["recall_distance_m"], POSE_M)
    if kind in FIRST_LAST_KINDS and record["sightings"] > 1:
        out["right_sighting"] = bool(record["evidence_right_sighting"])
        out["stamped_right_sighting"] = bool(record["stamped_right_sighting"])
        out["recall_right_sighting"] = bool(record["recall_right_sighting"])
        if kind.startswith("when"):
            out["answer_right_sighting"] = bool(record["answer_right_sighting"])
    return out


# --- the node and the caller ----------------------------------------------------------------------------------

class Caller:
    """The benchmark's rclpy node, in its own context and the node's domain: `~/recall`, the node's latest
    `~/cache_stats` and /diagnostics values, /tf_static as the node takes it (latched), and /clock when the replay
    is not running (the node's timers, its /diagnostics among them, run on bag time)."""

    def __init__(self, domain_id: int):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
        from rosgraph_msgs.msg import Clock

        from inf_mllm_interfaces.msg import CacheStats
        from inf_mllm_interfaces.srv import Recall
        from inf_mllm_ros.node.poses import TFMessage
        from inf_mllm_ros.node.transform_listener import TF_STATIC_QOS

        self._rclpy, self._Recall, self._Clock = rclpy, Recall, Clock
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node("where_when_caller", context=self.context)
        best_effort = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.BEST_EFFORT,
                                 durability=DurabilityPolicy.VOLATILE)
        self._lock = threading.Lock()
        self.stats = None
        self.diagnostics: dict[str, str] = {}
        self.tf_static = 0
        self.node.create_subscription(CacheStats, f"{FQN}/cache_stats", self._on_stats, best_effort)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, best_effort)
        if TFMessage is not None:
            self.node.create_subscription(TFMessage, "/tf_static", self._on_static, TF_STATIC_QOS)
        self.recall_client = self.node.create_client(Recall, f"{FQN}/recall")
        self.clock = self.node.create_publisher(Clock, "/clock", 10)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException

        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def _on_stats(self, msg) -> None:
        with self._lock:
            self.stats = msg

    def _on_diagnostics(self, msg) -> None:
        for status in msg.status:
            if status.name.startswith(f"{FQN}: memory"):
                with self._lock:
                    self.diagnostics = {kv.key: kv.value for kv in status.values} | {"message": status.message}

    def _on_static(self, msg) -> None:
        with self._lock:
            self.tf_static += 1

    def counters(self) -> dict:
        with self._lock:
            s, d = self.stats, dict(self.diagnostics)
        out = {"pose_history_cleared": int(d["pose_history_cleared"]) if "pose_history_cleared" in d else None,
               "pose_frame": d.get("pose_frame"), "diagnostics_message": d.get("message")}
        if s is not None:
            out |= {k: int(getattr(s, k)) for k in ("fill", "capacity", "tokens_seen", "tokens_evicted",
                                                     "texts_ingested", "frames_ingested", "frames_dropped",
                                                     "inputs_rejected", "archive_tokens", "queries_answered",
                                                     "queries_failed")}
        return out

    def tick_clock(self, from_ns: int, seconds: float = 1.5) -> None:
        """Bag time on /clock from `from_ns` for `seconds` at the wall's pace, so the node's timers run (its
        /diagnostics come on bag time)."""
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            msg = self._Clock()
            msg.clock.sec, msg.clock.nanosec = divmod(from_ns + int(elapsed * 1e9), 1_000_000_000)
            self.clock.publish(msg)
            time.sleep(0.05)

    def recall(self, text: str, limit: int, timeout: float) -> tuple[list[dict], float]:
        if not self.recall_client.wait_for_service(timeout_sec=timeout):
            raise RuntimeError(f"no {FQN}/recall service")
        done = threading.Event()
        started = time.monotonic()
        future = self.recall_client.call_async(self._Recall.Request(text=text, max_results=limit))
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise RuntimeError(f"no answer from {FQN}/recall in {timeout:g} s")
        r = future.result()
        if not r.success:
            raise RuntimeError(f"recall failed: {r.message}")
        moments = [{"stamp": m.stamp.sec + m.stamp.nanosec * 1e-9 if m.has_stamp else None, "kind": m.kind,
                    "source": m.source, "pose": [m.pose.position.x, m.pose.position.y, m.pose.position.z]
                    if m.has_pose else None, "frame_id": m.frame_id, "text": m.text, "weight": m.weight}
                   for m in r.moments]
        return moments, time.monotonic() - started

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        self._rclpy.try_shutdown(context=self.context)
        self._thread.join(5)


class Node:
    """The installed inf_mllm_node as a process with a parameters file, in the given domain."""

    def __init__(self, params: dict, folder: Path, env: dict):
        import yaml

        from inf_mllm_ros.testing.node_process import node_executable

        params_file = folder / "params.yaml"
        params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
        self.log_path = folder / "node.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(node_executable()), "--ros-args", "--params-file", str(params_file),
                                      "-r", f"__ns:={NAMESPACE}"], stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def replay_executable() -> Path:
    from ament_index_python.packages import get_package_prefix

    return Path(get_package_prefix("inf_mllm_ros")) / "lib" / "inf_mllm_ros" / "inf_mllm_replay"


# --- one bag --------------------------------------------------------------------------------------------------

def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def code_state() -> dict:
    """The commit the benchmark runs from, and the package files changed from it (uncommitted), if any."""
    changed = [line[3:] for line in git("status", "--porcelain", "--", "inf_mllm_ros", "inf_mllm_interfaces",
                                        "benchmarks/where_when.py").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted": changed}


def chosen_questions(scenario, per_kind: int | None, kinds: str = "") -> list:
    """The drive's questions (of `kinds` where given), the first `per_kind` of each kind where given."""
    wanted = set(kinds.split(",")) if kinds else None
    counts: dict[str, int] = {}
    out = []
    for q in scenario.questions:
        if wanted is not None and q.kind not in wanted:
            continue
        if not per_kind or counts.get(q.kind, 0) < per_kind:
            counts[q.kind] = counts.get(q.kind, 0) + 1
            out.append(q)
    return out


def run_bag(seed: int, setting: str, args, set_name: str, state: dict) -> tuple[list[dict], list[dict]]:
    """One route bag into a fresh node with one setting, played once (twice for `loop`); a record per question and
    pass, and one per pass of the bag."""
    import yaml

    from inf_mllm_ros.bags.route_bag import START_NS, write_route_bag
    from inf_mllm_ros.bags.route_scenario import build_route

    scenario = build_route(seed, args.duration, questions="every", names=args.names)
    questions = chosen_questions(scenario, args.per_kind, args.kinds)
    cache = FULL_CACHE if setting == "full" else args.cache
    params = NODE_PARAMS | {"model": args.model, "device": args.device, "dtype": args.dtype, "cache_size": cache,
                            "max_new_tokens": args.max_new_tokens, "torch_threads": args.threads} | SETTINGS[setting]
    domain = int(os.environ.get("ROS_DOMAIN_ID") or os.getpid() % 100 + 1)
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
               PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0", RCUTILS_COLORIZED_OUTPUT="0")
    start_s = START_NS / 1e9
    records, bags = [], []
    with tempfile.TemporaryDirectory(prefix=f"where_when_{seed}_{setting}_") as scratch:
        folder = Path(scratch)
        started = time.monotonic()
        # Without --frames the camera is not played: a few frames a second are written all the same (the bag's
        # writer needs some), cheaply small.
        summary = write_route_bag(folder / "bag", seed, args.duration, args.fps if args.frames else 0.2,
                                  (160, 120) if args.frames else (32, 24))
        written_s = time.monotonic() - started
        questions_file = folder / "questions.yaml"
        questions_file.write_text(yaml.safe_dump([{"time_s": float(args.duration), "question": q.question}
                                                  for q in questions], sort_keys=False))
        topics = ["/tf", "/tf_static", "/narration"] + ([CAMERA] if args.frames else [])
        node = Node(params, folder, env)
        caller = Caller(domain)
        try:
            for run_pass in range(1, PASSES.get(setting, 1) + 1):
                answers_file = folder / f"answers_{run_pass}.json"
                command = [str(replay_executable()), str(summary.path), "--lockstep", "--node", FQN,
                           "--topics", *topics, "--questions", str(questions_file), "--answers-out",
                           str(answers_file), "--max-new-tokens", str(args.max_new_tokens), "--timeout",
                           str(args.timeout), "--wait", "900"]
                before = caller.counters()
                began = time.monotonic()
                with open(folder / f"replay_{run_pass}.log", "w") as log:
                    done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          timeout=args.timeout * (len(questions) + 10))
                replay_s = time.monotonic() - began
                replay_log = (folder / f"replay_{run_pass}.log").read_text(errors="replace")
                if not answers_file.exists():  # a failed query is recorded (success false); no answers is not
                    raise RuntimeError(f"replay of seed {seed} ({setting}, pass {run_pass}) failed ({done.returncode})"
                                       f":\n{replay_log[-3000:]}\nnode log:\n{node.log_tail()}")
                answers = json.loads(answers_file.read_text())
                end_ns = START_NS + int(args.duration * 1e9)
                caller.tick_clock(end_ns)  # the node's /diagnostics after the pass
                recalled, recall_s = [], []
                for q in questions:
                    moments, seconds = caller.recall(q.question, 5, args.timeout)
                    recalled.append(moments)
                    recall_s.append(seconds)
                caller.tick_clock(end_ns + int(1.5e9))
                after = caller.counters()
                bag = {"seed": seed, "set": set_name, "setting": setting, "pass": run_pass, "model": args.model,
                       "cache": cache, "duration_s": args.duration, "frames": args.frames, "names": args.names,
                       **state, "questions": len(questions), "write_s": round(written_s, 1), "replay_s": round(replay_s, 1),
                       "messages_played": _played(replay_log), "tf_static_received": caller.tf_static,
                       "counters_before": before, "counters": after,
                       "inputs_rejected_in_pass": (after.get("inputs_rejected", 0) - before.get("inputs_rejected", 0)),
                       "narration_lines": len(scenario.narration), "sightings": len(scenario.sightings),
                       "date": datetime.date.today().isoformat(), "machine": _machine(args.threads)}
                bags.append(bag)
                for q, a, moments, seconds in zip(questions, answers, recalled, recall_s):
                    if a["question"] != q.question:
                        raise RuntimeError(f"answers out of order: {a['question']!r} for {q.question!r}")
                    record = {"seed": seed, "set": set_name, "setting": setting, "pass": run_pass,
                              "model": args.model, "cache": cache, "frames": args.frames, "names": args.names,
                              "kind": q.kind, "thing": q.thing, "question": q.question, "expected": q.expected,
                              "asked_s": q.asked_s, "success": a["success"], "answer": a["answer"],
                              "message": a["message"], "ask_s": round(a["latency"], 3),
                              "recall_s": round(seconds, 4), "evidence": a["evidence"][:3],
                              "recalled": moments[:1],
                              **judged(q, scenario, a["answer"], a["evidence"], moments, start_s)}
                    record["scores"] = scores(record)
                    records.append(record)
                print(json.dumps({k: bag[k] for k in ("seed", "setting", "pass", "questions", "replay_s",
                                                      "tf_static_received", "inputs_rejected_in_pass")}
                                 | {"pose_history_cleared": after.get("pose_history_cleared"),
                                    "scores": _brief(records, run_pass)}), flush=True)
        finally:
            caller.close()
            node.stop()
    return records, bags


def _played(log: str) -> int | None:
    found = re.search(r"(\d+) messages played", log)
    return int(found.group(1)) if found else None


def _machine(threads: int) -> str:
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), node torch_threads {threads}"


def _brief(records: list[dict], run_pass: int) -> dict:
    out: dict[str, list[int]] = {}
    for r in records:
        if r["pass"] == run_pass:
            for name, hit in r["scores"].items():
                out.setdefault(name, [0, 0])
                out[name][0] += bool(hit)
                out[name][1] += 1
    return {k: f"{h}/{n}" for k, (h, n) in out.items()}


# --- summary ------------------------------------------------------------------------------------------------------

def _rate(hits: int, n: int) -> dict:
    low, high = wilson(hits, n)
    return {"fraction": round(hits / n, 3) if n else None, "hits": hits, "n": n,
            "interval_95": [round(low, 3), round(high, 3)]}


def cell(records: list[dict]) -> dict:
    """Each score per kind, and the targets' groupings, of one set, setting and pass."""
    out: dict = {"per_kind": {}}
    for kind in (*SEEN_KINDS, "never_seen", SEEN_CHECK):
        rs = [r for r in records if r["kind"] == kind]
        names = sorted({n for r in rs for n in r["scores"]})
        out["per_kind"][kind] = {n: _rate(sum(bool(r["scores"][n]) for r in rs if n in r["scores"]),
                                          sum(n in r["scores"] for r in rs)) for n in names}

    def pooled(name: str, kinds) -> dict:
        rs = [r for r in records if r["kind"] in kinds and name in r["scores"]]
        return _rate(sum(bool(r["scores"][name]) for r in rs), len(rs))

    out["targets"] = {
        "answer_time_when_within_2s": pooled("answer_time", ("when_first", "when_last")),
        "evidence_pose_within_1m": pooled("evidence_pose", SEEN_KINDS),
        "last_first_right": pooled("right_sighting", FIRST_LAST_KINDS),
        "never_seen_not_seen": pooled("not_seen", ("never_seen",)),
    }
    out["also"] = {
        "evidence_stamp_within_2s": pooled("evidence_stamp", SEEN_KINDS),
        "how_long_ago_within_10pc_or_5s": pooled("answer_time", ("how_long_ago",)),
        "seen_check_said_seen": pooled("said_seen", (SEEN_CHECK,)),
        "answer_right_sighting_when": pooled("answer_right_sighting", ("when_first", "when_last")),
        "stamped_evidence_pose_within_1m": pooled("stamped_pose", SEEN_KINDS),
        "stamped_evidence_stamp_within_2s": pooled("stamped_stamp", SEEN_KINDS),
        "stamped_last_first_right": pooled("stamped_right_sighting", FIRST_LAST_KINDS),
        "recall_pose_within_1m": pooled("recall_pose", SEEN_KINDS),
        "recall_stamp_within_2s": pooled("recall_stamp", SEEN_KINDS),
        "recall_last_first_right": pooled("recall_right_sighting", FIRST_LAST_KINDS),
        "system_prompt_heaviest": _rate(sum(bool(r["evidence_n"]) and r.get("evidence_top_is_stampless", False)
                                            for r in records), len(records)),
    }
    with_evidence = [r for r in records if r["evidence_n"]]
    errors = [r["evidence_pose_error_m"] for r in records if r.get("evidence_pose_error_m") is not None]
    out["evidence"] = {
        "answers_with_evidence": _rate(len(with_evidence), len(records)),
        "entries_with_pose": _rate(sum(r["evidence_with_pose"] for r in records),
                                   sum(r["evidence_n"] for r in records)),
        "pose_error_vs_truth_at_stamp_m_max": round(max(errors), 3) if errors else None,
        "failed_queries": sum(not r["success"] for r in records),
    }
    if records:
        out["ask_s_median"] = round(statistics.median(r["ask_s"] for r in records), 2)
        out["recall_s_median"] = round(statistics.median(r["recall_s"] for r in records), 3)
    return out


TARGETS = {"answer_time_when_within_2s": 0.90, "evidence_pose_within_1m": 0.90, "last_first_right": 0.85,
           "never_seen_not_seen": 0.80}


def summary(records: list[dict], bags: list[dict]) -> dict:
    """Every set, setting and pass's cell; on top, the report set with the shipped settings against the targets,
    and the loop check."""
    cells = {}
    for key in sorted({(r["set"], r["setting"], r["pass"]) for r in records}):
        cells[f"{key[0]}/{key[1]}/pass{key[2]}"] = cell([r for r in records
                                                           if (r["set"], r["setting"], r["pass"]) == key])
    headline = cells.get("report/archive/pass1", {}).get("targets", {})
    out: dict = {"set": "report", "setting": "archive",
                 "seeds": sorted({r["seed"] for r in records if r["set"] == "report" and r["setting"] == "archive"}),
                 "targets": {name: {"target": goal, "fraction": (headline.get(name) or {}).get("fraction"),
                                    "n": (headline.get(name) or {}).get("n"),
                                    "met": None if not headline.get(name) or not headline[name]["n"]
                                    else headline[name]["fraction"] >= goal}
                             for name, goal in TARGETS.items()}}
    loops = [b for b in bags if b["setting"] == "loop"]
    if loops:
        out["loop"] = []
        for seed in sorted({b["seed"] for b in loops}):
            passes = sorted((b for b in loops if b["seed"] == seed), key=lambda b: b["pass"])
            entry = {"seed": seed, "passes": []}
            for b in passes:
                cellname = f"{b['set']}/loop/pass{b['pass']}"
                entry["passes"].append({"pass": b["pass"], "inputs_rejected_in_pass": b["inputs_rejected_in_pass"],
                                        "pose_history_cleared": b["counters"].get("pose_history_cleared"),
                                        "targets": {k: v["fraction"] for k, v in
                                                    cells.get(cellname, {}).get("targets", {}).items()}})
            out["loop"].append(entry)
    out["cells"] = cells
    return out


# --- the results file -----------------------------------------------------------------------------------------

def read_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write_results(path: Path, doc: dict) -> None:
    doc["summary"] = summary(doc.get("records", []), doc.get("bags", []))
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def declare(path: Path, args) -> None:
    """Write the report and tuning seeds, the commit and the settings before any report run; the declaration in
    force before it, if any, is kept in `declared_before`."""
    doc = read_results(path)
    report = [int(s) for s in args.report_seeds.split(",")]
    tuning = [int(s) for s in args.tuning_seeds.split(",")]
    if set(report) & set(tuning):
        raise SystemExit("a seed cannot be both a report and a tuning seed")
    # A seed that ran as a report seed can only stay one (more seeds declared beside it); never be declared anew.
    ran = {r["seed"] for r in doc.get("records", []) if r["set"] == "report"}
    kept = set(doc.get("declared", {}).get("report_seeds", ()))
    if (ran & set(report)) - kept or (ran & kept) - set(report):
        raise SystemExit(f"seeds {sorted(ran)} ran as report seeds already: keep them, and draw new ones beside them")
    if "declared" in doc:
        doc.setdefault("declared_before", []).append(doc["declared"])
    state = code_state()
    doc["declared"] = {"report_seeds": report, "tuning_seeds": tuning, "loop_seed": report[0], "commit": state["commit"],
                       "uncommitted": state["uncommitted"], "date": datetime.date.today().isoformat(),
                       "settings": {k: v for k, v in SETTINGS.items()}, "node_params": NODE_PARAMS,
                       "model": args.model, "cache": args.cache, "dtype": args.dtype, "duration_s": args.duration,
                       "frames": args.frames, "questions": "every (build_route questions='every')",
                       "max_new_tokens": args.max_new_tokens,
                       "judging": {"answer_time_s": TIME_S, "evidence_stamp_s": STAMP_S, "evidence_pose_m": POSE_M,
                                   "how_long_ago": f"within {ELAPSED_SHARE:.0%} or {ELAPSED_S:g} s",
                                   "not_seen": "a negative word, no time of day, not beginning with yes"},
                       "targets": TARGETS}
    doc.setdefault("records", [])
    doc.setdefault("bags", [])
    write_results(path, doc)
    print(json.dumps(doc["declared"], indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="onevision-qwen2.5-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of each route bag")
    p.add_argument("--frames", action="store_true", help="play the camera topic too (every frame goes in)")
    p.add_argument("--fps", type=float, default=2.0, help="camera frames a second in the bag, with --frames")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--per-kind", type=int, default=0, help="ask only the first N questions of each kind (0: all)")
    p.add_argument("--kinds", default="", help="ask only these kinds, separated by commas (default: every kind)")
    p.add_argument("--seeds", default="tune", help="tune, report, or seeds separated by commas")
    p.add_argument("--names", default="asked", choices=("asked", "said"),
                   help="the questions' own names of things (other words than the narration's), or the narration's")
    p.add_argument("--settings", default="archive,no_archive,full", help="of: " + ", ".join(SETTINGS))
    p.add_argument("--threads", type=int, default=2, help="the node's torch_threads")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one input or one answer")
    p.add_argument("--resume", action="store_true", help="keep the recorded bags, run the rest")
    p.add_argument("--summary", action="store_true", help="only print the summary of the recorded runs")
    p.add_argument("--declare", action="store_true", help="declare --report-seeds and --tuning-seeds, then stop")
    p.add_argument("--report-seeds", default=",".join(map(str, REPORT_SEEDS)))
    p.add_argument("--tuning-seeds", default=",".join(map(str, TUNE_SEEDS)))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    path = RESULTS / args.out
    if args.declare:
        declare(path, args)
        return
    doc = read_results(path)
    declared = doc.get("declared", {})
    report_seeds = declared.get("report_seeds", REPORT_SEEDS)
    tuning_seeds = declared.get("tuning_seeds", TUNE_SEEDS)
    if not args.summary:
        seeds = {"tune": tuning_seeds, "report": report_seeds}.get(args.seeds)
        seeds = seeds or [int(s) for s in args.seeds.split(",")]
        if any(s in report_seeds for s in seeds) and not declared:
            raise SystemExit("declare the report seeds first (--declare), and commit the results file")
        settings = args.settings.split(",")
        unknown = [s for s in settings if s not in SETTINGS]
        if unknown:
            raise SystemExit(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
        if not args.resume:
            doc["records"], doc["bags"] = [], []
        doc.setdefault("records", [])
        doc.setdefault("bags", [])
        state = code_state()
        done = {(b["seed"], b["setting"]) for b in doc["bags"]}
        for seed in seeds:
            set_name = "report" if seed in report_seeds else "tune" if seed in tuning_seeds else "other"
            for setting in settings:
                if (seed, setting) in done:
                    continue
                started = time.monotonic()
                records, bags = run_bag(seed, setting, args, set_name, state)
                doc["records"] += records
                doc["bags"] += bags
                write_results(path, doc)
                print(f"seed {seed} {setting}: {len(records)} records in {time.monotonic() - started:.0f} s",
                      flush=True)
    else:
        doc.setdefault("records", [])
        doc.setdefault("bags", [])
        doc["summary"] = summary(doc["records"], doc["bags"])
    result = doc.get("summary") or summary(doc["records"], doc["bags"])
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}, indent=1))
    for name, figures in result["cells"].items():
        print(name, json.dumps({k: f"{v['hits']}/{v['n']}" for k, v in figures["targets"].items()}))
    if doc["records"] and not args.no_plot:
        plot(doc["records"], path.with_suffix(".png"))


def plot(records: list[dict], path: Path) -> None:
    """A report seed's route (the truth) and each 'where' question's heaviest evidence (green: within 1 m of where
    the robot was), with the archive."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from inf_mllm_ros.bags.route_scenario import build_route

    chosen = [r for r in records if r["set"] == "report" and r["setting"] == "archive"] or records
    seed = chosen[0]["seed"]
    where = [r for r in chosen if r["seed"] == seed and r["pass"] == 1 and r["kind"].startswith("where")]
    duration = chosen[0]["asked_s"]
    scenario = build_route(seed, duration)
    t = np.linspace(0.0, duration, 2000)
    x, y, _ = scenario.pose_at(t)
    fig, ax = plt.subplots(figsize=(8, 6.5))
    for rack in scenario.racks:
        ax.add_patch(plt.Rectangle((rack.x0, rack.y0), rack.x1 - rack.x0, rack.y1 - rack.y0, color="lightgrey"))
    ax.plot(x, y, color="grey", alpha=0.5, linewidth=1, label="route (truth)")
    for r in where:
        tx, ty = r["truth_xy"]
        ax.plot(tx, ty, "+", color="black")
        if r["evidence_xy"] is not None:
            near = r["evidence_distance_m"] <= POSE_M
            ax.plot(*r["evidence_xy"], "o", color="tab:green" if near else "tab:red", markersize=8, alpha=0.6)
            ax.plot([tx, r["evidence_xy"][0]], [ty, r["evidence_xy"][1]], color="tab:red", linewidth=0.6,
                    alpha=0 if near else 0.7)
    ax.set_aspect("equal")
    ax.set_xlabel("x (m, map)")
    ax.set_ylabel("y (m, map)")
    ax.set_title(f"seed {seed}: 'where' questions, the heaviest evidence (green: within 1 m of the robot, +)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
