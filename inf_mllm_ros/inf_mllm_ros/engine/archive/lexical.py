"""The words a question shares with each archived message, weighed as a search engine weighs them (BM25), and
which messages ask something.

Attention on the retrieval heads finds what a question is about and the form of its answer; it tells apart less
well which of many messages about the same people or things holds the answer. The words settle that: Okapi BM25
(Robertson and Zaragoza, 2009; the Lucene form of its inverse document frequency, k1 = 1.2, b = 0.75) over the
messages of the memory, each word cut to a light stem ("painted", "painting" and "paints" alike), function words
and time markers aside. Measured on LoCoMo's tuning conversations, it found an answer's turn more often than
attention or the earlier word shares alone, and more often still added to attention (docs/archive.md).

A message that asks something ("How long have you been married?") is often what a question about its answer
matches best, in words and attention alike, while the answer is the message after it: engine/archive/retriever.py lets
the message after one that asks score as high as it does.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from .naming import FUNCTION_WORDS, TIME_MARKER, WORD

K1 = 1.2
B = 0.75
# Endings cut from a word, longest first, where at least three letters stay ("ies"/"ied" become "y").
SUFFIXES = ("ingly", "edly", "ing", "ies", "ied", "ed", "es", "s", "ly")


def stem(word: str) -> str:
    """A light stem: one common ending cut and a doubled last consonant undone ("running" -> "run")."""
    for suffix in SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)] + ("y" if suffix in ("ies", "ied") else "")
            break
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiouls":
        word = word[:-1]
    return word


def terms(text: str) -> Counter:
    """A text's searchable words, stemmed, with their counts: no function words, no time markers."""
    return Counter(stem(w) for w in WORD.findall(TIME_MARKER.sub(" ", text).lower()) if w not in FUNCTION_WORDS)


# What a question names after an article ("the pump truck", "a sack barrow"): its words up to the next function word
# or word of place ("the cable reel near the door").
NAME_ENDS = FUNCTION_WORDS - {"a", "an", "the"} | {"near", "next", "beside", "behind", "inside", "outside", "across",
                                                   "along", "around", "against", "beyond", "past", "left", "right"}
NAMED = re.compile(r"\b(?:a|an|the|any|some)\s+((?:\w+[\s-]+)*?\w+)(?=\s+(?:%s)\b|\s*[?.!,;:]|\s*$)"
                   % "|".join(sorted(NAME_ENDS)), re.IGNORECASE)


def false_friends(question: str, held: set[str]) -> set[str]:
    """The question's terms that stand in a name beside a word no message holds: "truck" of "the pump truck" where
    the memory says "pallet jack" and "hand truck". The memory names that thing in other words, and the held word
    alone names another thing (a "hand truck" is no "pump truck"): matched, it outweighs the one the encoder finds
    like in meaning. `held`: the terms of every message."""
    out: set[str] = set()
    for name in NAMED.finditer(question):
        words = {stem(w) for w in WORD.findall(name.group(1).lower()) if w not in FUNCTION_WORDS}
        if words - held:
            out |= words & held
    return out


def asks(text: str) -> bool:
    """Whether a message asks something (a question mark in its words)."""
    return "?" in text


def bm25(question: Counter, messages: Sequence[Counter]) -> list[float]:
    """Each message's BM25 score for the question's terms (`terms`), over `messages` as the collection."""
    count = len(messages)
    if not count or not question:
        return [0.0] * count
    lengths = [sum(m.values()) for m in messages]
    average = sum(lengths) / count or 1.0
    held = Counter(w for m in messages for w in m)
    idf = {w: math.log(1 + (count - held[w] + 0.5) / (held[w] + 0.5)) for w in question if held[w]}
    scores = []
    for message, length in zip(messages, lengths):
        norm = K1 * (1 - B + B * length / average)
        scores.append(sum(weight * message[w] * (K1 + 1) / (message[w] + norm)
                          for w, weight in idf.items() if w in message))
    return scores


__all__ = ["asks", "bm25", "false_friends", "stem", "terms"]
