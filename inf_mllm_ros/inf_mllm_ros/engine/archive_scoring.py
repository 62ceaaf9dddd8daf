"""Retrieval's scoring of the archived blocks (engine/archive.py): which blocks a question points to.

The queries of the question's own words (not its chat template), each rotated to sit `block_tokens`
positions after the block start, are compared with every archived key; per layer-head, a block's score is
the largest attention logit any of its tokens gets from any of those queries, standardised over the blocks
(so that no layer-head dominates by its scale), and summed over the **retrieval heads**: the few
layer-heads that this model uses to find a fact again (engine/retrieval_heads.py; most heads are drawn to
whatever is generic, and summed over all of them, facts of the same form told close together look alike).
Half the score the same blocks get from a reference question about nothing in particular is taken off, so
that blocks every question is drawn to give way to those this question points to. One selection serves
every layer, so that the placed blocks are whole turns at one set of positions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .rotary import shift_rotary

if TYPE_CHECKING:
    from .archive import ArchivedBlock, KVArchive

# How much of a reference question's scores is taken off a question's (see `block_scores`).
REFERENCE_WEIGHT = 0.5


def block_scores(archive: KVArchive, question: tuple[Tensor, Tensor], reference: tuple[Tensor, Tensor] | None,
                 blocks: list[ArchivedBlock], heads: Tensor | None = None) -> Tensor:
    """[blocks] how much a question points to each block (higher: more): its per-layer queries ([layers,
    query heads, q, dk]) and the positions they were rotated with ([q]), scored on `heads` ([layers, query
    heads] bool; None: every head of the middle half of the layers). A `reference` question's scores (a
    question about nothing in particular) are taken off at REFERENCE_WEIGHT."""
    score = layer_head_scores(archive, *question, blocks, heads).sum(0)
    if reference is not None:
        score = score - REFERENCE_WEIGHT * layer_head_scores(archive, *reference, blocks, heads).sum(0)
    return score


def middle_layers(layers: int, query_heads: int) -> Tensor:
    """Every head of the middle half of the layers: the scoring heads of a model not calibrated."""
    heads = torch.zeros(layers, query_heads, dtype=torch.bool)
    heads[layers // 4 : layers - layers // 4] = True
    return heads


def layer_head_scores(archive: KVArchive, queries: Tensor, query_positions: Tensor,
                      candidates: list[ArchivedBlock], heads: Tensor | None = None) -> Tensor:
    """[chosen layer-heads, candidates]: each block's largest logit from the queries, per layer-head in
    `heads` (layer-major order), standardised over the candidates."""
    layers, q_heads, q, dim = queries.shape
    if heads is None:
        heads = middle_layers(layers, q_heads)
    scoring = [layer for layer in range(layers) if heads[layer].any()]
    kv_heads = archive.keys.shape[1]
    group = q_heads // kv_heads
    # Every question token as if it sat block_tokens positions after the start of the block it reads.
    flat = queries[scoring].to("cpu", torch.float32).flatten(0, 1)
    delta = (archive.block_tokens - query_positions.to("cpu"))[None].expand(flat.shape[0], -1)
    aligned = (shift_rotary(flat, delta, archive.inv_freq) / math.sqrt(dim)).view(len(scoring), kv_heads,
                                                                                   group * q, dim)
    # Scored over the storage in place (no gather of the archive's keys); slots of no candidate go to a
    # spare column.
    column = torch.full((archive.size + 1,), len(candidates), dtype=torch.long)
    for i, block in enumerate(candidates):
        column[block.slot : block.slot + block.length] = i
    used = max(b.slot + b.length for b in candidates)
    column = column[:used]
    best = []
    for row, layer in enumerate(scoring):
        keys = archive.keys[layer, :, :used].to(torch.float32)  # [kv heads, used, dk]
        logits = torch.matmul(aligned[row], keys.transpose(-1, -2))  # [kv heads, group * q, used]
        logits = logits.view(q_heads, q, used).amax(1)[heads[layer]]  # the best question token, per head
        per_block = torch.full((logits.shape[0], len(candidates) + 1), float("-inf"))
        best.append(per_block.scatter_reduce_(1, column[None].expand(logits.shape[0], -1), logits, reduce="amax"))
    scores = torch.cat(best)[:, :-1]  # [chosen layer-heads, candidates]
    if scores.shape[1] < 2:
        return scores
    return (scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True).clamp_min(1e-6)
