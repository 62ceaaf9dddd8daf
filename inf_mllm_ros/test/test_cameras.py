"""Several cameras into one memory, in the engine and the rules the node takes its camera list by: a frame's marker
names its camera, its blocks and evidence keep the name (through a restart too), `recall` can ask for one camera's
frames, each camera's frames wait one deep of their own, and the node's camera list is named from its topics or
refused with the reason."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from inf_mllm_ros.engine.archive.archive import camera_codes, camera_names
from inf_mllm_ros.engine.models.chat import MarkerClock, stamped
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.persistence.memory_file import load_memory, save_memory
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.runtime.work_queue import Job, WorkQueue
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.engine.value_rules import ValueRule, camera_problem
from inf_mllm_ros.input_rules import camera_topics, topic_camera_name
from inf_mllm_ros.testing.random_models import build_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["front", "rear", "arm_cam"]


def test_a_frames_marker_names_its_camera_before_its_time():
    clock = MarkerClock()
    assert stamped("<image>", 5.0, clock, "rear") == "<image> [rear 0:00:05.0]"
    assert stamped("<image>", None, clock, "rear") == "<image> [rear]"
    assert stamped("<image>", 5.0, clock) == "<image> [0:00:05.0]"  # one camera: as before there were several
    wall = MarkerClock("wall", "UTC", origin=1_683_550_000.0)
    assert stamped("<image>", 0.0, wall, "front") == "<image> [front 8 May 2023 12:46:40]"


@pytest.mark.parametrize("name", ["", "front", "arm_cam2", "A" + "b" * 31])
def test_camera_names_the_rule_takes(name):
    assert camera_problem(name) is None


@pytest.mark.parametrize("name", ["2front", "front camera", "rear/left", "a" * 33, "é", None, 3])
def test_camera_names_the_rule_refuses(name):
    assert "camera name" in camera_problem(name)


def test_camera_names_survive_their_saved_form():
    names = ["", "front", "A" + "b" * 31, "arm_cam"]
    assert camera_names(camera_codes(names)) == names


@pytest.mark.parametrize("seed", range(4))
def test_each_cameras_frames_wait_one_deep_of_their_own(seed):
    """A camera's newer frame replaces its own waiting one only; the camera that has waited longest goes first."""
    rng = random.Random(seed)
    work = WorkQueue()
    offered, first_offered, replaced = {}, [], 0
    for i in range(30):
        camera = rng.choice(NAMES)
        job = Job("frame")
        old = work.offer_frame(job, camera)
        replaced += old is not None
        assert old is offered.get(camera)
        if camera not in offered:
            first_offered.append(camera)
        offered[camera] = job
    taken = [work.next_jobs(256, 32) for _ in range(len(offered))]
    assert [batch[0] for batch in taken] == [offered[c] for c in first_offered]
    assert not work and replaced == 30 - len(offered)


def test_a_text_call_ends_before_the_soonest_camera_is_due():
    work = WorkQueue()
    work.took_texts(224, 64, 0.4, 16)  # 0.1 s a block
    period, now = 2.0, time.monotonic()
    work.frame_offered.update({"front": now - 0.2, "rear": now - 1.5})  # rear is due in 0.5 s, front in 1.8 s
    blocks = work.text_call_chars(1024, 16, period) // work.block_chars(16)
    assert 3 <= blocks <= 5  # 90 % of 0.5 s at 0.1 s a block, not of 1.8 s


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return load_model(build_model_folder("qwen2_vl", tmp_path_factory.mktemp("vl")), device="cpu", dtype="float32")


@pytest.mark.parametrize("seed", range(3))
def test_frames_of_several_cameras_keep_their_camera_in_memory_evidence_and_a_restart(adapter, seed, tmp_path):
    rng = np.random.default_rng(seed)
    config = StreamConfig(capacity=64, chunk_size=16, system_prompt="You remember.")
    stream = KVStream(adapter, config)
    sent = []
    for t in range(9):
        camera = NAMES[int(rng.integers(len(NAMES)))]
        if t % 3 == 1:
            stream.push_text(f"Crate {t} went to bay {t + 2}.", stamp=t + 0.25)
        stream.push_frame(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8), stamp=float(t), camera=camera)
        sent.append((float(t), camera))
    assert stream.cache.evictions > 0
    blocks = [(b.stamp, b.camera) for b in stream.archive.blocks if b.frame]
    assert blocks == sent
    assert all(b.camera == "" for b in stream.archive.blocks if not b.frame)
    for camera in NAMES:
        moments = stream.recall("What did the camera see?", limit=9, camera=camera)
        assert sorted(m.stamp for m in moments) == [t for t, c in sent if c == camera]
        assert all(m.kind == "frame" and m.camera == camera for m in moments)
    everything = stream.recall("What did the camera see?", limit=20)
    assert {(m.stamp, m.camera) for m in everything if m.kind == "frame"} == set(sent)
    answer = stream.ask("What did the rear camera see?", max_new_tokens=4)
    assert all(e.camera in NAMES for e in answer.evidence if e.kind == "frame") and answer.evidence

    save_memory(stream, tmp_path / "memory")
    restored = KVStream(adapter, config)
    load_memory(restored, tmp_path / "memory")
    assert [(b.stamp, b.camera) for b in restored.archive.blocks if b.frame] == sent
    assert restored.ask("What did the rear camera see?", max_new_tokens=4).text == \
        stream.ask("What did the rear camera see?", max_new_tokens=4).text


def test_a_frame_marker_with_a_camera_is_what_the_model_reads(adapter):
    """The camera's name is in the frame's own tokens, before its time."""
    said = adapter.tokenize(adapter.frame_text(3.0, MarkerClock(), "rear"))
    plain = adapter.tokenize(adapter.frame_text(3.0, MarkerClock()))
    assert len(said) > len(plain) and "rear 0:00:03.0" in adapter.tokenizer.decode(said)


def test_a_bad_camera_name_is_refused_and_leaves_the_memory_as_it_was(adapter):
    stream = KVStream(adapter, StreamConfig(capacity=64, chunk_size=16))
    stream.push_text("The dock is clear.", stamp=0.0)
    before, blocks = stream.stats(), len(stream.archive.blocks)
    with pytest.raises(ValueError, match="camera name"):
        stream.push_frame(np.zeros((28, 28, 3), np.uint8), 1.0, camera="rear left")
    with pytest.raises(ValueError, match="camera name"):
        stream.recall("the dock", camera="rear/left")
    assert stream.stats() == before and len(stream.archive.blocks) == blocks


@pytest.mark.parametrize("topic, name", [("front/image_raw", "front"), ("/robot1/rear/image", "rear"),
                                         ("/arm_cam/color/image_rect", "arm_cam"), ("left_cam", "left_cam"),
                                         ("camera/color/image_raw", "camera_color_image_raw")])
def test_a_camera_is_named_by_its_topic(topic, name):
    assert topic_camera_name(topic) == name


def test_the_camera_list_one_camera_unnamed_several_named():
    assert camera_topics(["image"], [""]) == [("", "image")]
    assert camera_topics(["front/image_raw", "rear/image_raw", ""], [""]) == [("front", "front/image_raw"),
                                                                             ("rear", "rear/image_raw")]
    assert camera_topics(["a/image", "b/image"], ["left", "right"]) == [("left", "a/image"), ("right", "b/image")]


@pytest.mark.parametrize("topics, names, reason", [
    ([""], [""], "names no topic"),
    (["a/image", "a/image"], [""], "a topic twice"),
    (["a/image", "b/image"], ["left"], "1 names for 2"),
    (["left/image", "left/image_raw"], [""], "one name"),
    (["a/image", "b/image"], ["left", "left"], "one name"),
    (["2a/image", "b/image"], [""], "camera name '2a' refused"),
])
def test_a_camera_list_that_cannot_be_taken_says_why(topics, names, reason):
    with pytest.raises(ValueError, match=reason):
        camera_topics(topics, names)


@pytest.mark.parametrize("text, value", [("[front/image, rear/image]", ["front/image", "rear/image"]),
                                         ("front/image,rear/image", ["front/image", "rear/image"]),
                                         ("['a', \"b\"]", ["a", "b"]), ("[]", [])])
def test_a_list_parameter_from_a_launch_argument(text, value):
    assert ValueRule("image_topics", list).from_text(text) == value
    assert ValueRule("image_topics", list).problem([1, 2]) is not None


@pytest.mark.parametrize("args, reason", [
    ((0, None, None, None), "limit"), ((101, None, None, None), "limit"), ((5, 5.0, 1.0, None), "until < since"),
    ((5, None, None, (0.0, float("nan"), 1.0)), "finite"), ((5, None, None, (0.0, 0.0, 0.0)), "radius"),
    ((5, None, None, (0.0, 0.0, -1.0)), "radius"), ((5, None, None, None, "rear left"), "camera name"),
])
def test_one_rule_for_a_recalls_arguments(args, reason):
    """The rule the node's ~/recall and the stream's own callers are held to (engine/value_rules.py)."""
    from inf_mllm_ros.engine.value_rules import recall_problem

    assert reason in recall_problem(*args)
    assert recall_problem(5, 1.0, 5.0, (0.0, 0.0, 2.0), "rear") is None
