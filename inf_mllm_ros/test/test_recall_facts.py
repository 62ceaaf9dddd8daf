"""The recall sets' generator (testing/recall_facts.py): every kind of value, told so it can be asked back, its
subject named again without its value, the same facts from the same seed, and filler of every genre."""

from __future__ import annotations

import pytest

from inf_mllm_ros.testing.recall_facts import GENRES, KINDS, MENTIONS, REPORT_SEED_BASE, facts, filler, told_again


@pytest.mark.parametrize("seed", [REPORT_SEED_BASE, REPORT_SEED_BASE + 7, REPORT_SEED_BASE + 123])
def test_facts_of_every_kind_can_be_told_and_asked_back(seed):
    told = facts(seed, 2 * len(KINDS))
    assert facts(seed, 2 * len(KINDS)) == told  # one seed, one set
    assert facts(seed + 1, 2 * len(KINDS)) != told
    assert [f.kind for f in told] == list(KINDS) * 2
    assert len({f.subject for f in told}) == len(told)  # siblings of one form, each its own subject
    for fact in told:
        assert fact.value.lower() in fact.message.lower(), fact
        assert not fact.recalled(fact.question), fact  # the question does not give the value away
        assert len(fact.mentions) == len(MENTIONS)
        assert all(not fact.recalled(m) for m in fact.mentions), fact  # a mention names the subject only
        assert fact.recalled(f"It is {fact.value.upper()}.")  # case aside


@pytest.mark.parametrize("genre", GENRES)
def test_every_genre_fills_a_long_stream(genre):
    paragraphs = filler(genre, REPORT_SEED_BASE)
    assert len(paragraphs) >= 400 and all(len(p) >= 100 for p in paragraphs[:400])
    assert filler(genre, REPORT_SEED_BASE) == paragraphs and filler(genre, REPORT_SEED_BASE + 1)[0] != paragraphs[0]


def test_a_fact_told_again_keeps_its_subject_and_words_with_a_new_value():
    for fact in facts(REPORT_SEED_BASE + 3, len(KINDS)):
        again = told_again(fact, 1)
        assert (again.kind, again.subject, again.question) == (fact.kind, fact.subject, fact.question)
        assert again.value != fact.value and again.recalled(again.message) and not fact.recalled(again.message)
