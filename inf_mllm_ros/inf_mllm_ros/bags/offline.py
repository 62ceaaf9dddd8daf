"""Run the engine over a rosbag2 bag without ROS, answer questions at bag times, and report.

    inf_mllm_offline BAG [--params node.yaml] [--questions questions.yaml | --ask "T:question" ...]
                     [--model M] [--cache-size N] [--policy P] [--attention-bias B] [--out DIR]

Messages are taken in bag-time order and mapped to the model exactly as the node maps them when
the bag is replayed into it in lockstep (see :mod:`inf_mllm_ros.bags.stream_inputs`), so with the same
settings (``--params`` reads the node's own parameters file) the greedy answers are the node's.
Writes ``log.jsonl`` (one record per input and per answer, with cache figures), ``report.md``
(answers against the expected words, memory, settings) and ``plot.png`` into ``--out``; with a `pose_topic` in the
bag (the sample bags' ``/odom`` with ``pose_topic: /odom``), each input carries the robot's pose at its time, as in
the node, and ``map.png`` shows the route and where each answer's heaviest evidence was.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from ..engine.value_rules import as_declared
from ..input_rules import StreamClock
from ..settings import BY_NAME, DEFAULTS, PARAMETERS, load_settings, model_threads, value_problem
from ..settings import stream_config
from .bag_io import BagError
from .report import RunResult, mib, write_map, write_plot, write_report
from .stream_inputs import (
    Question,
    chosen_questions,
    node_namespace,
    open_selected,
    parse_remaps,
    pose_source,
    questions_due,
    stream_inputs,
    transform_sources,
)

PROG = "inf_mllm_offline"
# Parameters rclpy declares on every node: accepted in a params file, not the engine's.
ROS_NODE_PARAMETERS = {"use_sim_time", "start_type_description_service"}
STATS_FIELDS = ("capacity", "fill", "tokens_seen", "tokens_evicted", "evictions", "frames_ingested", "pinned_held",
                "texts_ingested", "kv_bytes", "cache_bytes", "archive_tokens", "archive_blocks", "archive_bytes")


class UsageError(Exception):
    """Bad arguments or files; exit status 2."""


# --- settings ------------------------------------------------------------------------------------

def read_params_file(path: str | Path) -> dict:
    """The ``ros__parameters`` of a node parameters YAML (the first node entry, e.g. ``/**``)."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: cannot read parameters: {exc}") from None
    if isinstance(doc, dict):
        for entry in doc.values():
            if isinstance(entry, dict) and isinstance(entry.get("ros__parameters"), dict):
                return dict(entry["ros__parameters"])
    raise UsageError(f"{path}: no '<node>: ros__parameters:' mapping in it")


def resolve_settings(args: argparse.Namespace) -> dict:
    """Command line over params file over the node's defaults, each value checked as the node checks it.

    A params file key that is not a node parameter is refused: the node would ignore it, so taking it
    here would build another engine from the same file.
    """
    settings = dict(DEFAULTS)  # the node's defaults, for what neither the command line nor a params file gives
    given = {}
    if args.params:
        given.update(read_params_file(args.params))
    cli = {"model": args.model, "device": args.device, "dtype": args.dtype, "cache_size": args.cache_size,
           "eviction_policy": args.policy, "chunk_size": args.chunk_size,
           "max_frame_pixels": args.max_frame_pixels, "max_new_tokens": args.max_new_tokens,
           "frame_rate": args.frame_rate}
    cli.update({p.name: getattr(args, p.name) for p in PARAMETERS if p.policy_knob})
    given.update({k: v for k, v in cli.items() if v is not None})
    for key, value in given.items():
        if key in ROS_NODE_PARAMETERS or key.startswith("qos_overrides"):
            continue  # every ROS node has these; they do not shape the engine
        problem = value_problem(key, value)
        if problem:
            raise UsageError(f"{args.params + ': ' if args.params and key not in cli else ''}{problem}")
        settings[key] = as_declared(value, BY_NAME[key].type)
    return settings


def checked_config(settings: dict):
    """The StreamConfig the node builds from the same parameters; UsageError if they do not make one."""
    try:
        return stream_config(settings)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad settings: {exc}") from None


# --- the run --------------------------------------------------------------------------------------

def evidence_errors(question: Question, evidence: list, offset_s: float) -> dict:
    """How far an answer's heaviest evidence is from the moment and the place the question is about, where it
    says: seconds (`offset_s`: the stream's time 0 from the bag's start) and metres in the plane."""
    out = {}
    top = evidence[0] if evidence else None
    if question.about_s is not None:
        out["evidence_time_error_s"] = (None if top is None or top.stamp is None
                                        else round(abs(top.stamp + offset_s - question.about_s), 3))
    if question.place_xy is not None:
        out["evidence_distance_m"] = (None if top is None or top.pose is None
                                      else round(top.pose.distance_to(*question.place_xy), 3))
    return out


def memory_now() -> dict:
    """Resident memory of this process now and at its peak, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = peak
    return {"rss_bytes": rss, "peak_rss_bytes": peak}


def run_offline(bag_path: str | Path, questions: Sequence[Question], settings: dict, *,
                remaps: dict[str, str] | None = None, topics: Sequence[str] | None = None, node: str = "/inf_mllm",
                adapter=None, progress: bool = False, log_path: str | Path | None = None,
                echo=None) -> RunResult:
    """Feed the bag's node inputs to a fresh KVStream in bag order, answering questions when due.

    ``node``: the node whose inputs the bag's topics are taken as (its namespace decides which names reach
    it). ``adapter``: a model already loaded (otherwise ``settings['model']`` is loaded). ``echo`` is
    called with a line for each answer and notice. Raises BagError, ModelLoadError, UsageError.
    """
    from ..engine.models.adapters import FramesNotSupportedError
    from ..engine.poses import PoseRefusedError
    from ..robot_poses import RobotPoses
    from ..engine.runtime.stream import KVStream

    echo = echo or (lambda line: None)
    started = time.monotonic()
    skipped: list[str] = []
    bag, topic_types, kinds = open_selected(bag_path, remaps or parse_remaps([]), topics,
                                            namespace=node_namespace(node), notice=skipped.append)
    result = RunResult()
    result.notices += skipped
    for line in skipped:
        echo(f"note: {line}")
    counts = result.counts = {"frames": 0, "texts": 0, "rejected": 0, "frames_skipped": 0, "frames_dropped": 0,
                              "answers": 0, "poses": 0, "poses_refused": 0, "transforms": 0, "pose_jumps": 0}
    try:
        pose_topic = pose_source(topic_types, remaps or parse_remaps([]), str(settings.get("pose_topic") or ""),
                                 node_namespace(node))
    except BagError:
        bag.close()
        raise
    # The node's pose rules (node/poses.py): the robot's base frame through the bag's /tf and /tf_static, else the
    # pose topic's, in one frame, the pose at an input's time; a jump back in time clears them.
    transform_topics = transform_sources(topic_types, remaps or parse_remaps([]))
    poses = RobotPoses(str(settings.get("pose_frame") or ""), float(settings.get("pose_tolerance", 0.5)),
                       str(settings.get("map_frame", "map")), str(settings.get("base_frame", "base_link")))
    log = open(log_path, "w", encoding="utf-8") if log_path else None

    def emit(record: dict) -> None:
        result.records.append(record)
        if log:
            log.write(json.dumps(record, ensure_ascii=False) + "\n")
            log.flush()

    try:
        config, result.settings = checked_config(settings), dict(settings)
        if adapter is None:
            from ..engine.models.loading import load_model, use_torch_threads

            use_torch_threads(model_threads(settings))  # as the node's engine does
            adapter = load_model(settings["model"], revision=settings.get("model_revision", ""),
                                 **load_settings(settings))
        stream = KVStream(adapter, config)
        result.model = {k: str(v) for k, v in adapter.describe().items()}
        if adapter.notice:
            result.notices.append(adapter.notice)
        duration = (bag.end_ns - 1 - bag.start_ns) / 1e9 if bag.message_count else 0.0
        result.bag = {"path": str(bag.path), "duration_s": duration, "messages": bag.message_count,
                      "topics": {t: {"type": topic_types[t], "count": bag.topics[t].count,
                                     "input": "pose" if t == pose_topic else kinds.get(t, "")}
                                 for t in topic_types}}
        emit({"type": "settings", "bag": result.bag, "settings": result.settings, "model": result.model,
              "config": asdict(config), "questions": [asdict(q) for q in questions]})

        def stats() -> dict:
            s = stream.stats().as_dict()
            return {k: s[k] for k in STATS_FIELDS} | memory_now()

        def answer(q: Question, bag_time: float) -> None:
            # Asked at its own bag time, in stream time (how long ago counts from it), once the clock has started.
            asked_at = clock.time_of(bag.start_ns / 1e9 + q.time_s)
            ans = stream.ask(q.question, max_new_tokens=config.max_new_tokens, asked_at=asked_at)
            record = {"type": "answer", "bag_time": bag_time, "time_s": q.time_s, "question": q.question,
                      "expected": q.expected, "needs_vision": q.needs_vision, "kind": q.kind, "answer": ans.text,
                      "correct": q.matches(ans.text), "retrieved_tokens": ans.retrieved_tokens,
                      **evidence_errors(q, ans.evidence, (clock.origin or 0.0) - bag.start_ns / 1e9),
                      "evidence": [{"stamp": e.stamp, "kind": e.kind, "source": e.source, "text": e.text,
                                    "weight": round(e.weight, 3),
                                    "pose": None if e.pose is None else list(e.pose.as_tuple())}
                                   for e in ans.evidence],
                      "tokens_generated": ans.tokens_generated, "seconds": ans.latency, **stats()}
            if ans.retrieved_tokens:
                # The same question from the cache alone, for the report (the memory is unchanged by either).
                budget = stream.reconfigure(retrieve_tokens=0)
                try:
                    alone = stream.ask(q.question, max_new_tokens=config.max_new_tokens, asked_at=asked_at)
                finally:
                    stream.reconfigure(**budget)
                record.update(answer_without_archive=alone.text, correct_without_archive=q.matches(alone.text))
            emit(record)
            result.answers.append(record)
            counts["answers"] += 1
            echo(f"[{q.time_s:6.1f} s] Q: {q.question}\n           A: {ans.text}{q.mark(record['correct'])}")

        total = sum(bag.topics[t].count for t in kinds)  # the bar counts inputs, not poses
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="msg", desc=Path(bag_path).name, file=sys.stderr, dynamic_ncols=True)
            echo = lambda line: bar.write(line, file=sys.stdout)  # noqa: E731  (lines above the bar)
        def take_poses(item) -> None:
            """A pose of the pose topic, or a /tf message's transforms, into the robot's poses."""
            kept = [(item.clock_s, *item.data)] if item.kind == "pose" else item.data
            for entry in kept:
                try:
                    if item.kind == "pose":
                        jumped = poses.add_pose(*entry)
                        counts["poses"] += 1
                        result.route.append((item.bag_time, entry[1].x, entry[1].y))
                    else:
                        parent, child, pose, stamp, static = entry
                        jumped = poses.add_transform(parent, child, stamp, pose, static=static)
                        counts["transforms"] += 1
                        where = poses.at(stamp) if child == poses.base_frame else None
                        if where is not None:  # the route as tf2 puts it, for the map
                            result.route.append((item.bag_time, where.x, where.y))
                    result.route_frame = poses.frame_id or result.route_frame
                except PoseRefusedError as exc:
                    counts["poses_refused"] += 1
                    emit({"type": "pose_refused", "bag_time": item.bag_time, "reason": str(exc)})
                    continue
                if jumped:
                    counts["pose_jumps"] += 1
                    emit({"type": "pose_jump", "bag_time": item.bag_time, "seconds": jumped})

        asked, bag_time = 0, 0.0
        frames_ok = True
        clock = StreamClock()
        emit({"type": "start", "bag_time": 0.0, **stats()})
        for item in stream_inputs(bag.messages(list(kinds) + ([pose_topic] if pose_topic else [])
                                               + list(transform_topics)), kinds,
                                  bag.start_ns, max_text_chars=int(settings["max_text_chars"]),
                                  max_decoded_pixels=int(settings["max_decoded_pixels"]),
                                  frame_rate=float(settings["frame_rate"]), clock=clock, pose_topic=pose_topic,
                                  transform_topics=transform_topics):
            if item.kind in ("pose", "transforms"):
                take_poses(item)
                continue
            for q in questions_due(questions, asked, item.bag_time):
                answer(q, bag_time)
                asked += 1
            bag_time = item.bag_time
            if stream.time_origin is None:  # as the node does: the memory's clock starts at its first input
                stream.time_origin = clock.origin
            record: dict[str, Any] = {"type": item.kind, "topic": item.topic, "bag_time": item.bag_time,
                                      "stamp": item.stamp}
            t0 = time.monotonic()
            if item.kind == "rejected":
                counts["rejected"] += 1
                record["reason"] = item.data
            elif item.kind == "frame_dropped":
                counts["frames_dropped"] += 1
            elif item.kind == "frame" and not frames_ok:
                counts["frames_skipped"] += 1
                record["type"] = "frame_skipped"
            elif item.kind == "frame":
                try:
                    pose = poses.at(item.clock_s)
                    record["pose"] = None if pose is None else list(pose.as_tuple())
                    record["tokens"] = stream.push_frame(item.data, item.stamp, pose=pose)
                    counts["frames"] += 1
                except FramesNotSupportedError as exc:
                    frames_ok = False
                    counts["frames_skipped"] += 1
                    record["type"] = "frame_skipped"
                    notice = f"{exc}; frames are skipped (counted), texts and questions go on"
                    result.notices.append(notice)
                    echo(f"note: {notice}")
            else:  # a text, or a text to keep (text/pinned)
                pin = item.kind == "pinned"
                if pin:
                    record.update(type="text", pinned=True)
                try:
                    pose = poses.at(item.clock_s)
                    record["pose"] = None if pose is None else list(pose.as_tuple())
                    record["tokens"] = stream.push_text(item.data, item.stamp, pin=pin, pose=pose)
                    counts["texts"] += 1
                except ValueError as exc:
                    counts["rejected"] += 1
                    record.update(type="rejected", reason=str(exc))
            record["seconds"] = time.monotonic() - t0
            emit(record | stats())
            if bar is not None:
                bar.update(1)
        for q in questions_due(questions, asked, None):
            answer(q, bag_time)
        if bar is not None:
            bar.close()
    finally:
        bag.close()
        if log:
            log.close()
    result.seconds = time.monotonic() - started
    return result


# --- command line ---------------------------------------------------------------------------------

def _parameter_help(name: str) -> str:
    """A flag's help: the node parameter's own description (the settings table says it once)."""
    p = BY_NAME[name]
    return p.description.rstrip(".") + (f" ({p.constraints})." if p.constraints else ".")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=(
        "Run the Inf-MLLM engine over a rosbag2 bag without ROS: ingest its camera and text messages in "
        "bag order, answer questions at bag times (greedy), and write log.jsonl, report.md and plot.png."))
    p.add_argument("bag", help="rosbag2 bag folder (mcap or sqlite3) or a single .mcap/.db3 file")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--questions", metavar="YAML",
                   help="questions file: a list of {time_s, question, expected} (default: questions.yaml "
                        "next to the bag, when there is one)")
    q.add_argument("--ask", action="append", default=[], metavar="T:QUESTION",
                   help="ask QUESTION once the stream has passed T seconds from the bag start (repeatable)")
    p.add_argument("--no-questions", action="store_true", help="ask nothing, even with a questions.yaml")
    p.add_argument("--params", metavar="YAML", help="the node's parameters file: use its settings")
    p.add_argument("--model", help=_parameter_help("model"))
    p.add_argument("--device", help=_parameter_help("device"))
    p.add_argument("--dtype", help=_parameter_help("dtype"))
    p.add_argument("--cache-size", type=int, help=_parameter_help("cache_size"))
    p.add_argument("--policy", help=_parameter_help("eviction_policy"))
    for knob in (p for p in PARAMETERS if p.policy_knob):  # every policy's settings, as the node has them
        flag = "--" + knob.name.replace("_", "-")
        if knob.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=knob.description)
        else:
            p.add_argument(flag, type=knob.type, help=knob.description)
    p.add_argument("--chunk-size", type=int, help=_parameter_help("chunk_size"))
    p.add_argument("--max-frame-pixels", type=int, help=_parameter_help("max_frame_pixels"))
    p.add_argument("--max-new-tokens", type=int, help=_parameter_help("max_new_tokens"))
    p.add_argument("--frame-rate", type=float, help=_parameter_help("frame_rate") + " Offline, stamps are bag time.")
    p.add_argument("--remap", action="append", default=[], metavar="FROM:=TO",
                   help="map a bag topic to a node input (image, image/compressed, text, text/pinned), "
                        "as for the replay")
    p.add_argument("--node", "--node-name", dest="node", default="/inf_mllm",
                   help="the node whose inputs the bag's topics are taken as, by its full name (default /inf_mllm): "
                        "as for the replay, /robot1/text reaches /robot1/inf_mllm")
    p.add_argument("--topics", nargs="+", metavar="TOPIC", help="use only these bag topics")
    p.add_argument("--out", metavar="DIR", help="where to write (default: out/offline/<bag name>)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bag_path = Path(args.bag)
    out = Path(args.out) if args.out else Path("out") / "offline" / (bag_path.name or "bag")

    def fail(message: str, status: int = 2) -> int:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return status

    try:
        settings = resolve_settings(args)
        remaps = parse_remaps(args.remap)
        beside = bag_path / "questions.yaml" if bag_path.is_dir() else bag_path.parent / "questions.yaml"
        questions = [] if args.no_questions else chosen_questions(args.ask, args.questions, beside)
        # Check the bag and the settings before the minutes a model may take to load.
        open_selected(bag_path, remaps, args.topics, namespace=node_namespace(args.node))[0].close()
        config = checked_config(settings)
        out.mkdir(parents=True, exist_ok=True)
    except (UsageError, ValueError, BagError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {out}: {exc}")

    from ..engine.models.loading import ModelLoadError

    print(f"{PROG}: {bag_path} -> {out}/ (model {settings['model']}, cache {settings['cache_size']} tokens, "
          f"policy {settings['eviction_policy']}"
          + "".join(f", {k} {v}" for k, v in config.policy_settings.items()) + ", "
          f"{len(questions)} questions)", flush=True)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        result = run_offline(bag_path, questions, settings, remaps=remaps, topics=args.topics, node=args.node,
                             progress=progress, log_path=out / "log.jsonl",
                             echo=lambda line: print(line, flush=True))
    except (UsageError, BagError, ModelLoadError) as exc:
        return fail(str(exc))
    with_map = write_map(result, out / "map.png")
    write_report(result, out / "report.md", with_map=with_map)
    write_plot(result, out / "plot.png")
    c = result.counts
    last = next((r for r in reversed(result.records) if "fill" in r), {})
    print(f"{PROG}: {c['frames']} frames, {c['texts']} texts, {c['answers']} answers in {result.seconds:.1f} s; "
          f"cache {last.get('fill', 0)}/{last.get('capacity', 0)} tokens, {last.get('tokens_evicted', 0)} evicted, "
          f"KV storage {mib(last.get('kv_bytes', 0))}, RSS {mib(last.get('rss_bytes', 0))}")
    print(f"{PROG}: log    {out / 'log.jsonl'}")
    print(f"{PROG}: report {out / 'report.md'}")
    print(f"{PROG}: plot   {out / 'plot.png'}")
    if with_map:
        print(f"{PROG}: map    {out / 'map.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
