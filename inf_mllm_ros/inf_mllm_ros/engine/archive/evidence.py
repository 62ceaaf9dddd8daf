"""What an answer rests on (its `Evidence`, engine/answering.py): the inputs a question points to, with the
moment and the place they came from.

A question's queries score the archive's blocks (engine/archive/retrieval_index.py), those the cache still holds and
those it lost alike. The best of them are an answer's evidence, heaviest first: each with its input's stamp, its
kind (a frame or a text), where it was found (the cache, or the archive alone), the robot's pose at its stamp
(engine/poses.py) and, for a text, its words. `~/recall` gives the same for a text without an answer.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..answering import QUOTE_CHARS, Evidence

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
