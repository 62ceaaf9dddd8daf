"""The words a question shares with archived messages (engine/archive/lexical.py), weighed as BM25 weighs them, and the
reply to a message that asks lifted beside it (engine/archive/retriever.py)."""

from __future__ import annotations

import random

import pytest

from inf_mllm_ros.engine.archive.lexical import asks, bm25, false_friends, stem, terms
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import build_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("words, same", [
    (("painted", "painting", "paints", "paint"), True),
    (("running", "run", "runs"), True),
    (("studies", "studied", "study"), True),
    (("adoption", "adopted"), False),  # a light stem: no more than one ending
])
def test_a_light_stem_joins_a_words_common_forms(words, same):
    assert (len({stem(w) for w in words}) == 1) is same


def test_terms_leave_out_function_words_and_time_markers_and_count_the_rest():
    assert terms("The dog and the dogs ran at 08:00 [8 May 2023 13:56:00]") == {"dog": 2, "ran": 1, "08": 1, "00": 1}


def test_a_rare_word_outweighs_a_common_one_and_a_short_message_a_long_one():
    rng = random.Random(0)
    filler = [terms(" ".join(rng.choice(["crate", "pallet", "aisle", "shelf"]) for _ in range(8))) for _ in range(20)]
    rare = terms("the ladder by the crate")
    common = terms("a crate crate pallet")
    long_rare = terms("the ladder " + " ".join(["shelf"] * 30))
    scores = bm25(terms("Where is the ladder near the crate?"), filler + [rare, common, long_rare])
    assert scores[-3] > scores[-1] > max(scores[:-3] + [scores[-2]])
    assert bm25(terms("what?"), filler) == [0.0] * len(filler)  # no searchable word: no score


HELD = set(terms("Spotted a hand truck. Coming past a pallet jack. A sack truck here. Passing a push cart. "
                 "A wet floor sign, a yellow caution sign. A cable reel."))


@pytest.mark.parametrize("question, friends", [
    ("Where was the pump truck when you first came across it?", {"truck"}),  # a pump truck is no hand truck
    ("When was the last time you saw the sack barrow?", {"sack"}),
    ("Where did you last see the push bike?", {"push"}),
    ("Did you see a fork-truck anywhere on your route?", {"truck"}),
    ("How long ago did you see the Caution Board?", {"caution"}),
    ("Have you come across a pallet truck on this drive?", set()),  # every word of the name is held
    ("Where did you last see the hand truck?", set()),
    ("Did you see a dolly?", set()),  # no word of the name is held: nothing to set aside
    ("What did Melanie paint recently?", set()),  # no article: no name
    ("Where is the cable reel near the pump?", set()),  # "pump" stands in a name of its own, not "reel"'s
])
def test_a_names_held_half_beside_a_word_no_message_holds_is_a_false_friend(question, friends):
    assert false_friends(question, HELD) == friends


def test_a_message_asks_where_it_holds_a_question_mark():
    assert asks("Melanie: How long have you been married? [20:02:00]")
    assert not asks("Melanie: Five years already! [20:02:30]")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return load_model(build_model_folder("llama", tmp_path_factory.mktemp("tiny") / "llama"), device="cpu",
                      dtype="float32")


WORDS = "pallet forklift aisle dock shelf crate door light scanner badge ramp conveyor".split()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_reply_to_a_message_that_asks_scores_beside_it(adapter, seed):
    """Whatever the model's attention makes of them, the message after one that asks what the question asks
    comes with it among the evidence, at whatever place in the stream the two were told."""
    rng = random.Random(seed)
    stream = KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=4096, archive_block=16))
    at = rng.randrange(2, 10)
    for i in range(14):
        if i == at:
            stream.push_text("Operator: where did the orange trolley go?", stamp=float(i))
            stream.push_text(f"Robot: beside {rng.choice(WORDS)} {rng.randrange(10, 99)}.", stamp=i + 0.5)
        stream.push_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9))) + ".", stamp=float(i) + 0.7)
    moments = stream.recall("Where did the orange trolley go?", limit=3)
    stamps = [m.stamp for m in moments]
    assert float(at) in stamps[:2], "the message that asks, by its words"
    assert at + 0.5 in stamps[:3], "its reply beside it"
