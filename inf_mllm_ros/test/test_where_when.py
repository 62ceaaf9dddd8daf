"""Where and when: the robot's poses kept beside its inputs (engine/poses.py), evidence for answers and recall
without an answer (engine/archive/evidence.py).

Pose rules on their own; poses travelling with the archive's blocks and surviving a restart on a tiny model;
the planted moment found first, by a question's evidence and by a recall, on real SmolLM2 weights over streams
of several caches, at several seeds and offsets."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.archive.evidence import Evidence, asked_order, in_asked_order, without_order
from inf_mllm_ros.engine.persistence.memory_file import load_memory, save_memory
from inf_mllm_ros.engine.poses import Pose, PoseHistory, PoseRefusedError, interpolate
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import build_model_folder

from conftest import load_prepared

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def yaw(angle: float) -> Pose:
    return Pose(0.0, 0.0, 0.0, 0.0, 0.0, math.sin(angle / 2), math.cos(angle / 2))


def test_a_pose_between_two_is_interpolated_and_none_is_given_beyond_the_tolerance():
    history = PoseHistory("map", tolerance=0.5)
    history.add(10.0, Pose(0.0, 0.0, 0.0), "map")
    history.add(11.0, Pose(2.0, 4.0, 0.0, *yaw(math.pi / 2).as_tuple()[3:]), "map")
    half = history.at(10.5)
    assert (half.x, half.y) == pytest.approx((1.0, 2.0))
    assert 2 * math.atan2(half.qz, half.qw) == pytest.approx(math.pi / 4), "orientation half way round"
    assert history.at(10.0) == Pose(0.0, 0.0, 0.0) and history.at(11.2).x == 2.0, "the nearest, within tolerance"
    assert history.at(11.6) is None and history.at(9.4) is None and history.at(None) is None
    history.add(20.0, Pose(5.0, 0.0, 0.0), "map")
    assert history.at(15.5) is None, "both neighbours farther than the tolerance"
    assert interpolate(yaw(3.1), yaw(-3.1), 0.5).qw == pytest.approx(0.0, abs=1e-6), "the short way round"


@pytest.mark.parametrize("stamp, pose, frame, reason", [
    (12.0, Pose(math.nan, 0.0, 0.0), "map", "finite"),
    (math.inf, Pose(0.0, 0.0, 0.0), "map", "finite"),
    (12.0, Pose(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5), "map", "unit quaternion"),
    (12.0, Pose(0.0, 0.0, 0.0), "odom", "frame"),
    (9.5, Pose(0.0, 0.0, 0.0), "map", "out of order"),
])
def test_a_bad_pose_is_refused_with_its_reason_and_nothing_is_kept(stamp, pose, frame, reason):
    history = PoseHistory("", tolerance=1.0, length=3)
    history.add(10.0, Pose(1.0, 1.0, 0.0), "map")
    assert history.frame_id == "map", "the first pose's frame when none is configured"
    with pytest.raises(PoseRefusedError, match=reason):
        history.add(stamp, pose, frame)
    assert len(history) == 1 and history.at(10.0) == Pose(1.0, 1.0, 0.0)
    for t in range(11, 16):
        history.add(float(t), Pose(float(t), 0.0, 0.0), "map")
    assert len(history) == 3 and history.at(10.0) is None, "bounded: the oldest go"


@pytest.mark.parametrize("back", [1.5, 30.0, 600.0])
def test_a_jump_back_in_time_starts_the_history_again_and_says_how_far(back):
    """A looped bag or a simulator reset: the poses after the jump are taken, none from before it is used."""
    history = PoseHistory("map", tolerance=0.5)
    for t in range(100, 111):
        assert history.add(float(t), Pose(float(t), 0.0, 0.0), "map") == 0.0
    assert history.add(110.0 - back, Pose(-1.0, 0.0, 0.0), "map") == pytest.approx(back)
    assert len(history) == 1 and history.at(105.0) is None and history.at(110.0 - back) == Pose(-1.0, 0.0, 0.0)
    assert history.add(110.5 - back, Pose(-2.0, 0.0, 0.0), "map") == 0.0


def test_inputs_carry_their_pose_into_the_archive_and_through_a_restart(tmp_path_factory, tmp_path):
    adapter = load_model(build_model_folder("qwen2_vl", tmp_path_factory.mktemp("tiny") / "m"), device="cpu",
                         dtype="float32")
    config = StreamConfig(capacity=48, chunk_size=16, archive_block=16)
    stream = KVStream(adapter, config)
    stream.push_text("The pallet is at dock 3.", stamp=1.0, pose=Pose(1.0, 2.0, 0.0))
    stream.push_text("Nobody knows where this was said.", stamp=2.0)
    stream.push_frame(np.random.default_rng(0).integers(0, 256, (84, 112, 3), dtype=np.uint8), stamp=3.0,
                      pose=Pose(5.0, 6.0, 0.0, *yaw(1.0).as_tuple()[3:]))
    stream.push_texts([("First of two.", 4.0, False, Pose(7.0, 0.0, 0.0)), ("Second of two.", 4.5)])
    poses = {b.stamp: b.pose for b in stream.archive.blocks}
    assert poses[1.0] == Pose(1.0, 2.0, 0.0) and poses[2.0] is None and poses[3.0].x == 5.0
    assert [b.frame for b in stream.archive.blocks if b.stamp == 3.0] == [True]
    stream.pose_frame = "map"
    save_memory(stream, tmp_path / "m")
    restored = KVStream(adapter, config)
    assert restored.pose_frame == ""
    load_memory(restored, tmp_path / "m")
    assert [(b.stamp, b.pose) for b in restored.archive.blocks] == [(b.stamp, b.pose) for b in stream.archive.blocks]
    assert restored.pose_frame == "map", "the frame of the poses is saved with them"


FILLER = ["A cart rolled past the shelves with boxes of screws.", "The floor near the window was swept again.",
          "Two workers talked about the weather during the break.", "A forklift beeped while it backed up slowly.",
          "The lights in the hall flickered for a moment.", "Someone stacked empty crates beside the wall."]


def planted_stream(adapter, seed: int, offset: int, messages: int = 45):
    """A stream of several caches' worth of filler, with one fact planted `offset` messages in; every message
    stamped one second apart and posed one metre apart along x."""
    rng = random.Random(seed)
    stream = KVStream(adapter, StreamConfig(capacity=128, chunk_size=32, archive_block=32))
    for i in range(messages):
        text = "The red cone is next to the charging dock." if i == offset else rng.choice(FILLER)
        stream.push_text(text, stamp=float(i), pose=Pose(float(i), 0.0, 0.0))
    assert stream.tokens_seen > 4 * 128, "the fact has long left the cache"
    return stream


@pytest.fixture(scope="module")
def smollm2():
    return load_prepared("smollm2")


PLANTED = [(0, 5), (1, 19), (2, 31)]  # (seed, offset): the streams the tests below share


@pytest.fixture(scope="module")
def planted(smollm2):
    """`(seed, offset)` -> its `planted_stream`, made once a module: the tests that take it only ask and recall,
    which leave the memory as it was."""
    made = {}

    def stream(seed: int, offset: int) -> KVStream:
        if (seed, offset) not in made:
            made[seed, offset] = planted_stream(smollm2, seed, offset)
        return made[seed, offset]

    return stream


@pytest.mark.parametrize("seed, offset", PLANTED)
def test_the_planted_moment_is_an_answers_heaviest_evidence_and_a_recalls_first(planted, seed, offset):
    stream = planted(seed, offset)
    answer = stream.ask("Where is the red cone?", max_new_tokens=12)
    top = answer.evidence[0]
    assert (top.stamp, top.pose, top.kind) == (float(offset), Pose(float(offset), 0.0, 0.0), "text")
    assert "red cone" in top.text and len(answer.evidence) == stream.config.evidence
    assert [e.weight for e in answer.evidence] == sorted((e.weight for e in answer.evidence), reverse=True)
    found = stream.recall("red cone", limit=3)
    assert found[0].stamp == float(offset) and found[0].source == "archive" and len(found) == 3
    # Filters: a time window or a place without the fact does not find it; with it, it comes first.
    assert all(e.stamp != float(offset) for e in stream.recall("red cone", until=offset - 1.0))
    assert stream.recall("red cone", since=offset - 2.0, until=offset + 2.0)[0].stamp == float(offset)
    near = stream.recall("red cone", near=(offset + 1.0, 0.0, 3.0))
    assert near[0].stamp == float(offset) and all(abs(e.pose.x - offset - 1.0) <= 3.0 for e in near)
    assert stream.recall("red cone", near=(offset + 50.0, 40.0, 2.0)) == []


@pytest.mark.parametrize("seed, offset", PLANTED)
def test_a_when_or_how_long_question_is_told_its_heaviest_evidences_moment_after_its_words(planted, seed, offset):
    stream = planted(seed, offset)
    placed = []
    place_steps = stream.place_steps  # the question goes in last, after what retrieval placed: its ids are kept here
    stream.place_steps = lambda prompt: placed.append(prompt.token_ids) or place_steps(prompt)
    before = (stream.cache.fill, stream.tokens_seen)
    try:
        when = stream.ask("When did you see the red cone?", max_new_tokens=2)
        asked_at = offset + 13.0 + 7 * seed  # the question's own time, later than any input
        ago = stream.ask("How many seconds ago did you see the red cone?", max_new_tokens=2, asked_at=asked_at)
        where = stream.ask("Where is the red cone?", max_new_tokens=2)
        stream.config = dataclasses.replace(stream.config, time_note=False)
        off = stream.ask("When did you see the red cone?", max_new_tokens=2)
    finally:
        stream.config = dataclasses.replace(stream.config, time_note=True)
        del stream.place_steps
    assert (stream.cache.fill, stream.tokens_seen) == before, "the note is said for one answer, never kept"
    for answer in (when, ago):
        assert answer.evidence[0].stamp == float(offset)
    marker = stream.marker_clock(float(offset))
    assert when.time_note == f" (Memory: The red cone is next to the charging dock. [{marker}]; when: {marker})"
    assert ago.time_note == f" (Memory: The red cone is next to the charging dock. [{asked_at - offset:.0f} seconds ago])"
    assert where.time_note == "" and off.time_note == ""
    # Said to the model right after the question's words, before the when prompt; not said where there is none.
    said = [stream.adapter.decode(ids.tolist()) for ids in placed[-4:]]
    assert f"When did you see the red cone?{when.time_note} {stream.config.when_prompt}" in said[0]
    assert f"How many seconds ago did you see the red cone?{ago.time_note} " in said[1]
    assert "(Memory:" not in said[2] and "(Memory:" not in said[3]


@pytest.mark.parametrize("question, note", [
    ("When did you last see the cart?", " (Memory: A blue cart here. [0:01:40.0]; when: 0:01:40.0)"),
    ("At what time did the door turn red?", " (Memory: A blue cart here. [0:01:40.0]; when: 0:01:40.0)"),
    ("How long ago did you see the cart?", " (Memory: A blue cart here. [35 seconds ago])"),
    ("How many minutes ago did you pass the cart?", " (Memory: A blue cart here. [35 seconds ago])"),
    ("how long has it been since you saw the cart?", " (Memory: A blue cart here. [35 seconds ago])"),
    ("Where did you see the cart?", ""),
    ("How many carts did you see?", ""),
    ("How many weeks passed between the cart and the crate?", ""),
    ("How long did you stay next to the cart?", ""),
])
def test_the_time_note_restates_the_heaviest_stamped_evidence_for_when_and_how_long_only(question, note):
    from inf_mllm_ros.engine.answering import time_note
    from inf_mllm_ros.engine.models.chat import MarkerClock

    system = Evidence(None, "text", "cache", None, "You are a robot.", 9.0, 0)  # unstamped: never the one said
    cart = Evidence(100.0, "text", "archive", None, "A blue cart here. [0:01:40.0]", 5.0, 40)
    assert time_note(question, [system, cart], MarkerClock(), 135.0) == note
    assert time_note(question, [system], MarkerClock(), 135.0) == ""
    # Words that say a date of their own are restated with their marker alone: they tell of that date.
    told = Evidence(100.0, "text", "archive", None, "Gina: I opened my store yesterday (7 May 2023). [0:01:40.0]", 5, 40)
    said = time_note(question, [told], MarkerClock(), 135.0)
    assert "when:" not in said and (said == "" or "yesterday (7 May 2023). [" in said)


@pytest.mark.parametrize("seconds, said", [(0.4, "0 seconds"), (87.3, "87 seconds"), (599, "599 seconds"),
                                           (600, "10 minutes"), (5400, "90 minutes"), (7200, "2 hours"),
                                           (90000, "25 hours"), (172800, "2 days"), (-3.0, "0 seconds")])
def test_a_span_is_said_in_the_unit_an_answer_uses(seconds, said):
    from inf_mllm_ros.engine.answering import said_elapsed

    assert said_elapsed(seconds) == said


THINGS = ["ladder", "toolbox", "helmet", "bucket", "tarp", "hose", "broom", "crate", "drum", "mop", "glove",
          "dustpan"]
PLACES = ["dock 1", "dock 2", "aisle 1", "aisle 2", "shelf B2", "charging station"]
COLOURS = ["red", "green", "blue", "yellow", "orange", "white", "black", "grey"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_of_reports_of_one_form_the_one_naming_the_thing_is_found(smollm2, seed):
    """A dozen reports alike but for the thing, its colour and place ("Patrol robot R1 saw a red ladder at dock
    1."), among filler over several caches: where each thing was seen is the report that names it, first among
    an answer's evidence and a recall's moments, whichever report is asked of and wherever it lies."""
    rng = random.Random(seed)
    things = rng.sample(THINGS, len(THINGS))
    at = sorted(rng.sample(range(4, 44), len(things)))
    stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32, archive_block=32))
    reports = iter(things)
    for i in range(48):
        text = (f"Patrol robot R1 saw a {rng.choice(COLOURS)} {next(reports)} at {rng.choice(PLACES)}." if i in at
                else rng.choice(FILLER))
        stream.push_text(text, stamp=float(i), pose=Pose(float(i), 0.0, 0.0))
    assert stream.tokens_seen > 4 * 128
    for k in rng.sample(range(len(things)), 4):
        thing, stamp = things[k], float(at[k])
        answer = stream.ask(f"Where did the patrol robot see the {thing}?", max_new_tokens=1)
        assert (answer.evidence[0].stamp, thing) == (stamp, thing) and thing in answer.evidence[0].text
        assert (stream.recall(f"the {thing}", limit=3)[0].stamp, thing) == (stamp, thing)


def test_a_recall_refuses_unusable_arguments_with_a_reason(planted):
    stream = planted(*PLANTED[0])
    for kwargs, reason in [({"text": ""}, "empty"), ({"text": "cone", "limit": 0}, "limit"),
                           ({"text": "cone", "since": 5.0, "until": 1.0}, "ends"),
                           ({"text": "cone", "near": (0.0, 0.0, 0.0)}, "radius")]:
        with pytest.raises(ValueError, match=reason):
            stream.recall(**kwargs)
    before = stream.stats()
    stream.recall("cone")
    assert stream.stats() == before, "a recall leaves the memory as it was"


@pytest.mark.parametrize("seed, offset", PLANTED)
def test_the_system_turn_is_no_input_no_evidence_and_no_moment_names_it(smollm2, planted, seed, offset, tmp_path):
    stream = planted(seed, offset)
    system = len(smollm2.tokenize_turn(smollm2.chat.system_parts(stream.config.system_prompt)))
    assert stream.inputs_from == system > 0
    assert any(b.first_seq < system for b in stream.archive.blocks), "the system turn is archived"
    # Its own words draw a recall to it, and "when" questions drew answers' attention to it on route bags.
    asked = [stream.ask(q, max_new_tokens=2).evidence for q in ("What are you the memory of?", "When was it?")]
    for moments in asked + [stream.recall(stream.config.system_prompt, limit=5)]:
        assert moments and all(e.first_seq >= system for e in moments)
    save_memory(stream, tmp_path / "m")
    restored = KVStream(smollm2, stream.config)
    load_memory(restored, tmp_path / "m")
    assert restored.inputs_from == system
    clock = stream.clock_state()
    del clock["inputs_from"]  # a memory file of an earlier version
    restored.restore_clock(clock)
    assert restored.inputs_from == system


def entry(stamp: float | None, weight: float) -> Evidence:
    return Evidence(stamp, "text", "archive", None, f"at {stamp}", weight, int(weight))


@pytest.mark.parametrize("question, order", [
    ("Where did you last see the cart?", "latest"), ("What time did you most recently pass the tyres?", "latest"),
    ("When was the most recent time you saw it?", "latest"), ("When did you first pass the ladder?", "earliest"),
    ("Where is the first aid kit?", ""), ("When did you last see the first-aid box?", "latest"),
    ("Where is the red cone?", ""), ("What happened at the dock earliest?", "earliest"),
    ("How long ago did you see the trolley?", "latest"), ("How long has it been since you saw the cart?", "latest"),
    ("How many seconds ago did you first pass the drum?", "earliest"),
    ("How long did you spend at the dock?", ""), ("How many weeks passed between the two visits?", "")])
def test_a_question_asks_for_the_newest_or_the_oldest_moment_or_neither(question, order):
    assert asked_order(question) == order


@pytest.mark.parametrize("seed", range(6))
def test_of_moments_weighing_alike_the_asked_one_comes_first_the_rest_as_they_were(seed):
    rng = random.Random(seed)
    alike = [entry(float(rng.randrange(1000)), 100.0 - rng.random() * 25) for _ in range(rng.randint(2, 4))]
    unlike = [entry(float(rng.randrange(1000)), 10.0 + rng.random() * 30) for _ in range(5 - len(alike))]
    ranked_entries = sorted(alike + unlike, key=lambda e: -e.weight)
    newest, oldest = max(alike, key=lambda e: e.stamp), min(alike, key=lambda e: e.stamp)
    for order, first in (("latest", newest), ("earliest", oldest)):
        got = in_asked_order(ranked_entries, order, 5)
        assert got[0] is first and got[1:] == [e for e in ranked_entries if e is not first]
        assert in_asked_order(ranked_entries, order, 1) == [first], "one asked for comes from the same five"
    assert in_asked_order(ranked_entries, "", 3) == ranked_entries[:3]
    lone = [entry(500.0, 100.0)] + [entry(float(s), 20.0) for s in (100, 900, 300)]
    assert in_asked_order(lone, "latest", 4) == lone, "nothing else weighs as much: the heaviest stays first"


@pytest.mark.parametrize("seed", range(6))
def test_sightings_told_alike_in_meaning_are_ordered_whatever_their_weight(seed):
    rng = random.Random(seed)
    ranked_entries = [entry(float(rng.randrange(1000)), 100.0 - 15 * i + rng.random()) for i in range(5)]
    same = [True] + [rng.random() < 0.5 for _ in range(4)]
    same[rng.randrange(3, 5)] = True  # a light sighting in other words is one of them
    sightings = [e for e, alike in zip(ranked_entries, same) if alike]
    for order, first in (("latest", max(sightings, key=lambda e: e.stamp)),
                         ("earliest", min(sightings, key=lambda e: e.stamp))):
        got = in_asked_order(ranked_entries, order, 5, same)
        assert got[0] is first and got[1:] == [e for e in ranked_entries if e is not first]
    alone = [True, False, False, False, False]
    assert in_asked_order(ranked_entries, "latest", 5, alone) == ranked_entries, "no other sighting: as ranked"


@pytest.mark.parametrize("question, left", [
    ("When did you first pass the cones?", "When did you pass the cones?"),
    ("Where did you last see the first aid kit?", "Where did you see the first aid kit?"),
    ("What time did you most recently pass the trolley?", "What time did you pass the trolley?"),
    ("Where is the latest report?", "Where is the report?"), ("What is on the shelf?", "What is on the shelf?")])
def test_the_words_that_ask_which_moment_are_not_matched_as_what_is_asked(question, left):
    assert without_order(question) == left


THRICE = "I see the red cone by the charging dock."


@pytest.mark.parametrize("seed, offsets", [(0, (6, 17, 32)), (1, (12, 23, 38)), (2, (3, 14, 27))])
def test_a_thing_seen_three_times_last_and_first_give_the_newest_and_the_oldest_sighting(smollm2, seed, offsets):
    rng = random.Random(seed)
    stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32, archive_block=32))
    for i in range(42):
        stream.push_text(THRICE if i in offsets else rng.choice(FILLER), stamp=float(i), pose=Pose(float(i), 0.0, 0.0))
    stamps = {float(o) for o in offsets}
    last = stream.ask("Where did you last see the red cone?", max_new_tokens=2).evidence
    assert last[0].stamp == float(offsets[-1]) and last[0].pose == Pose(float(offsets[-1]), 0.0, 0.0)
    assert stream.recall("When did you first see the red cone?", limit=1)[0].stamp == float(offsets[0])
    plain = stream.recall("red cone", limit=3)
    assert {e.stamp for e in plain} == stamps, "the three sightings are the moments asked about"
    assert [e.weight for e in plain] == sorted((e.weight for e in plain), reverse=True), "no order asked: by weight"


def test_evidence_off_costs_nothing_and_gives_none(smollm2):
    stream = planted_stream(smollm2, 3, 8, messages=20)
    stream.reconfigure(evidence=0, retrieve_tokens=0)
    calls = []
    content_query_steps = stream.content_query_steps  # every way to a question's queries goes through it
    stream.content_query_steps = lambda *a: calls.append(1) or content_query_steps(*a)
    assert stream.ask("Where is the red cone?", max_new_tokens=4).evidence == [] and not calls


def test_a_long_message_cut_into_pieces_is_quoted_whole(smollm2):
    stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32, archive_block=16))
    long = "The red cone stands next to the charging dock, beside the blue pallet, under the stairs, near aisle four."
    for i in range(12):
        stream.push_text(long if i == 4 else FILLER[i % len(FILLER)], stamp=float(i))
    assert len([b for b in stream.archive.blocks if b.stamp == 4.0]) > 1, "cut into pieces"
    top = stream.recall("red cone")[0]
    assert long in top.text and top.stamp == 4.0


@pytest.mark.parametrize("seed, before_at, change_at", [(0, 3, 20), (1, 9, 31), (2, 15, 27)])
def test_a_question_that_asks_when_has_the_state_before_left_out_of_what_is_placed(smollm2, seed, before_at,
                                                                                  change_at):
    """The door light told green, later red, both long out of the cache: asked when it turned red, only the change
    is placed (the small model copied the time beside the first message that names the light); asked whether it
    did, the state before is placed too."""
    rng = random.Random(seed)
    stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32, archive_block=32))
    said = {before_at: "Door D1 light is green.", change_at: "Door D1 light turned red."}
    for i in range(45):
        stream.push_text(said.get(i) or rng.choice(FILLER), stamp=float(i))
    placed = {}
    for question in ("At what time did the light of door D1 turn red?", "Did the light of door D1 turn red?"):
        ids, content = stream.question_ids(stream.question_parts(question))
        fill, frontiers = stream.cache.fill, stream.cache.frontiers()
        blocks = stream.retriever.retrieve(ids, content, stream.config.retrieve_tokens, 0).placed
        stream.cache.truncate(fill, frontiers)  # as the stream takes a question's placed blocks away again
        placed[question] = {stream.retriever.quote(b).split(" [")[0] for b in blocks}
    when, whether = placed.values()
    assert "Door D1 light turned red." in when and "Door D1 light is green." not in when, when
    assert {"Door D1 light turned red.", "Door D1 light is green."} <= whether, whether


def test_a_sighting_asked_in_other_words_is_found_by_what_the_question_means(smollm2):
    """A route's narration (bags/route_scenario.py: each thing said in other words than the questions ask it, "a
    little drone" for "the quadcopter", some seen twice or three times, among filler) into a memory of several caches,
    at three seeds: a sighting of the asked thing is a recall's first moment for far more questions with the sentence
    encoder than with attention and words alone, and for most of them; the asked one of its sightings for most."""
    from inf_mllm_ros.bags.route_scenario import build_route

    found = {"": 0, "all-MiniLM-L6-v2": 0}
    sighting = dict(found)  # the asked one of the thing's sightings ("last", "first")
    asked = 0
    for seed in (0, 1, 2):
        scenario = build_route(seed, 150.0)
        questions = [q for q in scenario.questions if q.kind != "never_seen"]
        asked += len(questions)
        for encoder in found:
            stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32, sentence_encoder=encoder))
            for line in scenario.narration:
                stream.push_text(line.text, line.time_s)
            assert stream.tokens_seen > 4 * 128
            for q in questions:
                top = stream.recall(q.question, limit=1)
                seen = [s.time_s for s in scenario.sightings_of(q.thing)]
                found[encoder] += bool(top) and min(abs(top[0].stamp - t) for t in seen) <= 2.0
                sighting[encoder] += bool(top) and abs(top[0].stamp - q.expected["time_s"]) <= 2.0
    # Measured: 40 of 65 without the encoder, 54 with it; the asked sighting 38 and 52.
    assert found["all-MiniLM-L6-v2"] >= found[""] + 6 and found["all-MiniLM-L6-v2"] >= 0.7 * asked, (found, asked)
    assert sighting["all-MiniLM-L6-v2"] >= 0.7 * asked, (sighting, asked)
