"""Who said what (engine/archive/attribution.py): a question asked of one of the memory's speakers whose heaviest
evidence that speaker never stated is answered as not mentioned, with nothing decoded; its evidence is still given,
and the memory is left as it was."""

from __future__ import annotations

import random

import pytest
import torch

from inf_mllm_ros.engine.answering import Evidence, Question
from inf_mllm_ros.engine.archive.attribution import (
    ATTRIBUTION_DEPTH,
    asked_speaker,
    not_mentioned,
    only_asks,
    speaker,
    unattributed,
)
from inf_mllm_ros.engine.archive.retrieval_index import RetrievalIndex
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.runtime.pool import StreamPool
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import build_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["Joanna", "Nate", "Caroline", "Melanie", "R2", "Operator", "Maria", "John", "Tim", "Audrey", "Andrew"]
THINGS = ["a purple hat", "a red boat", "three turtles", "a clarinet", "pallet 93", "a yellow vest", "a blue vase"]


def entry(text: str, kind: str = "text", weight: float = 1.0) -> Evidence:
    return Evidence(None, kind, "archive", None, text, weight, 0)


@pytest.mark.parametrize("text, expected", [
    ("Nate: I dyed my hair purple.", "Nate"),
    ("R2: pallet 93 is at dock 4", "R2"),
    ("Patrol Robot R1: saw a cart", "Patrol Robot R1"),
    ("[08:00:05] Operator: go to dock 3", "Operator"),
    ("The door light turned red.", None),
    ("note: lower case is no name", None),
    ("Nate:no space after the colon", None),
    ("At 10:42 the door opened.", None),
])
def test_a_speaker_is_the_capitalised_name_before_a_colon_at_a_texts_start(text, expected):
    assert speaker(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Melanie: Did you make it? [13:39:00]", True),
    ("Caroline: That bowl is gorgeous! Did you make it? [shares a photo of a bowl] [13:39:00]", True),
    ("Caroline: Did you make it? Yes, I did. [13:39:00]", False),
    ("Nate: I made it. [12 May 2023 10:00:00]", False),
])
def test_a_text_only_asks_where_it_ends_with_a_question_its_bracketed_notes_aside(text, expected):
    assert only_asks(text) is expected


@pytest.mark.parametrize("seed", range(6))
def test_the_asked_speaker_is_the_one_speaker_a_question_names_as_a_word(seed):
    rng = random.Random(seed)
    a, b = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    assert asked_speaker(f"Did {a} see {thing}?", {a, b}) == a
    assert asked_speaker(f"What is {a}'s favourite colour?", {a, b}) == a
    assert asked_speaker(f"Did {a} give {b} {thing}?", {a, b}) is None  # two: either's words may hold it
    assert asked_speaker(f"Who saw {thing}?", {a, b}) is None
    assert asked_speaker(f"Did {a}x see it?", {a, b}) is None  # a longer word is another name


@pytest.mark.parametrize("seed", range(8))
def test_a_question_whose_heaviest_entries_hold_no_statement_of_its_speaker_is_unattributed(seed):
    rng = random.Random(seed)
    a, b = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    question = f"When did {a} get {thing}?"
    other = entry(f"{b}: I got {thing} last week. [10:00:0{seed % 10}]")
    asks = entry(f"{a}: Wow, where did you get {thing}? [10:00:30]")
    told = entry(f"{a}: I got {thing} yesterday.")
    filler = [entry(f"{rng.choice([a, b])}: {rng.choice(THINGS)} again.") for _ in range(rng.randint(3, 6))]
    assert unattributed(question, [other, asks] + filler, {a, b}) == a
    assert unattributed(question, [asks, other] + filler, {a, b}) == a
    # The asked speaker's statement among the heaviest: the question is theirs, first or second.
    assert unattributed(question, [other, told] + filler, {a, b}) == ""
    assert unattributed(question, [told, other] + filler, {a, b}) == ""
    # Only the heaviest ATTRIBUTION_DEPTH count: a statement further down does not.
    assert unattributed(question, [other] * ATTRIBUTION_DEPTH + [told] + filler, {a, b}) == a
    # No judgement without a speaker asked of, without evidence, or with a frame among the heaviest.
    assert unattributed(f"When did someone get {thing}?", [other, asks], {a, b}) == ""
    assert unattributed(question, [], {a, b}) == ""
    assert unattributed(question, [entry("", kind="frame"), other], {a, b}) == ""
    assert unattributed(question, [other, asks], {b}) == ""  # not one of the memory's speakers


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return load_model(build_model_folder("llama", tmp_path_factory.mktemp("tiny") / "llama"), device="cpu",
                      dtype="float32")


CONFIG = dict(capacity=48, chunk_size=16, archive_size=4096, retrieve_tokens=96, archive_block=16)


def dialogue(adapter, seed: int, check_speaker: bool = True, stream: KVStream | None = None
             ) -> tuple[KVStream, str, str, str]:
    """Two speakers' turns, one telling and the other asking, with the thing the teller told among them at a seeded
    place, into `stream` (default: a new one with a cache too small to hold them): the stream, the teller, the other
    and the thing."""
    rng = random.Random(seed)
    teller, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    subjects = rng.sample(["weather", "traffic", "garden", "news", "budget", "schedule", "lunch", "queue"], 6)
    turns = [f"{other}: how was the {w}?" if i % 2 else f"{teller}: nothing new about the {w} today."
             for i, w in enumerate(subjects)]
    turns.insert(rng.randint(0, len(turns)), f"{teller}: I bought {thing} at the market.")
    stream = stream or KVStream(adapter, StreamConfig(**CONFIG, check_speaker=check_speaker))
    for i, text in enumerate(turns):
        stream.push_text(text, stamp=float(10 * i))
    return stream, teller, other, thing


def index_stream(stream: KVStream | StreamPool, index: RetrievalIndex) -> KVStream:
    """The stream (of a pool, the one) whose archive's index is `index`."""
    streams = stream.streams.values() if isinstance(stream, StreamPool) else [stream]
    return next(s for s in streams if s.archive.index is index)


def told_first(stream: KVStream | StreamPool, thing: str):
    """Scores that put the thing's message first (a tiny model's scores mean nothing)."""
    def scores(index, question, scored):
        told = torch.tensor([thing in index_stream(stream, index).retriever.quote(b) for b in scored])
        return torch.where(told, 50.0, 0.0) + torch.rand(len(scored))
    return scores


@pytest.mark.parametrize("seed", range(4))
def test_a_question_asked_of_the_speaker_who_did_not_say_it_is_answered_not_mentioned_with_nothing_decoded(
        adapter, monkeypatch, seed):
    torch.manual_seed(seed)
    stream, teller, other, thing = dialogue(adapter, seed)
    monkeypatch.setattr(RetrievalIndex, "scores", told_first(stream, thing))
    before = {name: t.clone() for name, t in stream.cache.export_state().items()}
    wrong = stream.ask(f"Where did {other} buy {thing}?", max_new_tokens=6)
    assert wrong.text == not_mentioned(other) and wrong.tokens_generated == 0
    assert thing in wrong.evidence[0].text  # the evidence still says who said it
    after = stream.cache.export_state()
    assert all(torch.equal(before[name], after[name]) for name in before)
    right = stream.ask(f"Where did {teller} buy {thing}?", max_new_tokens=6)
    assert right.tokens_generated > 0 and right.text != not_mentioned(teller)
    # An answer opened for a batch's decoding has nothing to decode, and closes as not mentioned.
    opened = stream.open_answer(f"Where did {other} buy {thing}?", max_new_tokens=6)
    assert opened.max_new == 0 and stream.decode_answer(opened) == []
    assert stream.close_answer(opened, []).text == not_mentioned(other)


def test_with_check_speaker_off_the_model_answers_as_before(adapter, monkeypatch):
    torch.manual_seed(0)
    stream, _teller, other, thing = dialogue(adapter, 0, check_speaker=False)
    monkeypatch.setattr(RetrievalIndex, "scores", told_first(stream, thing))
    answer = stream.ask(f"Where did {other} buy {thing}?", max_new_tokens=6)
    assert answer.tokens_generated > 0 and answer.text != not_mentioned(other)


@pytest.mark.parametrize("seed", range(2))
def test_in_a_batch_of_several_memories_the_not_mentioned_answer_leaves_the_others_as_they_would_be_alone(
        adapter, monkeypatch, seed):
    torch.manual_seed(seed)
    pool = StreamPool(adapter, {name: StreamConfig(**CONFIG) for name in ("a", "b", "c")})
    for name in pool:
        _stream, teller, other, thing = dialogue(adapter, seed, stream=pool[name])
    monkeypatch.setattr(RetrievalIndex, "scores", told_first(pool, thing))
    right = f"Where did {teller} buy {thing}?"
    alone = pool["c"].ask(right, max_new_tokens=6)
    answers = pool.ask_together({"a": Question(f"Where did {other} buy {thing}?", max_new_tokens=6),
                                 "b": Question(right, max_new_tokens=6)})
    assert answers["a"].text == not_mentioned(other) and answers["a"].tokens_generated == 0
    assert answers["b"].text == alone.text and answers["b"].tokens_generated == alone.tokens_generated > 0
