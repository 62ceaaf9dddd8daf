"""Retrieval's scoring of the archived blocks (engine/archive.py): which blocks a question points to.

The queries of the question's own words (not its chat template), each rotated to sit `block_tokens`
positions after the block start, are compared with every archived key of the middle half of the layers;
per layer and query head, a block's score is the largest attention logit any of its tokens gets from any
of those queries, standardised over the blocks (so that no layer-head dominates by its scale), and summed
over layer-heads. Half the score the same blocks get from a reference question about nothing in
particular is taken off, so that blocks every question is drawn to give way to those this question points
to. One selection serves every layer, so that the placed blocks are whole turns at one set of positions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .rotary import shift_rotary

if TYPE_CHECKING:
    from .archive import ArchivedBlock, KVArchive

# How much of a reference question's scores is taken off a question's (see `rank`).
REFERENCE_WEIGHT = 0.5


def rank(archive: KVArchive, question: tuple[Tensor, Tensor], reference: tuple[Tensor, Tensor] | None,
         candidates: list[ArchivedBlock]) -> list[ArchivedBlock]:
    """`candidates` ordered best first for a question: its per-layer queries ([layers, query heads, q, dk])
    and the positions they were rotated with ([q]). A `reference` question's scores (a question about
    nothing in particular) are taken off at REFERENCE_WEIGHT: blocks that draw any question's attention
    give way to those this question points to."""
    if not candidates:
        return []
    score = block_scores(archive, *question, candidates)
    if reference is not None:
        score = score - REFERENCE_WEIGHT * block_scores(archive, *reference, candidates)
    order = torch.argsort(score, descending=True, stable=True).tolist()
    return [candidates[i] for i in order]


def block_scores(archive: KVArchive, queries: Tensor, query_positions: Tensor,
                 candidates: list[ArchivedBlock]) -> Tensor:
    """[candidates]: each block's largest logit from the queries, per layer-head of the middle half of the
    layers, standardised over the candidates and summed."""
    # The middle half of the layers score: on the tuning set they ranked a fact's block first more often
    # than all layers, the first or the last half (docs/archive.md), at half the cost of all.
    first = queries.shape[0] // 4
    scoring = range(first, queries.shape[0] - first)
    queries = queries[first : queries.shape[0] - first]
    layers, q_heads, q, dim = queries.shape
    heads = archive.keys.shape[1]
    group = q_heads // heads
    # Every question token as if it sat block_tokens positions after the start of the block it reads.
    flat = queries.to("cpu", torch.float32).flatten(0, 1)
    delta = (archive.block_tokens - query_positions.to("cpu"))[None].expand(flat.shape[0], -1)
    aligned = (shift_rotary(flat, delta, archive.inv_freq) / math.sqrt(dim)).view(layers, heads, group * q, dim)
    # Scored over the storage in place (no gather of the archive's keys); slots of no candidate go to a
    # spare column.
    column = torch.full((archive.size + 1,), len(candidates), dtype=torch.long)
    for i, block in enumerate(candidates):
        column[block.slot : block.slot + block.length] = i
    used = max(b.slot + b.length for b in candidates)
    column = column[:used]
    best = torch.full((layers, q_heads, len(candidates) + 1), float("-inf"))
    for row, layer in enumerate(scoring):
        keys = archive.keys[layer, :, :used].to(torch.float32)  # [heads, used, dk]
        logits = torch.matmul(aligned[row], keys.transpose(-1, -2))  # [heads, group * q, used]
        logits = logits.view(q_heads, q, used).amax(1)  # the best question token, per query head
        best[row].scatter_reduce_(1, column[None].expand(q_heads, -1), logits, reduce="amax")
    best = best[..., :-1].flatten(0, 1)  # [layer-heads, candidates]
    if best.shape[1] < 2:
        return best.sum(0)
    return ((best - best.mean(1, keepdim=True)) / best.std(1, keepdim=True).clamp_min(1e-6)).sum(0)
