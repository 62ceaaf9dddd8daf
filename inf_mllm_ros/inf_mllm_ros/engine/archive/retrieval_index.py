"""What a question scores the archive's blocks with: the scoring heads' keys, kept on the model's device.

The archive (engine/archive/archive.py) holds every archived token's keys and values in host memory. Retrieval reads
only the keys of the few layer-heads that score (the model's retrieval heads, engine/archive/retrieval_heads.py), so
the index keeps a copy of those, slot for slot with the archive, where the model runs: a question is scored in
a few matmuls on the device, not over the whole archive on the host.

Scoring. The queries of the question's own words, each rotated to sit `block_tokens` positions after the start
of the block it reads, are compared with the keys; per layer-head a block's score is the largest logit any of its
tokens gets from any of those queries, standardised over the blocks scored (so that no layer-head dominates by
its scale), and summed over the scoring heads. Half of what a reference question about nothing in particular
scores is taken off, so that blocks every question is drawn to give way to those this question points to. The
reference question's queries are asked of the memory once, when the index is made (at the memory's first
retrieval); its logits for each token are computed when the token is written, not at every question.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops.rotary import shift_rotary

# How much of the reference question's scores is taken off a question's.
REFERENCE_WEIGHT = 0.5
# The most one temporary logits tensor of a scoring pass may take; larger ones are cut along the heads.
TEMPORARY_BYTES = 64 << 20


def middle_layers(layers: int, query_heads: int) -> Tensor:
    """Every head of the middle half of the layers: the scoring heads of a model whose retrieval heads are not
    known."""
    heads = torch.zeros(layers, query_heads, dtype=torch.bool)
    heads[layers // 4 : layers - layers // 4] = True
    return heads


class RetrievalIndex:
    """The scoring heads' keys of every archived slot on `device`, and the reference question's best logit per
    scoring head and slot.

    heads: [layers, query heads] bool, the heads that score; kv_heads, head_dim: the model's; size: the
    archive's slots; block_tokens: where a question's queries are set to read a block from; inv_freq: RoPE's.
    """

    def __init__(self, heads: Tensor, *, kv_heads: int, head_dim: int, size: int, block_tokens: int,
                 inv_freq: Tensor, device: torch.device | str):
        layers, query_heads = heads.shape
        if query_heads % kv_heads:
            raise ValueError(f"{query_heads} query heads do not group over {kv_heads} KV heads")
        self.group = query_heads // kv_heads
        self.block_tokens = block_tokens
        self.device = torch.device(device)
        self.inv_freq = inv_freq.to(self.device, torch.float32)
        grouped = heads.to(torch.bool).view(layers, kv_heads, self.group)
        # The (layer, KV head) pairs with a scoring query head, and which of their query heads score.
        pairs = grouped.any(-1).nonzero()
        self.pair_layer, self.pair_head = pairs[:, 0].to(self.device), pairs[:, 1].to(self.device)
        self.scoring = grouped[pairs[:, 0], pairs[:, 1]].to(self.device)  # [pairs, group]
        self.heads = int(self.scoring.sum())
        self.keys = torch.empty(len(pairs), size, head_dim, dtype=torch.float32, device=self.device)
        self.reference_best = torch.zeros(self.heads, size, dtype=torch.float32, device=self.device)
        self._reference: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * 4 + self.reference_best.numel() * 4

    def set_reference(self, queries: Tensor, positions: Tensor) -> None:
        """The reference question's queries ([layers, query heads, q, dim]) and their positions ([q]); slots written
        from now on get its logits (the caller writes those already held again)."""
        self._reference = self._aligned(queries, positions)

    def write(self, slot: int, keys: Tensor) -> None:
        """Slots [slot, slot + n) now hold `keys` ([layers, KV heads, n, dim], rotated as the archive keeps them)."""
        n = keys.shape[2]
        own = keys.to(self.device)[self.pair_layer, self.pair_head].to(torch.float32)  # [pairs, n, dim]
        self.keys[:, slot : slot + n] = own
        if self._reference is not None:
            self.reference_best[:, slot : slot + n] = self._best_logits(self._reference, own)

    def head_scores(self, queries: Tensor, positions: Tensor, blocks: list) -> tuple[Tensor, Tensor]:
        """[scoring heads, blocks] twice, standardised over the blocks: the question's scores (its queries
        [layers, query heads, q, dim] and their positions [q]) and the reference question's."""
        column, used = self._columns(blocks)
        aligned = self._aligned(queries, positions)
        question = self._per_block(self._best_logits(aligned, self.keys[:, :used]), column, len(blocks))
        reference = self._per_block(self.reference_best[:, :used], column, len(blocks))
        return _standardised(question), _standardised(reference)

    def scores(self, question: tuple[Tensor, Tensor], blocks: list) -> Tensor:
        """[blocks] on the host: how much a question points to each block (higher: more), less REFERENCE_WEIGHT of
        the reference question's scores."""
        mine, reference = self.head_scores(*question, blocks)
        return (mine.sum(0) - REFERENCE_WEIGHT * reference.sum(0)).cpu()

    # --- the arithmetic --------------------------------------------------------------------------------------
    def _aligned(self, queries: Tensor, positions: Tensor) -> Tensor:
        """[pairs, group * q, dim]: the scoring pairs' queries, each rotated to sit block_tokens after the block's
        start, scaled by 1/sqrt(dim)."""
        layers, query_heads, q, dim = queries.shape
        grouped = queries.to(self.device).view(layers, -1, self.group, q, dim)[self.pair_layer, self.pair_head]
        flat = grouped.reshape(len(self.pair_layer), self.group * q, dim).to(torch.float32)
        delta = (self.block_tokens - positions.to(self.device)).repeat(self.group)[None].expand(flat.shape[0], -1)
        return shift_rotary(flat, delta, self.inv_freq) / math.sqrt(dim)

    def _best_logits(self, aligned: Tensor, keys: Tensor) -> Tensor:
        """[scoring heads, n]: each slot's largest logit from any of the queries, per scoring head."""
        pairs, rows, _ = aligned.shape
        q = rows // self.group
        step = max(1, TEMPORARY_BYTES // max(1, rows * keys.shape[1] * 4))
        out = []
        for first in range(0, pairs, step):
            part = slice(first, first + step)
            logits = torch.matmul(aligned[part], keys[part].transpose(-1, -2))  # [p, group * q, n]
            best = logits.view(logits.shape[0], self.group, q, -1).amax(2)  # [p, group, n]
            out.append(best[self.scoring[part]])
        return torch.cat(out)

    def _columns(self, blocks: list) -> tuple[Tensor, int]:
        """Each slot's block (its place in `blocks`; slots of none go to a spare column), over the slots used."""
        starts = torch.tensor([b.slot for b in blocks], dtype=torch.long)
        lengths = torch.tensor([b.length for b in blocks], dtype=torch.long)
        used = int((starts + lengths).max())
        column = torch.full((used,), len(blocks), dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(blocks)), lengths)
        offset = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        column[torch.repeat_interleave(starts, lengths) + offset] = owner
        return column.to(self.device), used

    @staticmethod
    def _per_block(logits: Tensor, column: Tensor, blocks: int) -> Tensor:
        """[heads, blocks]: the largest of each block's slots."""
        out = torch.full((logits.shape[0], blocks + 1), float("-inf"), device=logits.device)
        return out.scatter_reduce_(1, column[None].expand(logits.shape[0], -1), logits, reduce="amax")[:, :-1]


def _standardised(scores: Tensor) -> Tensor:
    if scores.shape[1] < 2:
        return scores
    return (scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True).clamp_min(1e-6)
