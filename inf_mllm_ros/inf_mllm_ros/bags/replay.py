"""Play a rosbag2 bag into ROS topics, timed or in lockstep with the node, and ask it questions.

    inf_mllm_replay BAG [--rate R | --lockstep] [--remap FROM:=TO ...] [--node /inf_mllm]
                        [--questions questions.yaml | --ask "T:question" ...] [--loop] [--start S] [--duration D]

Each message's serialized bytes are published as they are, with a publisher of its type, and
``/clock`` carries the bag time (as ``ros2 bag play --clock``), so a node with ``use_sim_time``
stamps texts with bag time. Timed play keeps the bag's pace times ``--rate``. Lockstep play sends
each message the node takes only once the node has taken the previous one in (its
``~/cache_stats`` counters frames_ingested + texts_ingested + inputs_rejected + frames_dropped went
up), so a run is deterministic; with ``frame_rate:=0.0`` on the node every frame goes in.

Questions are sent to ``<node>/query`` once the replay has passed their bag time, and the answers
are printed (and written with ``--answers-out``), then the latest description and memory figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from ..fastdds import large_frames_env
from .bag_io import BagError
from .stream_inputs import (
    DEFAULT_REMAPS,
    Question,
    chosen_questions,
    node_namespace,
    open_selected,
    parse_remaps,
    questions_due,
    resolve,
    tally,
)

PROG = "inf_mllm_replay"
CLOCK_HZ = 20.0
# Lockstep: seconds between the last message the node does not count (a pose) and the next input.
LOCKSTEP_SETTLE_S = 0.05


class ReplayError(Exception):
    """The replay cannot go on (the node does not answer, a message is not taken in)."""


def message_class(msgtype: str):
    """The installed ROS message class for 'pkg/msg/Name' (or 'pkg/Name'); BagError when not installed."""
    parts = msgtype.split("/")
    if len(parts) == 2:
        parts = [parts[0], "msg", parts[1]]
    if len(parts) != 3 or not all(parts):
        raise BagError(f"message type {msgtype!r} is not of the form package/msg/Name")
    try:
        return getattr(importlib.import_module(f"{parts[0]}.{parts[1]}"), parts[2])
    except (ImportError, AttributeError):
        raise BagError(f"message type {msgtype!r} is not installed in this ROS environment "
                       f"(no Python module {parts[0]}.{parts[1]}.{parts[2]})") from None


def published_name(topic: str, remaps: dict[str, str], namespace: str, inputs) -> str:
    """Where a bag topic is published: its remapped name, a relative one resolved as the node resolves its
    inputs (in its namespace) for the node's inputs, and from the root for the rest (as `ros2 bag play`)."""
    return resolve(remaps.get(topic, topic), namespace if topic in inputs else "")


@dataclass
class AnswerRecord:
    """One question the replay asked through ~/query, and what came back."""

    time_s: float
    question: str
    expected: str
    success: bool
    answer: str
    message: str
    correct: bool | None
    latency: float
    tokens_seen: int
    cache_fill: int
    needs_vision: bool = False
    # Heaviest first: {stamp (seconds, the input's own), kind, source, pose [x, y, z] or None, frame_id, text,
    # weight}, as ~/query gave them.
    evidence: list = field(default_factory=list)


class Player:
    """One rclpy node that publishes the bag, /clock, and talks to the inf_mllm node."""

    def __init__(self, topics: dict[str, str], remaps: dict[str, str], node: str, inputs: set[str], *,
                 clock: bool):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
        from rosgraph_msgs.msg import Clock

        from inf_mllm_interfaces.msg import CacheStats, Description
        from inf_mllm_interfaces.srv import Query

        self.node = rclpy.create_node("inf_mllm_replay", start_parameter_services=False)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.node_name = "/" + node.strip("/")
        namespace = node_namespace(node)
        reliable = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE)
        # /tf_static latched, as tf2's static broadcaster offers it: a transient-local subscriber (tf2's listener,
        # the node's) takes nothing from a volatile publisher (incompatible QoS), and latched it also reaches one
        # that subscribes after the message went out.
        latched = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        # Reliable publishers reach best-effort subscribers (the node's camera) and reliable ones alike.
        self.publishers = {}
        for t, msgtype in topics.items():
            name = published_name(t, remaps, namespace, inputs)
            self.publishers[t] = self.node.create_publisher(message_class(msgtype), name,
                                                            latched if name == "/tf_static" else reliable)
        self.inputs = inputs  # the bag topics that reach the node
        self._clock_pub = self.node.create_publisher(Clock, "/clock", 10) if clock else None
        self._clock_msg = Clock
        self.stats = None
        self.description = None
        self.node.create_subscription(CacheStats, f"{self.node_name}/cache_stats", self._on_stats,
                                      QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self.node.create_subscription(Description, f"{self.node_name}/description",
                                      lambda m: setattr(self, "description", m),
                                      QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                                 durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self.query = self.node.create_client(Query, f"{self.node_name}/query")
        self._query_type = Query

    def _on_stats(self, msg) -> None:
        self.stats = msg

    @property
    def progress(self) -> int | None:
        """Inputs the node is done with (taken in, refused or held back by frame_rate); None before any stats."""
        s = self.stats
        return None if s is None else s.frames_ingested + s.texts_ingested + s.inputs_rejected + s.frames_dropped

    def spin(self, seconds: float) -> None:
        self.executor.spin_once(timeout_sec=max(0.0, seconds))

    def publish_clock(self, stamp_ns: int) -> None:
        if self._clock_pub is not None:
            msg = self._clock_msg()
            msg.clock.sec, msg.clock.nanosec = divmod(int(stamp_ns), 1_000_000_000)
            self._clock_pub.publish(msg)

    def wait(self, condition, timeout: float, what: str, tick=None) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise ReplayError(f"timed out after {timeout:g} s waiting for {what}")
            if tick is not None:
                tick()
            self.spin(0.02)

    def wait_for_node(self, timeout: float, first_ns: int) -> None:
        """Wait until the node's stats say its model is ready, and every input has a subscriber."""
        begin = time.monotonic()
        # A sim-time node's timers run on /clock: let it advance (still before the bag) so the
        # node's periodic stats come.
        def tick() -> None:
            self.publish_clock(first_ns - int((timeout + 1 - (time.monotonic() - begin)) * 1e9))

        self.wait(lambda: self.stats is not None and self.stats.model_ready, timeout,
                  f"the node {self.node_name} (no ~/cache_stats with model_ready; is it running, "
                  "in this ROS_DOMAIN_ID?)", tick)
        for topic in sorted(self.inputs):
            pub = self.publishers[topic]
            self.wait(lambda: pub.get_subscription_count() > 0, max(1.0, timeout - (time.monotonic() - begin)),
                      f"a subscriber on {pub.topic_name} (remap {topic} to the node's input)", tick)
        end = time.monotonic() + 0.5  # let discovery settle both ways
        while time.monotonic() < end:
            tick()
            self.spin(0.05)

    def wait_for_subscribers(self, timeout: float) -> list[str]:
        """Wait for a subscriber on every node input, so the first messages are not lost.

        Returns the topics still without one after ``timeout`` (timed play goes on without them).
        """
        def missing() -> list[str]:
            return [self.publishers[t].topic_name for t in sorted(self.inputs)
                    if self.publishers[t].get_subscription_count() == 0]

        deadline = time.monotonic() + timeout
        while missing() and time.monotonic() < deadline:
            self.spin(0.05)
        settle = time.monotonic() + 0.5  # discovery goes both ways: let the subscribers see us too
        while time.monotonic() < settle:
            self.spin(0.05)
        return missing()

    def ask(self, q: Question, max_new_tokens: int, timeout: float) -> AnswerRecord:
        self.wait(self.query.service_is_ready, timeout, f"the service {self.node_name}/query")
        future = self.query.call_async(self._query_type.Request(question=q.question, max_new_tokens=max_new_tokens,
                                                                keep_in_memory=False))
        self.wait(future.done, timeout, f"an answer to {q.question!r}")
        r = future.result()
        evidence = [{"stamp": e.stamp.sec + e.stamp.nanosec * 1e-9 if e.has_stamp else None, "kind": e.kind,
                     "source": e.source, "pose": [e.pose.position.x, e.pose.position.y, e.pose.position.z]
                     if e.has_pose else None, "frame_id": e.frame_id, "text": e.text, "weight": e.weight}
                    for e in r.evidence]
        return AnswerRecord(q.time_s, q.question, q.expected, bool(r.success), r.answer, r.message,
                            q.matches(r.answer) if r.success else None, float(r.latency), int(r.tokens_seen),
                            int(r.cache_fill), q.needs_vision, evidence)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()


def replay(args: argparse.Namespace, questions: Sequence[Question], out=print) -> int:
    """Play the bag as asked; returns the exit status. Raises BagError, ReplayError, KeyboardInterrupt."""
    import rclpy
    from rclpy.executors import ExternalShutdownException

    remaps = parse_remaps(args.remap, defaults=not args.no_default_remaps)
    namespace = node_namespace(args.node)
    bag, topics, kinds = open_selected(args.bag, remaps, args.topics, namespace=namespace,
                                       notice=lambda line: out(f"{PROG}: {line}"))
    try:
        clocks = [t for t in topics if published_name(t, remaps, namespace, kinds) == "/clock"]
        for topic in clocks if not args.no_clock else []:
            del topics[topic]
            out(f"{PROG}: the bag's {topic} is not played: this replay publishes the bag time on /clock")
        for topic, msgtype in list(topics.items()):
            try:
                message_class(msgtype)
            except BagError as exc:
                if topic in kinds:  # the node's own inputs are std_msgs and sensor_msgs: always installed
                    raise
                del topics[topic]  # as `ros2 bag play` does: the rest of the bag still plays
                out(f"{PROG}: topic {topic} skipped: {exc}")
        start_ns = bag.start_ns
        first_ns = start_ns + int(args.start * 1e9)
        stop_ns = None if args.duration is None else first_ns + int(args.duration * 1e9)
        # Raw frames above about 600 KB hardly cross between processes with Fast DDS's defaults.
        os.environ.update(large_frames_env())
        rclpy.init()
        player = None
        try:
            player = Player(topics, remaps, args.node, set(kinds), clock=not args.no_clock)
            mode = "lockstep" if args.lockstep else f"rate {args.rate:g}"
            out(f"{PROG}: {bag.path} ({bag.message_count} messages, {(bag.end_ns - start_ns) / 1e9:.1f} s), "
                f"{mode}, to {', '.join(f'{t} -> {p.topic_name}' for t, p in player.publishers.items())}")
            if args.lockstep or questions:
                out(f"{PROG}: waiting for {player.node_name} ...")
                player.wait_for_node(300.0 if args.wait is None else args.wait, first_ns)
            else:
                missing = player.wait_for_subscribers(5.0 if args.wait is None else args.wait)
                if missing:
                    out(f"{PROG}: warning: nobody subscribes to {', '.join(missing)} yet; playing anyway")
            answers: list[AnswerRecord] = []
            failed = 0
            asked = 0
            sent = 0
            passes = 0
            others_since_input = False
            while True:
                passes += 1
                anchor_wall, anchor_ns = time.monotonic(), None
                for item in bag.messages(list(topics)):
                    if item.timestamp_ns < first_ns:
                        continue
                    if stop_ns is not None and item.timestamp_ns > stop_ns:
                        break
                    bag_time = (item.timestamp_ns - start_ns) / 1e9
                    due = questions_due(questions, asked, bag_time) if passes == 1 else []
                    for q in due:
                        answers.append(_ask(player, q, args, out))
                        failed += not answers[-1].success
                        asked += 1
                    if anchor_ns is None or due:
                        anchor_wall, anchor_ns = time.monotonic(), item.timestamp_ns
                    if not args.lockstep:
                        _sleep_until(player, anchor_wall + (item.timestamp_ns - anchor_ns) / 1e9 / args.rate,
                                     anchor_wall, anchor_ns, args.rate)
                    player.publish_clock(item.timestamp_ns)
                    if args.lockstep and item.topic in player.inputs:
                        if others_since_input:
                            # Messages the node does not count (a pose topic's) went out just before: let them
                            # reach it first, so that the input is stamped with the pose they carry.
                            _pause(player, LOCKSTEP_SETTLE_S)
                            others_since_input = False
                        _send_in_lockstep(player, item, args.timeout)
                    else:
                        player.publishers[item.topic].publish(item.rawdata)
                        others_since_input = True
                    sent += 1
                if not args.loop:
                    break
            if args.lockstep or questions:
                for q in questions_due(questions, asked, None):
                    answers.append(_ask(player, q, args, out))
                    failed += not answers[-1].success
            else:
                player.spin(0.5)  # let the last messages leave before the publishers go
            out(f"{PROG}: {sent} messages played")
            if args.lockstep or questions:
                _summary(player, answers, out)
            if args.answers_out:
                Path(args.answers_out).write_text(
                    json.dumps([asdict(a) for a in answers], indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            return 1 if failed else 0
        except ExternalShutdownException:  # rclpy's own SIGINT handler got there first
            raise KeyboardInterrupt from None
        finally:
            if player is not None:
                player.close()
            rclpy.try_shutdown()
    finally:
        bag.close()


def _sleep_until(player: Player, target: float, anchor_wall: float, anchor_ns: int, rate: float) -> None:
    """Spin until the wall time ``target``, keeping /clock going at the bag's pace."""
    while True:
        now = time.monotonic()
        if now >= target:
            return
        player.publish_clock(anchor_ns + int((now - anchor_wall) * rate * 1e9))
        player.spin(min(target - now, 1.0 / CLOCK_HZ))


def _send_in_lockstep(player: Player, item, timeout: float) -> None:
    before = player.progress
    # /clock first, so a sim-time node stamps this message with its bag time: the node's clock
    # subscription comes before its inputs on its executor; a moment lets the clock arrive first.
    player.publish_clock(item.timestamp_ns)
    settle = time.monotonic() + 0.01
    while time.monotonic() < settle:
        player.spin(settle - time.monotonic())
    player.publishers[item.topic].publish(item.rawdata)

    def taken() -> bool:
        now = player.progress
        return now is not None and now != before  # counters restart after a ~/reset: any change is progress

    player.wait(taken, timeout, (
        f"{player.node_name} to take in the {item.topic} message at bag time {item.timestamp_ns / 1e9:.3f} "
        "(lockstep needs use_sim_time:=true for bag-time stamps)"))


def _pause(player: Player, seconds: float) -> None:
    """Let `seconds` pass while the player's own callbacks run."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        player.spin(left)


def _ask(player: Player, q: Question, args, out) -> AnswerRecord:
    a = player.ask(q, args.max_new_tokens, args.timeout)
    if not a.success:
        out(f"[{q.time_s:6.1f} s] Q: {q.question}\n           query failed: {a.message}")
        return a
    out(f"[{q.time_s:6.1f} s] Q: {q.question}\n           A: {a.answer}{q.mark(a.correct)}  ({a.latency:.1f} s)")
    return a


def _summary(player: Player, answers: Sequence[AnswerRecord], out) -> None:
    player.spin(0.2)
    summary = tally([(a.correct, a.needs_vision) for a in answers])
    if summary:
        out(f"{PROG}: {summary}")
    d = player.description
    if d is not None:
        out(f"{PROG}: latest description (cache fill {d.cache_fill}, {d.frames_seen} frames seen): {d.text}")
    else:
        out(f"{PROG}: no description yet (the node describes every description_period seconds)")
    s = player.stats
    if s is not None:
        out(f"{PROG}: memory: cache {s.fill}/{s.capacity} tokens, {s.tokens_seen} seen, {s.tokens_evicted} evicted, "
            f"KV storage {s.kv_bytes / 2**20:.1f} MiB; "
            f"frames {s.frames_ingested} ingested, {s.frames_dropped} dropped; "
            f"texts {s.texts_ingested}; refused {s.inputs_rejected}; policy {s.eviction_policy}, "
            f"attention_bias {s.attention_bias:g}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=(
        "Play a rosbag2 bag into ROS topics (timed or in lockstep with inf_mllm_node), publishing /clock, "
        "and optionally ask the node questions at bag times."))
    p.add_argument("bag", help="rosbag2 bag folder (mcap or sqlite3) or a single .mcap/.db3 file")
    p.add_argument("--rate", type=float, default=1.0, help="timed play: bag seconds per wall second (default 1)")
    p.add_argument("--lockstep", action="store_true",
                   help="send each node input once the node has taken in the previous one")
    p.add_argument("--remap", action="append", default=[], metavar="FROM:=TO",
                   help="publish bag topic FROM on TO (repeatable); defaults: "
                        + ", ".join(f"{bag}:={node}" for bag, node in DEFAULT_REMAPS.items()))
    p.add_argument("--no-default-remaps", action="store_true", help="publish topics under their bag names")
    p.add_argument("--topics", nargs="+", metavar="TOPIC", help="play only these bag topics")
    p.add_argument("--node", "--node-name", dest="node", default="/inf_mllm",
                   help="the inf_mllm node's full name (default /inf_mllm)")
    p.add_argument("--loop", action="store_true", help="play again from the start when the bag ends")
    p.add_argument("--start", type=float, default=0.0, metavar="S", help="skip the first S seconds of the bag")
    p.add_argument("--duration", type=float, metavar="D", help="play D seconds of the bag at most")
    p.add_argument("--no-clock", action="store_true", help="do not publish /clock")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--questions", metavar="YAML", help="questions file: a list of {time_s, question, expected}")
    q.add_argument("--ask", action="append", default=[], metavar="T:QUESTION",
                   help="ask QUESTION once the replay has passed T seconds from the bag start (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="answer length for questions; 0: the node's")
    p.add_argument("--answers-out", metavar="JSON", help="write the answers to this file")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the node to take in one message or answer one question")
    p.add_argument("--wait", type=float, metavar="S",
                   help="seconds to wait at the start: for the node and its model with --lockstep or questions "
                        "(default 300, then an error), else for subscribers on the node's inputs (default 5)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def fail(message: str, status: int) -> int:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return status

    if not args.rate > 0:
        return fail(f"--rate must be positive, got {args.rate}", 2)
    if args.start < 0 or (args.duration is not None and args.duration <= 0):
        return fail("--start must be >= 0 and --duration > 0", 2)
    try:
        questions = chosen_questions(args.ask, args.questions)
        return replay(args, questions, out=lambda line: print(line, flush=True))
    except (BagError, ValueError) as exc:
        return fail(str(exc), 2)
    except ReplayError as exc:
        return fail(str(exc), 1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
