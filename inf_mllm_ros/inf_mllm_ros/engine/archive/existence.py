"""Did you see it? A question that asks whether the robot saw or passed a thing at all, whose thing no text in memory
names or is like, answered as not seen.

Asked "Did you see a forklift?" of a memory that holds no forklift, a small model says "Yes" about as often as not:
the retrieved lines are about other things, and it answers from them. A thing seen is told in words (a narration, an
operator's report) that hold the asked name or come near it in meaning; one never seen is neither. So where the
question has that form, none of its words but the form's is held by any archived text, and no text is as alike to it
in meaning as NOT_SEEN_LIKENESS (the sentence encoder's cosine, of the words that name the thing: `thing_words`), the
answer is NOT_SEEN with nothing decoded. A memory that holds frames is left to the model: what a camera saw has no
words to compare.

Chosen on the route bags' tuning seeds (0-2, 200007, 200015-200020; their every-question set, whose did-you-see
questions are asked of things seen too), the 0.5B default answering in-process (benchmarks/route_recall.py
--did-you-see, results/route_recall_did_you_see.json): of 122 questions about things never seen, the model alone says
not seen to 35, with the check at 0.4 to 101; of 118 about things seen, the model alone says seen to 92, with the
check to 81 (it fires on 11: things the encoder does not bridge, "a dolly" for "a sack truck", "a stepladder" for "an
aluminium ladder"). 0.35 gave 80 and 83; 0.42, 102 and 73; 0.45, 105 and 70 (docs/archive.md).

A word of the thing's that stands only in a name beside a word no text holds ("work" of "a work platform", where the
robot said "Working the route") does not count as held (engine/archive/lexical.py `false_friends`; on seeds
200057-200066, 118 of 134 things never seen said not seen against 113, 75 of 106 seen not denied against 76).

The encoder compares the thing's words alone ("medical kit"), not the whole question: the form's words ("anywhere on
your route", "on this drive") are like the robot's own narration ("Running the patrol route.") whatever the thing,
and lifted the likeness of things never seen. On the every-question sets of 35 tuning route bags (0-2 and
200001-200032, the encoder alone, no answer decoded), at 0.4 the thing's words took the check to 359 of 455
did-you-sees of things never seen (337 with the whole question) and left 325 of 385 of things seen to the model (323).
"""

from __future__ import annotations

import re

from .lexical import false_friends, terms
from .naming import WORD

# The question's form: asked of the robot whether it saw, passed or came across something, or whether there was one.
ASKS_IF_SEEN = re.compile(
    r"^\s*(?:(?:did|have|had)\s+(?:you|we)\s+(?:ever\s+|already\s+)?"
    r"(?:see|seen|spot|spotted|notice|noticed|pass|passed|come\s+across|came\s+across|encounter|encountered|"
    r"find|found|run\s+into|ran\s+into)\b"
    r"|(?:was|were|is|are)\s+there\b)",
    re.IGNORECASE)
# The form's own words, and those that say on which outing ("anywhere on your route", "on this drive"): a question
# whose other words no text holds names its thing in none of them. ("Keeping to the route" names no thing.)
FORM_WORDS = frozenset(terms("see seen spot spotted notice noticed pass passed come came across encounter encountered "
                             "find found run ran into ever already anywhere there today tonight route drive trip "
                             "patrol tour round lap shift mission way"))
# Below this cosine (the sentence encoder's) between the question and every archived text, nothing in memory is like
# what it asks about.
NOT_SEEN_LIKENESS = 0.4
NOT_SEEN = "No: nothing in memory names it or is like it."
# A question with one of these names no thing ("Did you see anything unusual?"): it is left to the model.
UNNAMED = re.compile(r"\b(?:any|some|every|no)(?:thing|one|body)\b", re.IGNORECASE)


def asks_if_seen(question: str) -> bool:
    """Whether the question asks if the robot saw (passed, came across) something, or whether there was one."""
    return bool(ASKS_IF_SEEN.match(question))


def thing_terms(question: str) -> set[str]:
    """The question's search terms but its form's: what it asks about ("forklift" of "Did you see a forklift on
    this drive?"); none where it names no thing ("anything", "someone")."""
    return set() if UNNAMED.search(question) else set(terms(question)) - FORM_WORDS


def thing_held(question: str, held: set[str]) -> bool:
    """Whether a word of the question's thing is held by some text (`held`: the terms of every text), but for a
    name's held half beside a word none holds ("work" of "a work platform" after "Working the route":
    lexical.false_friends)."""
    return bool((thing_terms(question) - false_friends(question, held)) & held)


def thing_words(question: str) -> str:
    """The question's words that name what it asks about, in its order ("medical kit" of "Did you see a medical kit
    on this drive?"); "" where it names no thing."""
    thing = thing_terms(question)
    return " ".join(w for w in WORD.findall(question.lower()) if set(terms(w)) & thing)


__all__ = ["ASKS_IF_SEEN", "FORM_WORDS", "NOT_SEEN", "NOT_SEEN_LIKENESS", "UNNAMED", "asks_if_seen", "thing_held",
           "thing_terms",
           "thing_words"]
