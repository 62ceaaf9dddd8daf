"""How much of what a question names each text block names too: the share of the question's words found in the
block, each word weighted by how rare it is among the blocks at hand (a word every block holds, such as "the" or
a form's own words, counts for little; the subject's words, held by few, for much).

Attention scores tell blocks of one form apart less well than they find the form: a question about one of
several facts of the same form ("the door code of the paint shop", "... of the mail room") can score a sibling's
block as high as the asked one. The words settle it, and they also find the same fact told again, which names
the subject exactly as the old one does (engine/retriever.py places these nearest the question, the newest last).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def naming_shares(question: Sequence[Hashable], blocks: Sequence[Sequence[Hashable]]) -> list[float]:
    """For each block (its words), the rarity-weighted share of the question's distinct words it holds, in [0, 1].
    A block without words (a frame's) holds none; with no such block at hand every share is 0."""
    words = set(question)
    held = [set(b) for b in blocks]
    texts = sum(1 for b in held if b)
    if not words or not texts:
        return [0.0] * len(held)
    # Inverse document frequency among the text blocks at hand, smoothed so that a word in every block still counts
    # a little, and squared so that the rarest words (the subject's) outweigh those a form's siblings share with
    # the question ("the tag on pallet ..."); a word in no block (the question's own phrasing) counts for nothing.
    weight = {}
    for word in words:
        found = sum(1 for b in held if word in b)
        if found:
            weight[word] = math.log((texts + 1) / (found + 0.5)) ** 2
    total = sum(weight.values())
    if total <= 0:
        return [0.0] * len(held)
    return [sum(w for word, w in weight.items() if word in b) / total for b in held]
