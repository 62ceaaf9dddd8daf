"""Route bags (bags/route_bag.py, bags/route_scenario.py): every topic at its rate, readable by the project's reader
and by rosbags'; odometry that drifts while the localiser's map -> odom puts the robot back on the truth; things
seen more than once at places apart; narration that names no place; questions of every kind whose expected answers
agree with the sightings; the same seed, the same bag."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from inf_mllm_ros.bags.bag_io import iter_messages, open_bag
from inf_mllm_ros.bags.route_bag import (CAMERA_TOPIC, NARRATION_TOPIC, ODOMETRY_TOPIC, START_NS, TF_STATIC_TOPIC,
                                         TF_TOPIC, main, truth_document, write_route_bag)
from inf_mllm_ros.bags.route_scenario import (CATALOG, CATALOG_BY_NAME, KINDS, LOCALISER_HZ, ODOM_HZ,
                                              QUESTION_TEMPLATES, SEEN_CHECK, SIGHT_RADIUS_M, build_route, compose)
from inf_mllm_ros.image_conversion import msg_to_rgb

SEEDS = (0, 1, 2)
DURATION, FPS, SIZE = 120.0, 2.0, (96, 72)
PLACE_WORDS = {"aisle", "cross-aisle", "corridor", "lane", "north", "south", "east", "west", "metres", "meters"}


def _yaw(q) -> float:
    return 2 * math.atan2(q.z, q.w)


def _read(path: Path) -> dict:
    """The bag's messages as plain arrays: odometry, both tf streams, frames and narration."""
    out = {"odom": [], "tf_odom": [], "tf_map": [], "static": [], "frames": [], "narration": [], "frame_ids": set()}
    with open_bag(path) as bag:
        out["topics"] = {t: (i.msgtype, i.count) for t, i in bag.topics.items()}
        out["start_ns"] = bag.start_ns
        for m in bag.messages():
            msg = m.msg
            if m.topic == ODOMETRY_TOPIC:
                p = msg.pose.pose
                out["odom"].append((m.timestamp_ns, msg.header.stamp.sec, msg.header.stamp.nanosec, p.position.x,
                                    p.position.y, _yaw(p.orientation)))
                out["frame_ids"].add(("odom", msg.header.frame_id, msg.child_frame_id))
            elif m.topic in (TF_TOPIC, TF_STATIC_TOPIC):
                for tf in msg.transforms:
                    stamp = (tf.header.stamp.sec * 1_000_000_000 + tf.header.stamp.nanosec - START_NS) / 1e9
                    row = (stamp, tf.transform.translation.x, tf.transform.translation.y,
                           _yaw(tf.transform.rotation), m.timestamp_ns)
                    key = {("odom", "base_link"): "tf_odom", ("map", "odom"): "tf_map",
                           ("base_link", "camera_link"): "static"}[(tf.header.frame_id, tf.child_frame_id)]
                    assert (key == "static") == (m.topic == TF_STATIC_TOPIC)
                    out[key].append(row)
            elif m.topic == CAMERA_TOPIC:
                out["frames"].append(m.timestamp_ns)
                out["frame_ids"].add(("camera", msg.header.frame_id, msg.format))
                if len(out["frames"]) == 1:
                    out["first_frame"] = msg_to_rgb(msg)
            elif m.topic == NARRATION_TOPIC:
                out["narration"].append(((m.timestamp_ns - START_NS) / 1e9, msg.data))
    for key in ("odom", "tf_odom", "tf_map", "static"):
        out[key] = np.asarray(out[key], dtype=float)
    return out


@pytest.fixture(scope="module")
def bags(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("route_bags")
    out = {}
    for seed in SEEDS:
        summary = write_route_bag(root / f"seed{seed}", seed, DURATION, FPS, SIZE)
        out[seed] = (summary, _read(summary.path))
    return out


def _localised(data: dict, t: float) -> tuple[float, float, float]:
    """map -> base_link at `t` from the bag: the latest map -> odom stamped by then, composed with odom -> base_link
    (between its samples linearly)."""
    tm, to = data["tf_map"], data["tf_odom"]
    row = tm[np.searchsorted(tm[:, 0], t, side="right") - 1]
    odom = tuple(float(np.interp(t, to[:, 0], to[:, k])) for k in (1, 2, 3))
    return tuple(float(v) for v in compose(tuple(row[1:4]), odom))


# --- topics, rates and readers --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_every_topic_at_its_rate(bags, seed: int) -> None:
    summary, data = bags[seed]
    scenario = summary.scenario
    odom_n, frame_n = int(DURATION * ODOM_HZ), int(DURATION * FPS)
    assert data["topics"] == {
        ODOMETRY_TOPIC: ("nav_msgs/msg/Odometry", odom_n),
        TF_TOPIC: ("tf2_msgs/msg/TFMessage", odom_n + len(data["tf_map"])),
        TF_STATIC_TOPIC: ("tf2_msgs/msg/TFMessage", 1),
        CAMERA_TOPIC: ("sensor_msgs/msg/CompressedImage", frame_n),
        NARRATION_TOPIC: ("std_msgs/msg/String", len(scenario.narration)),
    }
    assert data["start_ns"] == START_NS
    assert data["frame_ids"] == {("odom", "odom", "base_link"), ("camera", "camera_link", "jpeg")}
    stamps = data["odom"][:, 1] + data["odom"][:, 2] / 1e9 - START_NS / 1e9
    assert np.allclose(np.diff(stamps), 1 / ODOM_HZ, atol=1e-6)
    assert np.allclose(data["tf_odom"][:, 0], stamps, atol=1e-9)
    assert np.allclose(data["tf_odom"][:, 1:4], data["odom"][:, 3:6])  # the broadcaster sends what /odom says
    localiser_rate = (len(data["tf_map"]) - 1) / (data["tf_map"][-1, 0] - data["tf_map"][0, 0])
    assert abs(localiser_rate - LOCALISER_HZ) < 0.1
    lag = (data["tf_map"][:, 4] - START_NS) / 1e9 - data["tf_map"][:, 0]
    assert 0.02 < lag.min() and lag.max() < 0.1  # published a little after the scan it was computed from
    assert data["frames"] == [START_NS + round(i / FPS * 1e9) for i in range(frame_n)]
    assert data["first_frame"].shape == (SIZE[1], SIZE[0], 3)
    assert len(data["static"]) == 1 and data["static"][0, 4] == START_NS and data["static"][0, 1] > 0
    assert [t for t, _ in data["narration"]] == sorted(t for t, _ in data["narration"])


def test_rosbags_anyreader_reads_the_bag_with_its_static_qos(bags) -> None:
    from rosbags.highlevel import AnyReader
    from rosbags.interfaces import QosDurability
    from rosbags.typesys import Stores, get_typestore

    summary, data = bags[SEEDS[0]]
    with AnyReader([summary.path], default_typestore=get_typestore(Stores.LATEST)) as reader:
        counts = {c.topic: c.msgcount for c in reader.connections}
        static = next(c for c in reader.connections if c.topic == TF_STATIC_TOPIC)
        assert [q.durability for q in static.ext.offered_qos_profiles] == [QosDurability.TRANSIENT_LOCAL]
        seen = set()
        for conn, _, raw in reader.messages():
            if conn.topic not in seen:
                seen.add(conn.topic)
                reader.deserialize(raw, conn.msgtype)
    assert counts == {t: n for t, (_, n) in data["topics"].items()} and seen == set(counts)


# --- poses ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_odometry_drifts_and_the_localiser_puts_the_robot_back_on_the_truth(bags, seed: int) -> None:
    summary, data = bags[seed]
    scenario = summary.scenario
    # Odometry alone, started on the true start pose: off the truth, by the end and on the way.
    to = data["tf_odom"]
    start = tuple(np.full(len(to), float(v)) for v in scenario.pose_at(0.0))
    dead_x, dead_y, _ = compose(start, (to[:, 1], to[:, 2], to[:, 3]))
    true_x, true_y, _ = scenario.pose_at(to[:, 0])
    drifts = np.hypot(dead_x - true_x, dead_y - true_y)
    drift = float(drifts[-1])
    assert drift > 0.15 and drifts.max() > 0.25, (drift, drifts.max())
    assert drift == pytest.approx(summary.drift_end_m, abs=1e-3)
    # The localiser's corrections come in steps, and with them the pose is the truth within a few centimetres.
    steps = np.hypot(np.diff(data["tf_map"][:, 1]), np.diff(data["tf_map"][:, 2]))
    assert np.count_nonzero(steps > 1e-4) > 0.9 * len(steps)
    errors = []
    for s in scenario.sightings:
        x, y, yaw = _localised(data, s.time_s)
        errors.append(math.hypot(x - s.pose[0], y - s.pose[1]))
        assert abs((yaw - s.pose[2] + math.pi) % (2 * math.pi) - math.pi) < 0.03
    assert max(errors) < 0.15 and np.mean(errors) < 0.08, errors
    assert drift > 3 * np.mean(errors)


# --- sightings and narration ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_a_thing_is_seen_again_at_a_place_apart(bags, seed: int) -> None:
    scenario = bags[seed][0].scenario
    apart = [name for name in {s.thing for s in scenario.sightings}
             if max((math.dist(a.pose[:2], b.pose[:2]) for a in scenario.sightings_of(name)
                     for b in scenario.sightings_of(name)), default=0.0) > 3.0]
    assert apart
    moved = [th for th in scenario.things if len(th.placements) > 1]
    assert any(th.name in apart for th in moved)
    for s in scenario.sightings:  # the truth's sighting: the robot was within sight of the thing where it stood
        x, y, _ = scenario.pose_at(s.closest_s)
        assert math.dist((x, y), s.thing_xy) == pytest.approx(s.distance_m, abs=1e-3) and s.distance_m < SIGHT_RADIUS_M
        assert scenario.thing(s.thing).position_at(s.closest_s) == pytest.approx(s.thing_xy, abs=1e-3)
        assert 0.0 <= s.time_s - s.closest_s <= 1.0
        assert s.pose == pytest.approx(tuple(float(v) for v in scenario.pose_at(s.time_s)[:2]) + (s.pose[2],),
                                       abs=1e-3)


@pytest.mark.parametrize("seed", SEEDS)
def test_sighting_narration_names_neither_place_nor_coordinates(bags, seed: int) -> None:
    summary, data = bags[seed]
    scenario = summary.scenario
    assert len(data["narration"]) > len(scenario.sightings)  # filler among them
    wordings = set()
    for s in scenario.sightings:
        text = next(t for when, t in data["narration"] if abs(when - s.time_s) < 1e-6 and t == s.text)
        words = set(re.findall(r"[a-z-]+", text.lower()))
        assert not re.search(r"\d", text), text
        assert not words & (PLACE_WORDS | set(re.findall(r"[a-z-]+", s.place))), (text, s.place)
        assert any(phrase in text.lower() for phrase in CATALOG_BY_NAME[s.thing].said), text
        wordings.add(re.sub(r"\b(an?|the|some)\b.*", "", text.lower()))
    assert len(wordings) >= 3  # several wordings
    sighted = {round(s.time_s, 3) for s in scenario.sightings}
    filler = [t for when, t in data["narration"] if round(when, 3) not in sighted]
    assert filler and not any(phrase in t.lower() for t in filler for k in CATALOG_BY_NAME.values()
                              for phrase in k.said if len(phrase) > 5)


# --- questions ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_questions_cover_every_kind_and_agree_with_the_sightings(bags, seed: int) -> None:
    scenario = bags[seed][0].scenario
    questions = scenario.questions
    assert len(questions) >= 20 and {q.kind for q in questions} == set(KINDS)
    driven = scenario.route.s <= float(scenario.route.s_at(DURATION))
    for q in questions:
        seen = scenario.sightings_of(q.thing)
        kind = CATALOG_BY_NAME[q.thing]
        assert not any(p in q.question.lower() for p in kind.said if " " in p), q.question  # other words
        assert q.asked_s == DURATION
        if q.kind == "never_seen":
            assert not seen and q.expected == {"seen": False}
            for th in (th for th in scenario.things if th.name == q.thing):
                for p in th.placements:
                    gap = np.min(np.hypot(scenario.route.x[driven] - p.x, scenario.route.y[driven] - p.y))
                    assert gap > SIGHT_RADIUS_M
            continue
        assert seen
        one = seen[-1] if q.kind in ("where_last", "when_last", "how_long_ago") else seen[0]
        assert one.time_s == (max if one is seen[-1] else min)(s.time_s for s in seen)
        assert q.expected["time_s"] == one.time_s
        if q.kind.startswith("where"):
            assert (q.expected["x"], q.expected["y"]) == one.pose[:2] and q.expected["place"] == one.place
        if q.kind == "how_long_ago":
            assert q.expected["seconds"] == pytest.approx(DURATION - one.time_s)
    assert any(q.kind == "where_last" and len(scenario.sightings_of(q.thing)) > 1 for q in questions)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_question_asks_each_thing_every_kind_and_leaves_the_drive_as_it_was(seed: int) -> None:
    drawn, every = build_route(seed, DURATION), build_route(seed, DURATION, questions="every")
    assert (every.sightings, every.narration, every.things) == (drawn.sightings, drawn.narration, drawn.things)
    on_floor = {th.name for th in every.things}
    assert set(drawn.absent) <= set(every.absent)
    assert set(every.absent) == {k.name for k in CATALOG} - on_floor  # every catalog thing not on the floor
    seen = {s.thing for s in every.sightings}
    assert set(every.never_seen) == {k.name for k in CATALOG} - seen
    asked = sorted((q.thing, q.kind) for q in every.questions)
    assert asked == sorted([(n, k) for n in seen for k in (*KINDS[:-1], SEEN_CHECK)]
                           + [(n, "never_seen") for n in every.never_seen])
    # The control comes last and asks what never_seen asks, of the things seen.
    controls = [q for q in every.questions if q.kind == SEEN_CHECK]
    assert list(every.questions[-len(controls):]) == controls and all(q.expected == {"seen": True} for q in controls)
    forms = {t.split("{")[0] for t in QUESTION_TEMPLATES["never_seen"]}
    assert all(any(q.question.startswith(f) for f in forms) for q in controls)
    for q in every.questions:
        assert q.asked_s == DURATION
        assert not any(p in q.question.lower() for p in CATALOG_BY_NAME[q.thing].said if " " in p), q.question
        seen_of = every.sightings_of(q.thing)
        if q.kind in ("never_seen", SEEN_CHECK):
            assert bool(seen_of) == (q.kind == SEEN_CHECK) and q.expected == {"seen": bool(seen_of)}
            continue
        one = seen_of[-1] if q.kind in ("where_last", "when_last", "how_long_ago") else seen_of[0]
        assert q.expected["time_s"] == one.time_s
        if q.kind.startswith("where"):
            assert (q.expected["x"], q.expected["y"]) == one.pose[:2]
    with pytest.raises(ValueError, match="questions"):
        build_route(seed, DURATION, questions="some")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("questions", ["drawn", "every"])
def test_questions_in_the_narrations_words_ask_the_same_of_the_same_things(seed: int, questions: str) -> None:
    asked = build_route(seed, DURATION, questions=questions)
    said = build_route(seed, DURATION, questions=questions, names="said")
    assert (said.sightings, said.narration) == (asked.sightings, asked.narration)
    assert [(q.thing, q.kind, q.expected) for q in said.questions] == [(q.thing, q.kind, q.expected)
                                                                       for q in asked.questions]
    for a, s in zip(asked.questions, said.questions):
        kind = CATALOG_BY_NAME[s.thing]
        assert kind.said[0] in s.question, s.question
        assert not any(n in s.question for n in kind.asked if n not in kind.said[0]), s.question
        assert a.question != s.question or kind.said[0] in kind.asked  # "forklift" is asked as it is said
    with pytest.raises(ValueError, match="names"):
        build_route(seed, DURATION, names="other")


# --- determinism and the command line ------------------------------------------------------------------------

def test_the_same_seed_gives_the_same_truth_and_another_seed_another() -> None:
    a, b, c = (truth_document(build_route(seed, DURATION)) for seed in (5, 5, 6))
    assert a == b and a != c
    assert a["sightings"] != c["sightings"] and a["questions"] != c["questions"]


def test_the_same_seed_writes_the_same_messages(tmp_path) -> None:
    first, second = (write_route_bag(tmp_path / name, 7, 40.0, FPS, SIZE) for name in ("a", "b"))
    messages = [[(m.topic, m.timestamp_ns, m.rawdata) for m in iter_messages(s.path)] for s in (first, second)]
    assert messages[0] == messages[1] and len(messages[0]) > 2000


def test_command_line_writes_the_bag_and_its_truth(tmp_path, capsys) -> None:
    out = tmp_path / "drive"
    assert main([str(out), "--seed", "3", "--duration", "40", "--fps", "1", "--size", "64x48"]) == 0
    truth = yaml.safe_load((out / "truth.yaml").read_text())
    assert truth["seed"] == 3 and truth["duration_s"] == 40.0 and truth["start_ns"] == START_NS
    assert {q["kind"] for q in truth["questions"]} <= set(KINDS) and truth["sightings"]
    assert truth["sightings"][0]["pose"].keys() == {"x", "y", "yaw"}
    with open_bag(out) as bag:
        assert bag.topics[CAMERA_TOPIC].count == 40
    assert main([str(out), "--seed", "3"]) == 2  # the folder exists
    assert "exists" in capsys.readouterr().err
