"""Blocks of several streams' inputs through the model as one batch: one pass for all of them.

A block of a few dozen tokens (a robot's message) uses little of what a pass through the weights could do: on this
CPU four 64-token blocks in one pass take about two thirds of the time of four passes (docs/benchmarks.md, several
robots). Every stream of a pool has its own bounded cache, all of one shape, so their blocks go in together as the
static ingest step (engine/memory/ingest_step.py) takes one block in:

- the blocks of a batch are of one size class (`block_sizes`); each is padded to the longest (rounded up to a
  multiple of `PAD_TO`), and its slots' bookkeeping (positions, stream indices, frame and pin flags) written into its
  own cache's storage at slots fill .. fill+P-1, as the static step writes it;
- as each layer comes, the block's new keys and values go into each member's own storage, and the members' slots
  are copied into the batch's rows ([members, heads, span, dim], the span ending at the last slot any member's block
  reaches; one layer's copy at a time); attention runs over the span with each member's own mask (`slot <= fill + i`
  for its i-th token), adding the attention each member's real tokens pay to its retrieval window's scores;
- then each member's own rest, as for a block alone: the archive's copy, the layers' counters, the eviction and
  re-pack its policy chooses.

Each member's memory after the block is what its own step would make of it, within float tolerance, with the same
slots kept (tests: test_streams.py). Eager only: a batch's make-up changes from one block to the next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..ops.attention import QUERIES_ARGUMENT, SCORES_ARGUMENT
from ..ops.few_rows import weights_left
from .ingest_step import finish_block, keep_key_origin, padded_block, write_block_rows

if TYPE_CHECKING:
    from ..models.adapters import ModelAdapter
    from .cache import BoundedKVCache
    from .cache_layer import BoundedLayer
    from .forward_plan import ForwardPlan


class BatchBlockLayer(CacheLayerMixin):
    """One layer of every member of a batch, seen by the pass: member b's new keys and values go to its slots
    `slot[b]` in its own cache's layer (`members[b]`), and attention gets the members' slots up to `span` as one
    [members, heads, span, dim], copied as the layer comes (and let go once it has attended: one layer's copy at a
    time)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, members: list[BoundedLayer], slot: Tensor, span: int):
        super().__init__()
        self.members, self.slot, self.span = members, slot, span
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError("a batch's layers are its members' caches")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        for b, layer in enumerate(self.members):
            layer.keys.index_copy_(2, self.slot[b], key_states[b : b + 1])
            layer.values.index_copy_(2, self.slot[b], value_states[b : b + 1])
        span = slice(0, self.span)
        return (torch.cat([layer.keys[:, :, span] for layer in self.members]),
                torch.cat([layer.values[:, :, span] for layer in self.members]))

    def get_seq_length(self) -> int:
        return 0  # positions are given explicitly

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0

    def get_max_length(self) -> int:
        return self.span


@dataclass
class IngestMember:
    """One stream's block in a batch: its cache (the block's plan staged on it), the block's embeddings [n, hidden]
    and model position ids, whether it wants logits. After the batch: `logits`, its last token's [1, vocab] where
    any member wanted them, and the plan's `capture` filled where it asks for the layers' queries."""

    cache: BoundedKVCache
    embeds: Tensor
    position_ids: Tensor
    plan: ForwardPlan
    wants_logits: bool = True
    logits: Tensor | None = None


# The longest block a batch takes whatever the streams' chunk size: a question goes in whole, up to its headroom.
BATCH_BLOCK = 128
# A batch's blocks are padded to a multiple of this.
PAD_TO = 8


class BatchedIngester:
    """Blocks of several streams' inputs into their caches in one pass of `adapter`'s model. `sizes`: the padded
    sizes a batch's blocks take (`ingest_step.block_sizes`)."""

    def __init__(self, adapter: ModelAdapter, sizes: tuple[int, ...]):
        self.adapter, self.sizes = adapter, sizes
        self.batches = 0  # passes taken, every batch together
        self.blocks = 0  # blocks taken in by them
        self.seconds = 0.0  # time spent in `run`

    def batch_key(self, cache: BoundedKVCache, plan: ForwardPlan) -> tuple | None:
        """What a block staged on `cache` with `plan` can share a pass with (blocks of equal keys: of one size class,
        so that none is padded to more than twice its length), or None where it goes in alone: longer than any size,
        the cache holding nothing yet (its storage is made by its first block) or no room for the padded block."""
        size = next((s for s in self.sizes if s >= len(plan)), None)
        if size is None or cache.fill + size > cache.slots:
            return None
        if cache.stacked_layers() is None:
            return None
        return size, cache.wants_scores, cache.slots

    def run(self, members: list[IngestMember]) -> list[IngestMember]:
        """Every member's block through the model in one pass and into its cache, then each one's eviction and
        re-pack; members of one `batch_key`. Returns the members, their `logits` filled in."""
        start = time.monotonic()
        try:
            self._run(members)
        finally:
            self.seconds += time.monotonic() - start
        self.batches += 1
        self.blocks += len(members)
        return members

    def _run(self, members: list[IngestMember]) -> None:
        keys = {self.batch_key(m.cache, m.plan) for m in members}
        if len(keys) != 1 or None in keys:
            raise ValueError(f"a batch's blocks must share one batch key, got {keys}")
        _, scores, _ = keys.pop()
        # Padded to the longest block (a multiple of PAD_TO), not to its size class: the pass is eager, and every
        # padding row costs as much as a real one.
        size = -(-max(len(m.plan) for m in members) // PAD_TO) * PAD_TO
        device = members[0].cache.layers[0].device
        fills = [m.cache.fill for m in members]
        counts = torch.tensor([len(m.plan) for m in members], device=device)
        layers = len(members[0].cache.layers)
        with torch.inference_mode():
            slots = torch.tensor(fills, device=device)[:, None] + torch.arange(size, device=device)
            blocks = [padded_block(m.embeds, m.position_ids, m.plan.positions, size, device) for m in members]
            rows = [m.cache.stacked_layers() for m in members]
            for row, slot, block in zip(rows, slots, blocks):
                write_block_rows(row, slot, block.start, block.end, block.seq, block.frame, block.pinned)
            span = max(fills) + size
            writer = Cache(layers=[BatchBlockLayer([m.cache.layers[i] for m in members], slots, span)
                                   for i in range(layers)])
            mask = (torch.arange(span, device=device)[None, None, :] <= slots[:, :, None])[:, None]
            extra = {}
            queries = {} if any(m.plan.capture is not None for m in members) else None
            if queries is not None:
                extra[QUERIES_ARGUMENT] = queries
            if scores:
                heads = members[0].cache.layers[0].keys.shape[1]
                into = torch.zeros(layers, len(members), heads, span, dtype=torch.float32, device=device)
                extra[SCORES_ARGUMENT] = (into, torch.arange(size, device=device)[None, :] < counts[:, None])
            with weights_left():  # the members' last tokens: a few rows through a tied vocabulary projection
                logits = self.adapter.forward_batch(
                    torch.stack([b.embeds for b in blocks]), torch.cat([b.position_ids for b in blocks], dim=-2),
                    writer, mask, logits_at=counts - 1, logits=any(m.wants_logits for m in members), **extra)
            for b, (member, row, block) in enumerate(zip(members, rows, blocks)):
                if scores:
                    row.window_attention.view(layers, heads, -1)[:, :, :span].add_(into[:, b])
                keep_key_origin(row, slots[b], block.start)
                if logits is not None:
                    member.logits = logits[b : b + 1]
                if member.plan.capture is not None:
                    member.plan.capture.update({i: q[b] for i, q in queries.items()})
        for member, fill in zip(members, fills):
            finish_block(member.cache, member.plan, fill, len(member.plan), scored=scores)
