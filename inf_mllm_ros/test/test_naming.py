"""What a question names (engine/naming.py): on the recall generator's facts of every kind (tuning seeds), the
asked fact's message and the same fact told again name the question most, its siblings of the same form less, by
more than the retriever's tolerance; frames name nothing."""

from __future__ import annotations

import pytest

from inf_mllm_ros.engine.naming import naming_shares, text_words
from inf_mllm_ros.engine.retriever import NAMES_QUESTION, NAMING_STEP, NAMING_TOLERANCE
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
