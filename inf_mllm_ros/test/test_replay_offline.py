"""inf_mllm_replay and inf_mllm_offline, as installed.

A short generated bag is replayed in lockstep into a running node (bag time on /clock), then the
node is asked a question; inf_mllm_offline over the same bag, with the node's parameters file (whose
frame_rate holds one frame back), must take in the same inputs and give the same greedy answer from the
same memory. Timed replay at a high rate feeds the
node too, and broken bags make both tools fail with a clear message and a non-zero status.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_srvs.srv import Trigger

from inf_mllm_interfaces.msg import CacheStats
from inf_mllm_ros.bags.bag_io import iter_messages
from inf_mllm_ros.bags.sample_bag import build_scenario, write_sample_bag
from inf_mllm_ros.engine.models.loading import SMALL_MODEL
from inf_mllm_ros.bags.stream_inputs import Question, input_kind, parse_ask, questions_due, stream_inputs
from inf_mllm_ros.input_rules import FrameGate, StreamClock
from inf_mllm_ros.settings import DEFAULTS
from ros_helpers import Latest, RosProbe

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = REPO_ROOT / "install" / "inf_mllm_ros" / "lib" / "inf_mllm_ros"
NAMESPACE = "/replay_test"
FQN = f"{NAMESPACE}/inf_mllm"
REMAPS = ["--remap", f"/camera/image_raw/compressed:={NAMESPACE}/image/compressed",
          "--remap", f"/narration:={NAMESPACE}/text"]
# 3 frames (0, 2, 4 s) and 2 narration lines (0, 5 s); more tokens than the cache holds.
SHORT = dict(duration_s=6.0, fps=0.5, size=(96, 72), seed=0)
ASK = "6:Where did forklift F2 park?"
PARAMS = {
    "model": SMALL_MODEL,
    "use_sim_time": True,
    "device": "cpu",
    "dtype": "float32",
    "cache_size": 256,
    "frame_rate": 0.4,  # frames 2.5 s apart at most: of the bag's frames at 0, 2 and 4 s, the one at 2 s is held back
    "description_period": 0.0,
    "max_new_tokens": 12,
    "pose_topic": "/odom",  # the bag's patrol robot: the replay publishes it as it is, the offline runner reads it
}


def exe(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/setup.sh")
    return str(path)


def run(args: list, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def short_bag(tmp_path_factory) -> Path:
    return write_sample_bag(tmp_path_factory.mktemp("bag") / "short", **SHORT).path


@pytest.fixture(scope="module")
def params(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("params") / "params.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": PARAMS}}))
    return path


@pytest.fixture(scope="module")
def node(params, tmp_path_factory):
    """The installed node on sim time, in a namespace of its own."""
    log_path = tmp_path_factory.mktemp("node") / "node.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_COLORIZED_OUTPUT="0")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([exe("inf_mllm_node"), "--ros-args", "--params-file", str(params),
                                 "-r", f"__ns:={NAMESPACE}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = lambda: log_path.read_text(errors="replace")
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_lockstep_replay_answers_as_the_offline_runner(node, short_bag, params, tmp_path, ros_env) -> None:
    answers = tmp_path / "answers.json"
    # The default remaps name relative topics (image/compressed, text): they go into the node's namespace.
    replay = run([exe("inf_mllm_replay"), short_bag, "--lockstep", "--node", FQN, "--ask", ASK,
                  "--answers-out", answers, "--timeout", "180"], ros_env)
    assert replay.returncode == 0, f"{replay.stdout}\n{replay.stderr}\nnode log:\n{node.log()[-3000:]}"
    assert "65 messages played" in replay.stdout  # 3 frames, 2 texts and 60 poses (10 Hz)
    [from_node] = json.loads(answers.read_text())
    assert from_node["success"] and from_node["answer"], from_node

    out = tmp_path / "offline"
    offline = run([exe("inf_mllm_offline"), short_bag, "--params", params, "--ask", ASK, "--out", out,
                   "--no-progress", "--node", FQN], ros_env)
    assert offline.returncode == 0, offline.stderr
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    [offline_answer] = [r for r in records if r["type"] == "answer"]
    # The same prompts into the same memory: the same greedy answer, memory figures included.
    assert offline_answer["answer"] == from_node["answer"]
    assert (offline_answer["tokens_seen"], offline_answer["fill"]) == (from_node["tokens_seen"],
                                                                        from_node["cache_fill"])
    assert [r["type"] for r in records if r["type"] in ("frame", "text", "frame_dropped")] == [
        "frame", "text", "frame_dropped", "frame", "text"]
    # The node held back the same frame: what it took in is what the offline runner took in.
    assert "frames 2 ingested, 1 dropped" in replay.stdout, replay.stdout
    assert offline_answer["tokens_evicted"] > 0  # the bag is longer than the cache
    # Both stamped each input with the robot's pose at its time (the node from /odom over DDS, the offline runner
    # from the bag): the same heaviest evidence, at the same place, where the scenario put the robot.
    top_node, top_offline = from_node["evidence"][0], offline_answer["evidence"][0]
    assert top_node["text"] == top_offline["text"], (top_node, top_offline)
    # The node looks a text's pose up at its arrival, on the /clock and among the poses it has heard by then: over
    # DDS a few poses (0.1 s, 0.1 m apart at the robot's 1 m/s) may be behind the bag's order, and where the
    # executor takes the text before the poses sent just ahead of it (the replay pauses 50 ms for them) the text
    # has none (test_node_where_when.py checks poses across processes on a live pose stream).
    if top_node["pose"] is not None:
        assert top_node["frame_id"] == "map", top_node
        assert top_node["pose"] == pytest.approx(top_offline["pose"][:3], abs=0.5)
    scenario = build_scenario(SHORT["duration_s"], SHORT["seed"])
    for entry in offline_answer["evidence"]:
        # The bag's messages of one time come by topic name: the inputs at 0 s come before the first pose (and the
        # system prompt has neither stamp nor pose).
        assert (entry["pose"] is None) == (entry["stamp"] in (None, 0.0)), entry
        if entry["kind"] == "text" and entry["pose"] is not None:
            [said] = [e.time_s for e in scenario.events if e.text in entry["text"]]
            assert entry["pose"][:2] == pytest.approx(scenario.robot_xy(said), abs=0.2), entry
    assert (out / "plot.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "Where did forklift F2 park?" in report and "Cache capacity | 256 tokens" in report
    assert "poses 60 (refused 0)" in report and (out / "map.png").stat().st_size > 10_000
    assert str(out / "report.md") in offline.stdout


def test_timed_replay_at_a_high_rate_feeds_the_node(node, short_bag, ros_env) -> None:
    def alive() -> None:
        if node.poll() is not None:
            pytest.fail(f"node exited with {node.returncode}:\n{node.log()[-3000:]}")

    probe = RosProbe("replay_test_probe", alive=alive)
    try:
        stats = Latest(probe, CacheStats, f"{FQN}/cache_stats", QoSProfile(depth=10,
                                                                          reliability=ReliabilityPolicy.RELIABLE))
        # A sim-time node sends periodic stats only while /clock runs: start from an empty memory instead.
        reset = probe.node.create_client(Trigger, f"{FQN}/reset")
        probe.wait_for(lambda: probe.call(reset, Trigger.Request(), timeout=180).success, 180, "a reset")
        stats.clear()
        replay = run([exe("inf_mllm_replay"), short_bag, "--rate", "20", "--wait", "60", "--node", FQN, *REMAPS], ros_env,
                     timeout=120)
        assert replay.returncode == 0, replay.stderr
        assert "warning" not in replay.stdout and "rate 20" in replay.stdout and "5 messages played" in replay.stdout
        # Texts are reliable and queued; frames are best effort and the newest one wins.
        stats.wait(lambda m: m.texts_ingested == 2 and m.frames_ingested >= 1, timeout=120,
                   what="both texts and a frame ingested")
    finally:
        probe.close()


def _custom_bag(path: Path, *, embed: bool) -> Path:
    """A bag with a type nobody installs: its definition embedded or not, and a String topic."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore, get_types_from_msg

    store = get_typestore(Stores.LATEST)
    store.register(get_types_from_msg("string name\nfloat32 level", "acme_msgs/msg/Beacon"))
    with Writer(path, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
        extra = {"typestore": store} if embed else {"msgdef": "", "rihs01": "RIHS01_" + "0" * 64}
        beacon = writer.add_connection("/beacon", "acme_msgs/msg/Beacon", **extra)
        text = writer.add_connection("/narration", "std_msgs/msg/String", typestore=store)
        writer.write(beacon, 10, store.serialize_cdr(store.types["acme_msgs/msg/Beacon"](name="b", level=1.0),
                                                     "acme_msgs/msg/Beacon"))
        writer.write(text, 20, store.serialize_cdr(store.types["std_msgs/msg/String"](data="hi"),
                                                   "std_msgs/msg/String"))
    return path


@pytest.mark.parametrize("tool", ["inf_mllm_replay", "inf_mllm_offline"])
def test_broken_bags_fail_clearly(tool, short_bag, tmp_path, ros_env) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "metadata.yaml").write_text("{{{ not: yaml ::")
    cases = {
        tmp_path / "no_such_bag": "no_such_bag: no such bag",
        garbage: "garbage: malformed bag",
    }
    extra = ["--out", tmp_path / "out"] if tool == "inf_mllm_offline" else []
    for bag, message in cases.items():
        result = run([exe(tool), bag, *extra], ros_env, timeout=60)
        assert result.returncode == 2, (bag, result.stdout, result.stderr)
        assert f"{tool}: error:" in result.stderr and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    # A topic of a type nobody installs (its definition in the bag or not) is skipped with a note, as
    # `ros2 bag play` skips it, and the rest of the bag is taken; remapped to an input, it is refused.
    for embed in (False, True):
        custom = _custom_bag(tmp_path / f"custom_{embed}", embed=embed)
        if tool == "inf_mllm_replay":
            result = run([exe(tool), custom, "--wait", "0"], ros_env, timeout=60)
            assert result.returncode == 0, result.stderr
            assert "topic /beacon skipped" in result.stdout and "1 messages played" in result.stdout, result.stdout
        else:
            result = run([exe(tool), custom, "--model", "smollm2", "--no-questions", *extra], ros_env, timeout=300)
            assert result.returncode == 0, result.stderr
            # Offline, a topic no input takes is not read: only one with no definition at all is named.
            assert ("topic /beacon skipped" in result.stdout) == (not embed), result.stdout
            assert "1 texts" in result.stdout, result.stdout
        result = run([exe(tool), custom, "--remap", "/beacon:=text", *extra], ros_env, timeout=60)
        assert result.returncode == 2 and "takes std_msgs/msg/String" in result.stderr, result.stderr


def test_the_offline_runner_pins_texts_on_text_pinned(short_bag, tmp_path, ros_env) -> None:
    """As the node pins what comes on text/pinned: the narration, sent there, is held as pinned."""
    out = tmp_path / "pinned"
    result = run([exe("inf_mllm_offline"), short_bag, "--model", "smollm2", "--no-questions", "--out", out,
                  "--no-progress", "--remap", "/narration:=text/pinned"], ros_env, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    texts = [r for r in records if r["type"] == "text"]
    assert len(texts) == 2 and all(r.get("pinned") for r in texts), texts
    assert texts[-1]["pinned_held"] >= texts[-1]["tokens"] > 0


# --- the shared mapping, without ROS ------------------------------------------------------------

def test_stream_clock_and_questions_follow_the_node(short_bag) -> None:
    clock = StreamClock()
    items = [m for m in iter_messages(short_bag) if m.topic != "/odom"]
    stamps = [clock(m.msg.header.stamp if m.msgtype.startswith("sensor_msgs") else None, m.timestamp_ns)
              for m in items]
    assert stamps == pytest.approx([0.0, 0.0, 2.0, 4.0, 5.0])  # from the first input, as the node stamps
    # A question's moment in stream time, which starts no clock: how long ago counts from it.
    origin = clock.origin
    assert StreamClock().time_of(origin + 7.25) is None
    assert [clock.time_of(origin + s) for s in (0.0, 7.25, 3600.0)] == pytest.approx([0.0, 7.25, 3600.0])
    assert clock.origin == origin
    # As a node resolves its inputs: in its namespace, and nowhere else.
    assert [input_kind(t) for t in ("text", "/text", "/robot1/text", "image/compressed", "/a/image", "/tf",
                                    "text/pinned")] == ["text", "text", None, "image/compressed", None, None,
                                                        "text/pinned"]
    assert [input_kind(t, "/robot1") for t in ("text", "/robot1/text", "/text", "/robot1/camera/depth/image",
                                               "/robot1/image/compressed")] == ["text", "text", None, None,
                                                                                  "image/compressed"]
    questions = [Question(2.0, "a"), Question(5.0, "b")]
    assert questions_due(questions, 0, 2.0) == [] and questions_due(questions, 0, 2.5) == [questions[0]]
    assert questions_due(questions, 1, None) == [questions[1]]
    assert parse_ask("8.5: Where is F2?") == Question(8.5, "Where is F2?")
    with pytest.raises(ValueError, match="SECONDS:question"):
        parse_ask("soon: Where is F2?")


def test_stream_inputs_refuse_what_the_node_refuses() -> None:
    from types import SimpleNamespace

    from image_bombs import jpeg_bomb
    from inf_mllm_ros.image_conversion import rgb_to_compressed_fields
    def message(topic: str, seconds: float, msg) -> SimpleNamespace:
        return SimpleNamespace(topic=topic, timestamp_ns=int(seconds * 1e9), msg=msg)

    header = SimpleNamespace(stamp=SimpleNamespace(sec=0, nanosec=0))
    png = rgb_to_compressed_fields(np.full((8, 8, 3), 90, np.uint8), "png")["data"]
    items = [
        message("/narration", 0.0, SimpleNamespace(data="\u200b\u200c\u2060")),
        message("/camera/image_raw/compressed", 1.0, SimpleNamespace(header=header, format="jpeg",
                                                                      data=jpeg_bomb(30000, 30000))),
        message("/camera/image_raw/compressed", 2.0, SimpleNamespace(header=header, format="jpeg", data=png)),
        message("/camera/image_raw/compressed", 3.0, SimpleNamespace(header=header, format="png", data=png)),
        message("/narration", 4.0, SimpleNamespace(data="Forklift F2 parked at dock 3.")),
    ]
    kinds = {"/narration": "text", "/camera/image_raw/compressed": "frame"}
    rules = {"max_text_chars": DEFAULTS["max_text_chars"], "max_decoded_pixels": DEFAULTS["max_decoded_pixels"],
             "frame_rate": 0.0}
    out = list(stream_inputs(items, kinds, 0, **rules))
    assert [i.kind for i in out] == ["rejected", "rejected", "rejected", "frame", "text"]
    assert out[0].data.startswith("empty text message refused")
    assert out[1].data.startswith("too_large:") and out[2].data.startswith("format_mismatch:")
    small = list(stream_inputs(items[3:4], kinds, 0, **dict(rules, max_decoded_pixels=63)))
    assert small[0].kind == "rejected" and small[0].data.startswith("too_large:")
    with pytest.raises(ValueError, match="SECONDS:question"):
        parse_ask("3: \u200b\u2060")


@pytest.mark.parametrize("camera_hz, frame_rate, start", [(10.0, 2.0, 0.0), (30.0, 1.0, 0.37), (7.0, 3.0, 12.5)])
def test_the_frame_gate_takes_one_frame_per_period_by_the_frames_own_times(camera_hz, frame_rate, start) -> None:
    gate = FrameGate(frame_rate)
    times = [start + i / camera_hz for i in range(int(5 * camera_hz))]
    taken = [t for t in times if gate.admit(t)]
    gaps = np.diff(taken)
    assert taken[0] == times[0] and len(taken) == math.ceil((times[-1] - start) * frame_rate + 1e-9)
    assert (gaps >= 1.0 / frame_rate - 1.0 / camera_hz - 1e-6).all()
    assert (gaps < 1.0 / frame_rate + 1.0 / camera_hz).all()  # the first frame of each period, never later
    gate.rate = 0.0
    assert all(gate.admit(t) for t in times)  # 0: every frame
    gate.rate = frame_rate
    assert gate.admit(times[0])  # a new rate starts the periods afresh
    assert not gate.admit(times[1]) and gate.admit(times[0] - 1.0)  # an earlier time (a bag played again) too


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_jittering_camera_still_gives_frame_rate_frames_a_second(seed) -> None:
    """A 5 Hz camera whose stamps jitter by a few milliseconds under frame_rate 1: 30 frames in 30 s, not one period
    in a few lost to a frame that came a millisecond early."""
    rng = np.random.default_rng(seed)
    gate = FrameGate(1.0)
    start = float(rng.uniform(0, 100))
    times = [start + i * 0.2 + float(rng.uniform(-0.005, 0.005)) for i in range(150)]
    taken = [t for t in times if gate.admit(t)]
    assert len(taken) == 30, len(taken)
    assert (np.diff(taken) > 0.75).all()


def test_offline_inputs_follow_the_frame_gate_before_decoding() -> None:
    """A frame held back by frame_rate is never decoded (a broken one is not refused), as in the node."""
    from types import SimpleNamespace

    header = lambda s: SimpleNamespace(stamp=SimpleNamespace(sec=int(s), nanosec=int(round(s % 1 * 1e9))))
    broken = [SimpleNamespace(topic="/camera/image_raw/compressed", timestamp_ns=int(s * 1e9),
                              msg=SimpleNamespace(header=header(s), format="jpeg", data=b"not a jpeg"))
              for s in (1.0, 1.1, 1.2, 1.6)]
    kinds = {"/camera/image_raw/compressed": "frame"}
    out = list(stream_inputs(broken, kinds, 0, max_text_chars=10, max_decoded_pixels=10**6, frame_rate=2.0))
    assert [i.kind for i in out] == ["rejected", "frame_dropped", "frame_dropped", "rejected"]
