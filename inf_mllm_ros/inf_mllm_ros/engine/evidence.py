"""What an answer rests on: the inputs a question points to, with the moment and the place they came from.

A question's queries score the archive's blocks (engine/retrieval_index.py), those the cache still holds and
those it lost alike. The best of them are an answer's evidence, heaviest first: each with its input's stamp, its
kind (a frame or a text), where it was found (the cache, or the archive alone), the robot's pose at its stamp
(engine/poses.py) and, for a text, its words. `~/recall` gives the same for a text without an answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .poses import Pose

# The most characters of a text quoted in an evidence entry.
QUOTE_CHARS = 200


@dataclass
class Evidence:
    """One input an answer rests on, or a moment a recall found."""

    stamp: float | None  # the input's stream time, where it had one
    kind: str  # "frame" or "text"
    source: str  # "cache": still held in the bounded cache; "archive": only in the archive
    pose: Pose | None  # where the robot was at the stamp, where known
    text: str  # the text's words (cut to QUOTE_CHARS); empty for a frame
    weight: float  # how much the question points to it (its retrieval score; higher: more)
    first_seq: int  # the stream index of its first token


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
                            block.first_seq))
        if len(out) == limit:
            break
    return out
