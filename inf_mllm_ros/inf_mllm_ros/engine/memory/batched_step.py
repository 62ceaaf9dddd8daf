"""The answers of several streams decoded together: one model step for all of them.

At small batch a decode step is bound by reading the weights (on this CPU a 0.5B step is within 1.3x of its
bandwidth floor: docs/benchmarks.md), so several answers cost little more than one if they go through the model as
one batch. Every stream's cache has the same shape (`BoundedKVCache.slots` slots of every layer), so their storage
stacks along the batch dimension:

- when the batch forms, each layer's keys and values of every member are copied once into the batch's own rows
  ([members, heads, span, dim], the span being the slots up to the last one any member's answer reaches); each step
  writes each member's new token at that member's next slot there, and attention runs over the span with each
  member's own mask (`slot index <= its slot`), as the single stream's fixed-shape step (engine/memory/decode_step.py)
  does over its own storage;
- the members' caches are never written: an answer's slots are taken away after it anyway (a kept answer goes
  into its stream's memory afterwards as a prompt of its own), so each stream's memory is what it was;
- tokens, slots and positions live on the device, the next tokens are chosen there (greedy), and the host reads
  them back every `sync_every` steps; a member leaves the batch at its stop token, at its `max_new`, or when its
  progress callback raises (a cancel), and the batch goes on without it.

Each member's tokens are the ones it would get decoding alone (tests: test_streams.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..ops.few_rows import weights_left
from .decode_step import SYNC_EVERY, StorageLayer

if TYPE_CHECKING:
    from ..models.adapters import ModelAdapter
    from .cache import BoundedKVCache


def _batch_rows(caches: list[BoundedKVCache], span: int) -> Tensor:
    """Every layer's keys and values of the caches' first `span` slots as one tensor [layers, 2, members, heads, span,
    dim]: one allocation, given back to the system whole when the batch ends, where a tensor a layer would stay in the
    allocator's free lists."""
    first = caches[0].layers[0].keys
    rows = first.new_empty(len(caches[0].layers), 2, len(caches), *first.shape[1:2], span, first.shape[-1])
    for i in range(rows.shape[0]):
        for b, cache in enumerate(caches):
            rows[i, 0, b].copy_(cache.layers[i].keys[0, :, :span])
            rows[i, 1, b].copy_(cache.layers[i].values[0, :, :span])
    return rows


class BatchRowsLayer(StorageLayer):
    """One layer's keys and values of every member of a batch, [members, heads, span, dim]: each step's new key of
    member b goes to its slot `slot[b]`, and attention gets the whole span of every member."""

    def __init__(self, keys: Tensor, values: Tensor, slot: Tensor):
        super().__init__(keys, values, slot)
        self.rows = torch.arange(keys.shape[0], device=keys.device)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError("a batch's rows are copied from its members' caches when it forms")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # One token per member: [members, heads, 1, dim] into each member's own slot.
        self.keys[self.rows, :, self.slot] = key_states[:, :, 0]
        self.values[self.rows, :, self.slot] = value_states[:, :, 0]
        return self.keys, self.values


@dataclass
class DecodeMember:
    """One stream's answer in a batch: its cache (the question already in it), the question's last logits, how many
    tokens it may have, its stop tokens and its progress callback (which may raise to end the answer: a cancel).
    After the batch: its `tokens`, or the `error` its callback raised."""

    cache: BoundedKVCache
    logits: Tensor
    max_new: int
    stop_ids: set[int]
    on_read: Callable[[list[int]], None] = lambda tokens: None
    tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None


class BatchedDecoder:
    """Greedy decoding of several streams' answers at once, over one model (eager: a batch's shape changes as its
    members leave it)."""

    def __init__(self, adapter: ModelAdapter, *, sync_every: int = SYNC_EVERY):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.adapter, self.sync_every = adapter, sync_every
        self.steps = 0  # model steps taken, all batches together
        self.seconds = 0.0  # time spent in `generate`, all batches together

    def generate(self, members: list[DecodeMember]) -> list[DecodeMember]:
        """Decode every member's answer, up to its `max_new` or its first stop token (kept, not fed). Returns the
        members, their `tokens` (or `error`) filled in. ValueError, before any step, for a member whose answer does not
        fit in its cache's slots or whose cache is not of the others' shape."""
        start = time.monotonic()
        try:
            return self._generate(members)
        finally:
            self.seconds += time.monotonic() - start

    def _generate(self, members: list[DecodeMember]) -> list[DecodeMember]:
        for member in members:
            cache = member.cache
            if not cache.layers or not all(layer.is_initialized for layer in cache.layers):
                raise ValueError("nothing to decode over: a member's cache holds no tokens yet")
            if cache.fill + member.max_new - 1 > cache.slots:
                raise ValueError(f"{member.max_new} tokens do not fit after {cache.fill} cached in {cache.slots} slots")
        shapes = {tuple(tuple(layer.keys.shape) for layer in m.cache.layers) for m in members}
        if len(shapes) > 1:
            raise ValueError("a batch's caches must be of one shape (the same model, capacity and headroom)")
        active = [m for m in members if m.max_new >= 1]
        if not active:
            return members
        device = active[0].cache.layers[0].device
        longest = max(m.max_new for m in active)
        with torch.inference_mode():
            token = torch.stack([m.logits[-1].argmax(-1) for m in active]).to(device)
            slot = torch.tensor([m.cache.fill for m in active], dtype=torch.long, device=device)
            position = torch.tensor([m.cache.next_position for m in active], dtype=torch.long, device=device)
            chosen = torch.empty(len(active), longest, dtype=torch.long, device=device)
            # Only the slots some member reads: its cached ones and its answer's (the last token is not fed).
            span = max(m.cache.fill + m.max_new - 1 for m in active)
            rows = _batch_rows([m.cache for m in active], span)
            slot_index = torch.arange(span, device=device)
            step = 0
            while True:
                chosen[:, step] = token
                due = [row for row, m in enumerate(active)
                       if step == m.max_new - 1 or (step + 1) % self.sync_every == 0]
                leaving = set()
                if due:
                    read = chosen[:, : step + 1].tolist()  # one wait for the device for every member due
                    for row in due:
                        if self._read(active[row], read[row], step):
                            leaving.add(row)
                if leaving:
                    keep = [row for row in range(len(active)) if row not in leaving]
                    active = [active[row] for row in keep]
                    if not active:
                        return members
                    kept = torch.tensor(keep, dtype=torch.long, device=device)
                    token, slot, position, chosen = (t.index_select(0, kept) for t in (token, slot, position, chosen))
                    rows = rows.index_select(2, kept)
                writer = Cache(layers=[BatchRowsLayer(rows[i, 0], rows[i, 1], slot) for i in range(rows.shape[0])])
                self._step(writer, token, slot, position, slot_index)
                step += 1

    def _read(self, member: DecodeMember, chosen: list[int], step: int) -> bool:
        """Take a member's tokens read back so far; whether it leaves the batch (stop token, its last token, or its
        callback raised)."""
        for token in chosen[len(member.tokens) :]:
            member.tokens.append(token)
            if token in member.stop_ids:
                break
        try:
            member.on_read(member.tokens)
        except BaseException as exc:  # a cancel or a stop ends this answer only
            member.error = exc
            return True
        return member.tokens[-1] in member.stop_ids or step == member.max_new - 1

    def _step(self, writer: Cache, token: Tensor, slot: Tensor, position: Tensor, slot_index: Tensor) -> None:
        """Every member's token through the decoder at its slot and position; the greedy next tokens replace `token`,
        and slots and positions advance."""
        adapter = self.adapter
        embeds = adapter.model.get_input_embeddings()(token)[:, None]
        position_ids = adapter.text_position_ids(position).unsqueeze(-1)  # [members, 1] (M-RoPE: [3, members, 1])
        mask = (slot_index[None, :] <= slot[:, None])[:, None, None, :]
        with weights_left():  # a tied vocabulary projection takes the few rows weights-left: engine/ops/few_rows.py
            logits = adapter.forward_batch(embeds, position_ids, writer, mask)
        token.copy_(logits.argmax(-1))
        slot.add_(1)
        position.add_(1)
        self.steps += 1
