"""How much of what a question names each message names too: the share of the question's words found in the
message, over the words the best-scored messages share with the question, each weighted by how rare it is in the
memory (a word most messages hold, such as "the" or the words of a subject that keeps coming up, counts for
little; the words only one subject's messages hold, for much).

Attention scores tell messages of one form apart less well than they find the form: a question about one of
several facts of the same form ("the door code of the paint shop", "... of the mail room") can score a sibling's
message as high as the asked one. The words settle it, and they also find the same fact told again, which names
the subject exactly as the old one does (engine/archive/retriever.py places these nearest the question, the newest
last). Only the words that the best-scored messages share with the question count, and no function word: a word of the
question that only some unrelated message holds must not make that message the one that names it most.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence

WORD = re.compile(r"\w+")
# Words that name nothing: a question's own form ("what", "how many") and English's function words. A question
# word that is rare in the memory but names nothing ("what" in the system prompt alone) would otherwise outweigh
# the subject.
FUNCTION_WORDS = frozenset("""
a an the this that these those some any each every all both no not
what which who whom whose where when why how many much
is are was were be been being am do does did done have has had will would shall should can could may might must
i you he she it we they me him her us them my your his its our their mine yours
of in on at to for from by with about into onto over under after before between through during since until up
down out off than then there here and or but if so as also too very just only
""".split())


# A time marker the model reads beside an input, with the day where it says one (engine/models/chat.py: "[0:00:31.0]",
# "[day 2, 0:00:31.0]", "[08:00:31]", "[8 May 2023 08:00:31]").
TIME_MARKER = re.compile(r"\[(?:day \d+, |\d{1,2} [A-Z][a-z]+ \d{4} )?\d+:\d\d:\d\d(?:\.\d+)?\]")


def said_words(text: str) -> frozenset[str]:
    """What a message says, its time markers aside: two messages with the same are the same thing said again."""
    return text_words(TIME_MARKER.sub(" ", text))


def restated(older: frozenset[str], newer: frozenset[str], question: frozenset[str], changed: int) -> bool:
    """Whether a newer message (what it says, `said_words`) tells an older one again with what a question (its
    words) asks changed: at most `changed` words of each that the other lacks, none of them the question's (a
    value, not the subject: "the door code of the server room is 1519" and "... is 2895", not "... of the mail
    room is 2895"), and at least as many words in common as either has of its own (not a mention such as
    "checked on the door code of the server room, nothing changed")."""
    gone, new = older - newer, newer - older
    return (bool(gone or new) and max(len(gone), len(new)) <= min(changed, len(older & newer))
            and not (gone | new) & question)


def text_words(text: str) -> frozenset[str]:
    """A text's words that can name something, whatever their case ("Pallet" and "pallet" alike), without
    function words, spaces and punctuation: words, not tokens, as a tokenizer cuts "Pallet 44" and " pallet 44"
    into different pieces."""
    return frozenset(w for w in WORD.findall(text.lower()) if w not in FUNCTION_WORDS)


def naming_shares(question: Sequence[Hashable], messages: Sequence[Sequence[Hashable]],
                  best: Sequence[int]) -> list[float]:
    """For each message (its words), the rarity-weighted share of the question's words it holds, in [0, 1]; the
    words counted are those of the question that the messages at the indices `best` hold, each weighted by its
    inverse document frequency among all `messages`, squared (so the rarest words, the subject's, outweigh those a
    form's siblings share with the question). A message without words (a frame's) holds none."""
    held = [set(m) for m in messages]
    words = {w for w in question if any(w in held[i] for i in best)}
    texts = sum(1 for m in held if m)
    weight = {w: math.log((texts + 1) / (sum(1 for m in held if w in m) + 0.5)) ** 2 for w in words}
    total = sum(weight.values())
    if total <= 0:
        return [0.0] * len(held)
    return [sum(v for w, v in weight.items() if w in m) / total for m in held]
