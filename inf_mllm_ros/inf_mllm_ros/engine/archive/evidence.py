"""What an answer rests on (its `Evidence`, engine/answering.py): the inputs a question points to, with the
moment and the place they came from.

A question's queries score the archive's blocks (engine/archive/retrieval_index.py), those the cache still holds and
those it lost alike. The best of them are an answer's evidence, heaviest first: each with its input's stamp, its
kind (a frame or a text), where it was found (the cache, or the archive alone), the robot's pose at its stamp
(engine/poses.py) and, for a text, its words. `~/recall` gives the same for a text without an answer.

A question that asks for the newest or the oldest of the moments ("Where did you last see the cart?", "When did you
first pass the tyres?") has, of the entries that score about as well as the heaviest (the same thing seen again),
the newest or the oldest put first: the attention a question pays tells what it is about, not which sighting of it
(`in_asked_order`).
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import Tensor

from ..answering import QUOTE_CHARS, Evidence, asks_how_long

# Words that ask for the newest or the oldest moment of several (English). "first" as in "first aid" asks nothing.
ASKS_LATEST = re.compile(r"\b(?:last|latest|newest|most recent(?:ly)?)\b", re.IGNORECASE)
ASKS_EARLIEST = re.compile(r"\b(?:first(?![- ]aid)|earliest|oldest)\b", re.IGNORECASE)
# Entries whose weight is at least this share of the heaviest's, above the lightest entry's, are taken as moments of
# the same thing when a question asks for the newest or the oldest (chosen on the tuning route bags, seeds 0 and 1),
# where the sentence encoder cannot tell (engine/archive/retriever.py: messages alike in meaning to the heaviest's).
SAME_THING_SHARE = 0.7
# The entries that share is taken over, however few are asked for: one asked for still comes from the same five.
ORDER_AMONG = 5


def asked_order(question: str) -> str:
    """"latest", "earliest", or "" where the question asks for neither (the latest wins where it says both). A
    question that asks how long ago ("How long ago did you see the cart?") asks for the latest unless it says
    otherwise: the time since a thing was seen is counted from its last sighting."""
    if ASKS_LATEST.search(question):
        return "latest"
    if ASKS_EARLIEST.search(question):
        return "earliest"
    return "latest" if asks_how_long(question) else ""


def without_order(question: str) -> str:
    """The question without the words that ask for the newest or the oldest moment: those ask which sighting, not
    what, so they match no message ("first" would draw "Spotted a first aid kit" to "When did you first pass the
    cones?")."""
    return " ".join(ASKS_EARLIEST.sub(" ", ASKS_LATEST.sub(" ", question)).split())


def in_asked_order(evidence: list[Evidence], order: str, limit: int,
                   same_thing: list[bool] | None = None) -> list[Evidence]:
    """The first `limit` of the evidence (ranked, at least ORDER_AMONG long where there are as many) with, where the
    question asks for the newest or the oldest moment (`order`), that one of the entries of the same thing as the
    heaviest first; the others as they were. `same_thing`: for each entry, whether it tells of the same thing as the
    heaviest (None: those weighing about as much as the heaviest, SAME_THING_SHARE)."""
    stamped = [e for e in evidence if e.stamp is not None]
    lightest = min((e.weight for e in evidence), default=0.0)
    if not order or len(stamped) < 2 or evidence[0].weight <= lightest:
        return evidence[:limit]
    if same_thing is not None:
        alike = [e for e, same in zip(evidence, same_thing) if same and e.stamp is not None]
    else:
        bar = lightest + SAME_THING_SHARE * (evidence[0].weight - lightest)
        alike = [e for e in stamped if e.weight >= bar]
    if not alike:
        return evidence[:limit]
    pick = (max if order == "latest" else min)(alike, key=lambda e: e.stamp)
    return ([pick] + [e for e in evidence if e is not pick])[:limit]


def ranked(blocks: list, scores: Tensor, held: list[bool], quote: Callable[[object], str],
           limit: int) -> list[Evidence]:
    """The `limit` best-scored blocks as evidence, heaviest first (a long message's pieces count once, by its
    best piece)."""
    out, messages = [], set()
    for i in torch.argsort(scores, descending=True, stable=True).tolist():
        block = blocks[i]
        if block.message in messages:
            continue
        messages.add(block.message)
        out.append(Evidence(block.stamp, "frame" if block.frame else "text", "cache" if held[i] else "archive",
                            block.pose, "" if block.frame else quote(block)[:QUOTE_CHARS], float(scores[i]),
                            block.first_seq, block.camera))
        if len(out) == limit:
            break
    return out
