"""Did you see it? (engine/archive/existence.py, `check_seen`): the questions that ask whether a thing was seen, and
on real SmolLM2 weights over a route's narration (bags/route_scenario.py, things said in other words than the
questions ask them) at three seeds, those about things never seen answered as not seen and those about things seen
left to the model."""

from __future__ import annotations

import dataclasses

import pytest

from inf_mllm_ros.bags.route_scenario import SEEN_CHECK, build_route
from inf_mllm_ros.engine.archive.existence import NOT_SEEN, asks_if_seen, thing_held, thing_terms, thing_words
from inf_mllm_ros.engine.archive.lexical import terms
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig

from conftest import load_prepared

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("question, thing", [
    ("Did you see a forklift?", {"forklift"}),
    ("Have you come across any pylons on this drive?", {"pylon"}),
    ("Was there a trolley anywhere on your route?", {"trolley"}),
    ("did you ever notice the red ladder", {"red", "ladder"}),
    ("Is there a fire extinguisher?", {"fire", "extinguisher"}),
    ("Have we passed a pallet jack?", {"pallet", "jack"}),
])
def test_a_question_that_asks_whether_a_thing_was_seen_and_the_words_that_name_it(question, thing):
    assert asks_if_seen(question)
    assert thing_terms(question) == thing


@pytest.mark.parametrize("question, words", [
    ("Did you see a forklift?", "forklift"),
    ("Have you come across a medical kit on this drive?", "medical kit"),
    ("Was there any pylons anywhere on your route?", "pylons"),
    ("Did you see the Red Ladder near dock 3?", "red ladder near dock 3"),
    ("Did you see anything?", ""),
])
def test_the_words_that_name_the_thing_are_what_the_encoder_compares(question, words):
    # The form's words ("anywhere on your route") are like any robot's narration: they stay out of the comparison.
    assert thing_words(question) == words


@pytest.mark.parametrize("question", [
    "Where did you see the cart?", "When did you first pass the tyres?", "Did Melanie go camping?",
    "What did you see?", "How long ago did you see the ladder?", "Describe what is there.",
])
def test_other_questions_are_not_taken_for_one(question):
    assert not asks_if_seen(question)


@pytest.mark.parametrize("question", ["Did you see anything?", "Was there anything unusual on your route?",
                                      "Did you see someone at the door?", "Have you passed anybody?"])
def test_a_question_that_names_no_thing_has_no_words_to_check(question):
    assert asks_if_seen(question) and thing_terms(question) == set()


@pytest.fixture(scope="module")
def smollm2():
    return load_prepared("smollm2")


@pytest.fixture(scope="module")
def drives(smollm2):
    """Three seeds' drives, each with its narration in a memory of several caches."""
    out = []
    for seed in (0, 1, 2):
        scenario = build_route(seed, 150.0, questions="every")
        stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32))
        for line in scenario.narration:
            stream.push_text(line.text, line.time_s)
        assert stream.tokens_seen > 4 * 128
        out.append((scenario, stream))
    return out


def test_things_never_seen_are_answered_as_not_seen_and_things_named_in_memory_never(drives):
    answered = {"never_seen": [], SEEN_CHECK: []}
    for scenario, stream in drives:
        held = set().union(*(terms(line.text) for line in scenario.narration))
        for q in scenario.questions:
            if q.kind not in answered:
                continue
            said_not_seen = stream.ask(q.question, max_new_tokens=4).text == NOT_SEEN
            answered[q.kind].append(said_not_seen)
            if thing_held(q.question, held):  # a word of the thing's is said somewhere: never denied
                assert not said_not_seen, q.question
    never, seen = answered["never_seen"], answered[SEEN_CHECK]
    assert len(never) >= 30 and len(seen) >= 20, (len(never), len(seen))
    # Measured: 25 of 33 never-seen things answered as not seen, 7 of 39 things seen.
    assert sum(never) >= 0.6 * len(never), (sum(never), len(never))
    assert sum(seen) <= 0.25 * len(seen), (sum(seen), len(seen))


@pytest.mark.parametrize("question, held", [
    ("Did you see a work platform?", False),  # "work" only beside "platform", which no text holds
    ("Did you see a hand truck?", True),
    ("Have you come across a pallet truck on this drive?", True),  # every word of the name held, if by others
    ("Was there a dolly anywhere on your route?", False),
    ("Did you see a broom?", True),
])
def test_a_thing_is_held_by_its_words_but_a_names_held_half(question, held):
    memory = set(terms("Working the route. Spotted a hand truck. Noticed a hand pallet truck. Passing a broom."))
    assert thing_held(question, memory) is held


@pytest.mark.parametrize("filler", ["Working the route.", "Work resumes in aisle two.", "Back to work."])
def test_a_names_held_half_beside_a_word_none_holds_does_not_hold_the_thing(smollm2, filler):
    # "work" is held by the robot's own words, "platform" by none: the memory holds no work platform, and the
    # check goes on to the encoder, which finds nothing like one.
    stream = KVStream(smollm2, StreamConfig(capacity=128, chunk_size=32))
    lines = [filler, "Spotted a hand truck.", "Passing a broom.", filler, "A blue barrel here."] * 8
    for i, line in enumerate(lines):
        stream.push_text(line, 10.0 * i)
    assert stream.tokens_seen > 2 * 128  # most of it archived
    assert stream.ask("Did you see a work platform?", max_new_tokens=4).text == NOT_SEEN
    assert stream.ask("Did you see a hand truck?", max_new_tokens=4).text != NOT_SEEN  # the whole name held
    assert stream.ask("Did you see a broom?", max_new_tokens=4).text != NOT_SEEN


def test_the_verdict_on_a_thing_is_the_same_whatever_form_the_question_takes(drives):
    # The form's words ("anywhere on your route") are like the narration whatever the thing: compared whole, they
    # turned the verdict on 4 to 7 of each drive's 24 things with the form (measured).
    forms = ("Did you see a {}?", "Was there a {} anywhere on your route?", "Have you come across a {} on this drive?")
    verdicts = []
    for scenario, stream in drives:
        retriever, blocks = stream.retriever, list(stream.archive.blocks)
        texts = retriever.message_texts(blocks)
        for q in scenario.questions:
            words = thing_words(q.question)
            if q.kind in ("never_seen", SEEN_CHECK) and words:
                by_form = {retriever.unseen(form.format(words), blocks, texts) for form in forms}
                assert len(by_form) == 1, (words, scenario.seed)
                verdicts += by_form
    assert len(verdicts) >= 60 and any(verdicts) and not all(verdicts), verdicts


def test_the_check_off_or_a_memory_with_frames_leaves_every_answer_to_the_model(drives):
    scenario, stream = drives[0]
    never = [q.question for q in scenario.questions if q.kind == "never_seen"]
    fired = [q for q in never if stream.ask(q, max_new_tokens=2).text == NOT_SEEN]
    assert fired, "the check answers none of these questions: nothing below is tested"
    shipped = stream.config
    stream.config = dataclasses.replace(shipped, check_seen=False)
    try:
        assert all(stream.ask(q, max_new_tokens=2).text != NOT_SEEN for q in fired)
    finally:
        stream.config = shipped
    # The same memory with one of its blocks a frame: what a camera saw has no words to hold the thing.
    retriever, blocks = stream.retriever, list(stream.archive.blocks)
    texts = retriever.message_texts(blocks)
    assert all(retriever.unseen(q, blocks, texts) for q in fired)
    assert not retriever.unseen("Did you see anything unusual?", blocks, texts)  # no thing named: the model's
    framed = [dataclasses.replace(blocks[0], frame=True)] + blocks[1:]
    assert not any(retriever.unseen(q, framed, texts) for q in fired)
