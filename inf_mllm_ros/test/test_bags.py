"""Sample bags: the generator writes real rosbag2 bags that bag_io reads back exactly,
the committed demo bag matches its scenario, and broken bags fail with clear BagErrors."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from inf_mllm_ros.bags.bag_io import BagError, iter_messages, open_bag
from inf_mllm_ros.image_conversion import msg_to_rgb
from inf_mllm_ros.input_rules import stamp_seconds
from inf_mllm_ros.bags.stream_inputs import load_questions, tally
from inf_mllm_ros.bags.sample_bag import (
    CAMERA_TOPIC_COMPRESSED,
    CAMERA_TOPIC_RAW,
    NARRATION_TOPIC,
    ODOMETRY_TOPIC,
    START_NS,
    build_scenario,
    main,
    probe_questions,
    render_frame,
    scenario_events,
    write_sample_bag,
)

DEMO_BAG = Path(__file__).resolve().parents[1] / "sample_bags" / "warehouse_shift"
SMALL = dict(duration_s=6.0, fps=2.0, size=(96, 72), seed=3)


@pytest.fixture(scope="module")
def small_bags(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bags")
    return {storage: write_sample_bag(root / storage, storage=storage, **SMALL).path
            for storage in ("mcap", "sqlite3")}


def _raw_reference(path: Path) -> list[tuple[str, int, bytes]]:
    """The bag as rosbags' own reader sees it, for an independent comparison."""
    from rosbags.rosbag2 import Reader

    with Reader(path) as reader:
        items = [(c.topic, t, bytes(d)) for c, t, d in reader.messages()]
    return sorted(items, key=lambda item: (item[1], item[0]))


# --- generator and reader round trip ---------------------------------------------------------

@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_generated_bag_reads_back_message_for_message(small_bags, storage: str) -> None:
    path = small_bags[storage]
    with open_bag(path) as bag:
        assert {t: (i.msgtype, i.count) for t, i in bag.topics.items()} == {
            CAMERA_TOPIC_COMPRESSED: ("sensor_msgs/msg/CompressedImage", 12),
            NARRATION_TOPIC: ("std_msgs/msg/String", 2),
            ODOMETRY_TOPIC: ("nav_msgs/msg/Odometry", 60),
        }
        assert bag.start_ns == START_NS and bag.message_count == 74
        items = list(bag.messages())
    assert [(m.topic, m.timestamp_ns, m.rawdata) for m in items] == _raw_reference(path)
    stamps = [m.timestamp_ns for m in items]
    assert stamps == sorted(stamps)
    frames = [m.timestamp_ns - START_NS for m in items if m.topic == CAMERA_TOPIC_COMPRESSED]
    assert frames == [i * 500_000_000 for i in range(12)]


def test_mcap_and_sqlite3_hold_the_same_messages(small_bags) -> None:
    def read(path: Path) -> list:
        return [(m.topic, m.msgtype, m.timestamp_ns, m.rawdata) for m in iter_messages(path)]

    mcap, sqlite = read(small_bags["mcap"]), read(small_bags["sqlite3"])
    assert mcap == sqlite and len(mcap) == 74


def test_generated_frames_and_narration_decode(small_bags) -> None:
    events = scenario_events(SMALL["duration_s"], SMALL["seed"])
    texts, frames = [], 0
    for item in iter_messages(small_bags["mcap"]):
        if item.topic == NARRATION_TOPIC:
            texts.append((item.timestamp_ns / 1e9, item.msg.data))
        elif item.topic == ODOMETRY_TOPIC:
            assert item.msg.header.frame_id == "map" and item.msg.child_frame_id == "base_link"
        else:
            rgb = msg_to_rgb(item.msg)
            assert rgb.shape == (72, 96, 3) and rgb.dtype == np.uint8
            # The header agrees with bag time.
            assert stamp_seconds(item.msg.header.stamp, 0) == pytest.approx(item.timestamp_ns / 1e9)
            assert item.msg.header.frame_id == "warehouse_cam"
            frames += 1
    assert frames == 12
    assert texts == [(START_NS / 1e9 + e.time_s, e.text) for e in events]


def test_topic_filter_and_errors_for_requested_topics(small_bags) -> None:
    only = list(iter_messages(small_bags["sqlite3"], topics=[NARRATION_TOPIC]))
    assert [m.topic for m in only] == [NARRATION_TOPIC] * 2
    with pytest.raises(BagError, match=r"no topic '/nope'.*it has /camera"):
        iter_messages(small_bags["sqlite3"], topics=["/nope"])


def test_raw_frames_are_exactly_the_rendered_scene(tmp_path: Path) -> None:
    summary = write_sample_bag(tmp_path / "raw", raw=True, storage="sqlite3",
                               duration_s=2.0, fps=1.0, size=(80, 60), seed=5)
    assert summary.topics == {CAMERA_TOPIC_RAW: "sensor_msgs/msg/Image",
                              NARRATION_TOPIC: "std_msgs/msg/String", ODOMETRY_TOPIC: "nav_msgs/msg/Odometry"}
    scenario = build_scenario(2.0, 5)
    rng = np.random.default_rng(5)  # the generator draws frame noise in frame order
    frames = [m for m in iter_messages(summary.path, [CAMERA_TOPIC_RAW])]
    assert len(frames) == 2
    for i, item in enumerate(frames):
        assert item.msg.encoding == "rgb8"
        rgb = msg_to_rgb(item.msg)
        np.testing.assert_array_equal(rgb, render_frame(scenario, float(i), 80, 60, rng))


def test_cli_writes_bag_and_questions(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli_bag"
    assert main([str(out), "--storage", "sqlite3", "--duration", "3", "--fps", "1",
                 "--size", "64x48", "--seed", "1"]) == 0
    assert (out / "metadata.yaml").is_file() and list(out.glob("*.db3"))
    assert yaml.safe_load((out / "questions.yaml").read_text()) == []  # none fit in 3 s
    assert "/narration" in capsys.readouterr().out
    assert main([str(out)]) == 2  # refuses to overwrite
    assert "exists" in capsys.readouterr().err


def test_long_scenario_stays_consistent_with_its_frames() -> None:
    scenario = build_scenario(400.0, seed=7)
    assert len(scenario.events) > 30 and len(scenario.probes) > 30
    for event in scenario.events:
        text = event.text
        if "parked at dock" in text:
            dock = text.rsplit(" ", 1)[1].rstrip(".")
            assert scenario.place_of("F2", event.time_s) == f"dock {dock}", text
        if "moved to shelf" in text:
            pallet, shelf = text.split()[1], text.rstrip(".").split()[-1]
            assert scenario.place_of(pallet, event.time_s) == f"shelf {shelf}", text
        if "light turned" in text:
            colour = text.rstrip(".").split()[-1]
            assert scenario.tracks["D1"].state(event.time_s)[1] == colour, text
    assert build_scenario(400.0, seed=7).events == scenario.events  # seeded: reproducible
    assert build_scenario(400.0, seed=8).events != scenario.events


@pytest.mark.parametrize("seed", [0, 3, 11, 1000])
def test_the_patrol_robot_reports_where_its_odometry_puts_it(tmp_path: Path, seed: int) -> None:
    from inf_mllm_ros.bags.warehouse_layout import PLACES_M
    from inf_mllm_ros.bags.warehouse_patrol import ROBOT_SPEED

    scenario = build_scenario(600.0, seed)
    reports = [e for e in scenario.events if e.text.startswith("Patrol robot")]
    assert len(reports) >= 4, reports
    for event in reports:
        place = event.text.rstrip(".").split(" at ", 1)[1]
        assert math.dist(scenario.robot_xy(event.time_s), PLACES_M[place]) < 1e-6, event
    by_kind = {}
    for probe in scenario.probes:
        by_kind.setdefault(probe.kind, []).append(probe)
    assert len(by_kind["temporal"]) == len(by_kind["spatial"]) + 1 >= 5  # and the script's temporal question
    for probe in by_kind["spatial"]:
        assert probe.expected == probe.place and probe.time_s > probe.about_s
        said = [e for e in reports if e.time_s == probe.about_s]
        assert said and probe.place in said[0].text
    # The odometry drives at the robot's speed (within a step's rounding) and stays on the floor.
    poses = list(scenario.robot_poses(10.0))
    steps = [math.dist(a[1:3], b[1:3]) * 10.0 for a, b in zip(poses, poses[1:])]
    assert max(steps) <= ROBOT_SPEED * 1.01 and sum(s > 0 for s in steps) > len(steps) / 3
    assert all(0 <= x <= 40 and 0 <= y <= 30 for _, x, y, _, _ in poses)


# --- the committed demo bag ------------------------------------------------------------------

def test_demo_bag_reads_and_matches_its_scenario() -> None:
    with open_bag(DEMO_BAG) as bag:
        assert {t: i.count for t, i in bag.topics.items()} == {
            CAMERA_TOPIC_COMPRESSED: 40, NARRATION_TOPIC: 8, ODOMETRY_TOPIC: 400}
        items = list(bag.messages())
    texts = [m.msg.data for m in items if m.topic == NARRATION_TOPIC]
    assert texts == [e.text for e in scenario_events(40.0)]
    assert "Forklift F2 parked at dock 3." in texts
    scenario = build_scenario(40.0)
    frames = [m for m in items if m.topic == CAMERA_TOPIC_COMPRESSED]
    for index in (0, 18, 39):  # JPEG of the same drawing: close, not exact
        rgb = msg_to_rgb(frames[index].msg)
        assert rgb.shape == (240, 320, 3)
        assert stamp_seconds(frames[index].msg.header.stamp, 0) == pytest.approx(START_NS / 1e9 + index)
        drawn = render_frame(scenario, float(index), 320, 240)
        assert np.abs(rgb.astype(int) - drawn.astype(int)).mean() < 6
    size = sum(p.stat().st_size for p in DEMO_BAG.iterdir())
    assert size < 3_000_000


def test_demo_questions_file_matches_the_scenario() -> None:
    listed = yaml.safe_load((DEMO_BAG / "questions.yaml").read_text())
    assert [(q["time_s"], q["question"], q["expected"], q.get("needs_vision", False), q.get("kind", "descriptive"),
             q.get("about_s"), q.get("place")) for q in listed] == [tuple(p) for p in probe_questions(40.0)]
    [when] = [q for q in load_questions(DEMO_BAG / "questions.yaml") if q.kind == "temporal"]
    assert (when.expected, when.about_s) == ("08:00:31", 31.0)
    # A time of day holds however it is written, within 2 s; another time does not.
    assert [when.matches(a) for a in ("At 8:00:31.", "at 08:00:32 UTC", "08:00:05", "at 8:00", "half past eight")] \
        == [True, True, False, False, False]
    first = {"time_s": 8.0, "question": "Where did forklift F2 park?", "expected": "dock 3"}
    assert first in listed
    # The forklift's colour is drawn, never narrated: only a model that sees can answer it.
    vision = [q for q in load_questions(DEMO_BAG / "questions.yaml") if q.needs_vision]
    assert [q.question for q in vision] == ["What colour is the forklift?"]
    forklift_lines = [e.text.lower() for e in scenario_events(40.0) if "forklift" in e.text.lower()]
    assert forklift_lines and not any(re.search(r"\bred\b", line) for line in forklift_lines)


# --- broken bags -----------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_bag"
    with pytest.raises(BagError, match="no_such_bag: no such bag"):
        open_bag(missing)
    with pytest.raises(BagError, match="no such bag"):
        iter_messages(missing)


def test_not_a_bag(tmp_path: Path) -> None:
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(BagError, match="empty_dir: not a rosbag2 bag: the folder has no metadata"):
        open_bag(tmp_path / "empty_dir")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(BagError, match=r"notes.txt: not a rosbag2 bag: expected a folder"):
        open_bag(tmp_path / "notes.txt")


@pytest.mark.parametrize("text", ["{{{ not: yaml ::", "just_a_string",
                                  "rosbag2_bagfile_information: {}"])
def test_garbage_metadata(small_bags, tmp_path: Path, text: str) -> None:
    bag = _copy(small_bags["mcap"], tmp_path / "bad_meta")
    (bag / "metadata.yaml").write_text(text)
    with pytest.raises(BagError, match=r"bad_meta: malformed bag"):
        open_bag(bag)


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_truncated_storage(small_bags, tmp_path: Path, storage: str) -> None:
    bag = _copy(small_bags[storage], tmp_path / f"cut_{storage}")
    data_file = next(p for p in bag.iterdir() if p.suffix in (".mcap", ".db3"))
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    with pytest.raises(BagError, match=f"cut_{storage}") as info:
        list(iter_messages(bag))
    assert "malformed bag" in str(info.value) or "storage is damaged" in str(info.value)


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_garbage_storage(small_bags, tmp_path: Path, storage: str) -> None:
    bag = _copy(small_bags[storage], tmp_path / f"junk_{storage}")
    data_file = next(p for p in bag.iterdir() if p.suffix in (".mcap", ".db3"))
    data_file.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(BagError, match=f"junk_{storage}"):
        list(iter_messages(bag))


def _write_custom_bag(path: Path, storage: str, *, embed: bool) -> None:
    """A bag with a custom message type, with or without its definition embedded."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore, get_types_from_msg

    store = get_typestore(Stores.LATEST)
    store.register(get_types_from_msg("string name\nfloat32 level", "acme_msgs/msg/Beacon"))
    Beacon = store.types["acme_msgs/msg/Beacon"]
    plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
    with Writer(path, version=8, storage_plugin=plugin) as writer:
        if embed:
            conn = writer.add_connection("/beacon", "acme_msgs/msg/Beacon", typestore=store)
        else:
            conn = writer.add_connection("/beacon", "acme_msgs/msg/Beacon", msgdef="",
                                         rihs01="RIHS01_" + "0" * 64)
        # A standard type without embedded definition resolves from the type store.
        chat = writer.add_connection("/chat", "std_msgs/msg/String", msgdef="",
                                     rihs01="RIHS01_" + "0" * 64)
        writer.write(conn, 10, store.serialize_cdr(Beacon(name="b1", level=0.5),
                                                   "acme_msgs/msg/Beacon"))
        writer.write(chat, 20, store.serialize_cdr(store.types["std_msgs/msg/String"](data="hi"),
                                                   "std_msgs/msg/String"))


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_unknown_message_type(tmp_path: Path, storage: str) -> None:
    path = tmp_path / "unknown"
    _write_custom_bag(path, storage, embed=False)
    with open_bag(path) as bag:
        assert bag.unknown_types == {"acme_msgs/msg/Beacon": ["/beacon"]}
        with pytest.raises(BagError, match=r"unknown: topic '/beacon' has message type "
                                           r"'acme_msgs/msg/Beacon', which has no definition"):
            bag.messages(["/beacon"])
        items = list(bag.messages())
        assert [m.topic for m in items] == ["/beacon", "/chat"]
        assert (items[1].msg.data, items[1].timestamp_ns) == ("hi", 20)
        with pytest.raises(BagError, match="acme_msgs/msg/Beacon"):
            items[0].msg


def test_custom_type_with_embedded_definition_reads(tmp_path: Path) -> None:
    path = tmp_path / "custom"
    _write_custom_bag(path, "mcap", embed=True)
    item = next(iter_messages(path, ["/beacon"]))
    assert item.msg.name == "b1" and item.msg.level == pytest.approx(0.5)


def test_topic_without_messages(tmp_path: Path) -> None:
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    path = tmp_path / "quiet"
    with Writer(path, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
        writer.add_connection("/silent", "std_msgs/msg/String",
                              typestore=get_typestore(Stores.LATEST))
    with pytest.raises(BagError, match=r"quiet: no messages on '/silent'"):
        iter_messages(path, ["/silent"])


def _as_written_by(bag: Path, distro: str) -> None:
    """Make a sqlite3 bag look as that distribution's rosbag2 writes it, without embedded types.

    Humble writes metadata version 5 (no ros_distro, no type hashes) and db schema 3 (no
    message_definitions table); Jazzy and Kilted name themselves in metadata. Dropping the
    embedded definitions makes the reader take every type from that distribution's store.
    """
    import sqlite3

    db = next(bag.glob("*.db3"))
    with sqlite3.connect(db) as conn:
        if distro == "humble":
            conn.execute("DROP TABLE message_definitions")
            conn.execute("UPDATE schema SET schema_version = 3")
        else:
            conn.execute("DELETE FROM message_definitions")
    conn.close()
    meta = yaml.safe_load((bag / "metadata.yaml").read_text())
    info = meta["rosbag2_bagfile_information"]
    if distro == "humble":
        info["version"] = 5
        info.pop("ros_distro", None)
        for topic in info["topics_with_message_count"]:
            topic["topic_metadata"].pop("type_description_hash", None)
    else:
        info["version"] = {"jazzy": 8, "kilted": 9}[distro]
        info["ros_distro"] = distro
    (bag / "metadata.yaml").write_text(yaml.safe_dump(meta))


@pytest.mark.parametrize("distro", ["humble", "jazzy", "kilted"])
def test_bags_without_embedded_types_from_each_distribution(small_bags, tmp_path: Path,
                                                            distro: str) -> None:
    bag = _copy(small_bags["sqlite3"], tmp_path / distro)
    _as_written_by(bag, distro)
    with open_bag(bag) as opened:
        assert opened.ros_distro == (None if distro == "humble" else distro)
        assert opened.unknown_types == {}
        texts = [m.msg.data for m in opened.messages([NARRATION_TOPIC])]
        frame = next(opened.messages([CAMERA_TOPIC_COMPRESSED]))
        assert msg_to_rgb(frame.msg).shape == (72, 96, 3)
    assert texts == [e.text for e in scenario_events(SMALL["duration_s"], SMALL["seed"])]


def test_tally_counts_text_and_vision_questions_apart() -> None:
    graded = [(True, False), (False, False), (None, False), (True, True), (False, True), (False, True)]
    assert tally(graded) == ("1 of 2 answerable from the texts; 1 of 3 that need trained vision hold the "
                             "expected words")
    assert tally([(True, False)]) == "1 of 1 answerable from the texts hold the expected words"
    assert tally([(None, True)]) == ""
