"""What a question names (engine/archive/naming.py): on the recall generator's facts of every kind (tuning seeds), the
asked fact's message and the same fact told again name the question most, its siblings of the same form less, by
more than the retriever's tolerance; frames name nothing. Of the messages that name a question, a fact told again
with a new value since is left out, never the subject's mentions nor the fact without a newer value; a subject
named again is left out where its fact holds news, never a fact or a value."""

from __future__ import annotations

import random

import pytest

from types import SimpleNamespace

from inf_mllm_ros.engine.archive.naming import naming_shares, said_words, text_words
from inf_mllm_ros.engine.archive.retriever import NAMES_QUESTION, NAMING_STEP, NAMING_TOLERANCE, NEWS_MESSAGES, Retriever
from inf_mllm_ros.testing.recall_facts import KINDS, facts, filler, told_again


def words(text: str) -> frozenset[str]:
    return text_words(text)


@pytest.mark.parametrize("seed", range(6))
def test_the_asked_fact_and_its_retelling_name_the_question_most(seed):
    told = facts(seed, 12, kinds=KINDS[seed % len(KINDS):] + KINDS[: seed % len(KINDS)])
    again = [told_again(f, seed) for f in told]
    for style in range(len(told[0].mentions)):
        # As in a memory: prose, each subject named again; the best-scored messages taken to be the facts and the
        # mentions of the asked kind, siblings included.
        other = filler("docs", seed)[:200] + [f.mentions[style] for f in told]
        for asked, retold in zip(told, again):
            blocks = [f.message for f in told] + [retold.message] + other + [""]  # the last: a frame
            best = [i for i, b in enumerate(blocks) if any(b == f.message or b == f.mentions[style]
                                                            for f in told if f.kind == asked.kind)]
            shares = naming_shares(words(asked.question), [words(b) for b in blocks], best)
            mine, newer, top = shares[told.index(asked)], shares[len(told)], max(shares)
            # The asked fact is among those placed nearest the question, and its retelling ties with it (the
            # newer goes nearer); every sibling names the question less, by a step, so goes further.
            assert top >= NAMES_QUESTION and mine >= top - NAMING_TOLERANCE, (asked.message, mine, top)
            assert abs(mine - newer) < 1e-9
            siblings = [s for f, s in zip(told, shares) if f is not asked]
            assert all(s < mine - NAMING_STEP for s in siblings), (asked.question, mine, siblings)
            assert shares[-1] == 0.0


def test_words_most_messages_hold_count_little_and_only_the_best_messages_words_count():
    blocks = [words("The code of the mail room is 4821."), words("The code of the wash bay is 1234."),
              words("The weather is fine."), words("Nobody was in the mail room today.")]
    question = words("What is the code of the mail room?")
    assert question == {"code", "mail", "room"}  # the question's own form and function words name nothing
    shares = naming_shares(question, blocks, best=[0, 1])
    assert shares[0] == pytest.approx(1.0) and shares[1] < 0.5 and shares[2] == 0.0
    # Only the words the best messages hold count: with the wash bay's alone, "code".
    assert naming_shares(question, blocks, best=[1]) == [1.0, 1.0, 0.0, 0.0]
    assert naming_shares(words("mail"), [frozenset(), frozenset()], best=[0]) == [0.0, 0.0]
    assert naming_shares(frozenset(), blocks, best=[0]) == [0.0] * 4
    assert words("What is on Pallet 44, checked?") == {"pallet", "44", "checked"}


@pytest.mark.parametrize("seed", range(6))
def test_only_a_value_told_again_since_leaves_the_older_out(seed):
    told = facts(seed, 12, kinds=KINDS[seed % len(KINDS):] + KINDS[: seed % len(KINDS)])
    again = [told_again(f, seed) for f in told]
    for style in range(len(told[0].mentions)):
        mentions = [f.mentions[style] for f in told]
        other = filler("chat", seed)[:100]
        for asked, retold in zip(told, again):
            # In stream order: the facts, prose and mentions, the asked fact told again, a mention after it.
            texts = [f.message for f in told] + other + mentions + [retold.message, asked.mentions[style]]
            best = [i for i, t in enumerate(texts) if any(t in (f.message, f.mentions[style]) for f in told)]
            shares = naming_shares(words(asked.question), [words(t) for t in texts], best)
            names = dict(enumerate(shares))
            blocks = [SimpleNamespace(message=i, first_seq=10 * i) for i in range(len(texts))]
            said = {i: said_words(t) for i, t in enumerate(texts)}
            top = max(shares)
            naming = [b for b in blocks if top >= NAMES_QUESTION and names[b.message] >= top - NAMING_TOLERANCE]
            question = words(asked.question)
            # The asked subject's messages: its fact, its mention in the list, its new value, its last mention.
            mine = {told.index(asked), len(told) + len(other) + told.index(asked), len(texts) - 2, len(texts) - 1}
            outdated = Retriever.restated_since(naming, names, said, question)
            assert outdated & mine == {told.index(asked)}, (asked.message, style, outdated)
            # Without the new value, nothing of the subject's is left out: the mentions name it in other words.
            # (Messages of other subjects that differ in their subject and value alone may leave one another out:
            # the question asks for neither.)
            kept = Retriever.restated_since([b for b in naming if texts[b.message] != retold.message], names, said,
                                            question)
            assert not kept & mine, (asked.message, style, kept)


@pytest.mark.parametrize("seed", range(6))
def test_of_the_messages_that_name_a_question_those_that_only_name_its_subject_again_are_not_placed(seed):
    """Subjects named again (every mention style, a style a stream) tell nothing beyond the question that other
    mentions do not tell too: left out where the asked fact, or the fact and its new value, name the question as
    well; never a fact or a value, however often the subjects come up, and nothing where no message holds news."""
    told = facts(seed, 12, kinds=KINDS[seed % len(KINDS):] + KINDS[: seed % len(KINDS)])
    again = [told_again(f, seed) for f in told]
    for style in range(len(told[0].mentions)):
        for asked, retold in list(zip(told, again))[style::3]:  # four subjects a style, of four kinds
            for mentions, with_facts, with_new in [(2, True, False), (3, True, False), (6, True, True),
                                                   (5, False, False)]:
                texts = (filler("operations", seed)[:60] + ([f.message for f in told] if with_facts else [])
                         + [f.mentions[style] for f in told] * mentions + ([retold.message] if with_new else []))
                question = words(asked.question)
                best = [i for i, t in enumerate(texts) if asked.subject in t or t == asked.message]
                shares = naming_shares(question, [words(t) for t in texts], best)
                top = max(shares)
                naming = [SimpleNamespace(message=i) for i, s in enumerate(shares)
                          if top >= NAMES_QUESTION and s >= top - NAMING_TOLERANCE]
                said = {i: said_words(t) for i, t in enumerate(texts)}
                silent = {texts[m] for m in Retriever.telling_nothing(naming, said, question)}
                case = (asked.message, style, mentions, with_facts, with_new, silent)
                assert not silent & ({f.message for f in told} | {retold.message}), case
                if not with_facts:
                    assert not silent, case
                elif mentions > NEWS_MESSAGES:
                    assert asked.mentions[style] in silent, case


# A state told, then changed: (the message before, the message of the change, a question that asks when it changed).
CHANGES = [
    ("Shift started. Forklift F2 is at the charging station. Door D1 light is green.", "Door D1 light turned red.",
     "At what time did the light of door D1 turn red?"),
    ("Gate 4 is closed for the night.", "Gate 4 is open for the morning trucks.", "When was gate 4 open?"),
    ("Pallet 93 is on shelf B2.", "Pallet 93 was moved to the loading dock.", "When was pallet 93 moved to the dock?"),
    ("The spill in aisle 7 is reported.", "The spill in aisle 7 was cleaned up.", "When was the spill in aisle 7 cleaned?"),
]


@pytest.mark.parametrize("seed", range(4))
def test_asked_when_a_message_that_names_only_part_of_what_another_names_of_it_is_not_placed(seed):
    """Asked when a state changed, the message of the state before names the subject only, the change's message
    names the subject and the change (in the question's words: "opened" is not "open"): the one before is left out,
    wherever the two stand among other messages; sightings of one thing that name the question alike are all kept,
    and so is a lone message."""
    rng = random.Random(seed)
    for before, change, question in CHANGES:
        texts = filler("operations", seed)[:30] + [before, change]
        rng.shuffle(texts)
        said = {i: said_words(t) for i, t in enumerate(texts)}
        blocks = [SimpleNamespace(message=texts.index(t)) for t in (before, change)]
        left_out = {texts[m] for m in Retriever.naming_less(blocks, said, words(question))}
        assert left_out == {before}, (question, left_out)
        assert not Retriever.naming_less(blocks[1:], said, words(question))
    sightings = [f"I see the orange cart next to a stack of tyres. [08:0{i}:1{i}]" for i in range(3)]
    said = {i: said_words(t) for i, t in enumerate(sightings)}
    assert not Retriever.naming_less([SimpleNamespace(message=i) for i in said], said,
                                     words("When did you last see the orange cart?"))
