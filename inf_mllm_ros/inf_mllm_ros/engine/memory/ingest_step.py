"""An input's blocks through the model as fixed-shape steps over the bounded cache's own storage.

The eager way to take a block in (`KVStream._forward` with the cache's layers) appends it after the filled
slots, so every tensor's shape follows the fill and the block's length, and the cache's bookkeeping runs
layer by layer in Python. Here a block of n tokens is padded to the smallest of a few sizes (`block_sizes`:
powers of two up to the chunk size) and goes through one function of fixed shapes, as the decode step of
engine/memory/decode_step.py does for an answer:

- the block's keys and values are written at slots fill .. fill+P-1 of every layer (`index_copy_`; the
  padding's slots lie past the fill, where nothing reads them before they are written again), and the slots'
  bookkeeping (positions, stream index, frame and pin flags) with them, on every layer-head at once;
- attention runs over **all** slots with the mask "slot <= fill + i" for the block's i-th token (the cached
  slots and the block causally), from one softmax that also adds the attention the n real tokens pay each
  slot to the retrieval window's scores (engine/ops/attention.py, `masked_attention_with_scores`);
- the fill and n are device tensors; the logits of the block's last real token are returned.

What cannot take a fixed shape stays eager and follows the step: the archive's copy of the block (it must be
taken before the eviction moves the slots), the host's counters, and the eviction and re-pack (the policy's
choice and the re-rotation, already one pass over every layer-head: `BoundedKVCache.end_forward`).

`compiled` puts the step under `torch.compile(fullgraph=True, dynamic=False)` (on CUDA with
`mode="reduce-overhead"`: CUDA graphs): one graph per block size. The memory after each block is the eager
path's within float32 tolerance, and the same slots are kept (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..ops.attention import SCORES_ARGUMENT
from .decode_step import SlotLayer, compile_step

if TYPE_CHECKING:
    from ..models.adapters import ModelAdapter
    from .cache import BoundedKVCache
    from .cache_layer import BoundedLayer
    from .forward_plan import ForwardPlan, PromptPositions

# The smallest padded block: shorter blocks would each need a graph of their own for little gain.
SMALLEST_BLOCK = 16
# On a GPU, the padded size of a message's blocks (most messages are shorter).
GPU_MESSAGE_BLOCK = 128


def block_sizes(chunk_size: int, device: torch.device | str = "cpu") -> tuple[int, ...]:
    """The padded sizes a block may take. On a CPU, where a block's cost grows with its length: powers of two from
    SMALLEST_BLOCK below the chunk size, and the chunk size itself (a long input's blocks are all of it). On a GPU
    at most two, a message's (GPU_MESSAGE_BLOCK) and the chunk size (a frame's blocks): a block's step there is bound
    by reading the weights and launching kernels more than by its length, and each size is one more compile (about a
    minute) at the memory's first input."""
    if torch.device(device).type == "cuda":
        return (chunk_size,) if chunk_size <= GPU_MESSAGE_BLOCK else (GPU_MESSAGE_BLOCK, chunk_size)
    sizes, size = [], SMALLEST_BLOCK
    while size < chunk_size:
        sizes.append(size)
        size *= 2
    return (*sizes, chunk_size)


class StaticIngester:
    """Blocks of an input through the model in fixed-shape steps over a bounded cache's storage.

    mode: 'static' (the fixed-shape step, not compiled) or 'compiled'. sizes: the padded block sizes (default
    `block_sizes` of the chunk size on the model's device). compile_options: extra arguments of
    `torch.compile` (tests pass a counting backend); the defaults are fullgraph=True, dynamic=False and, on
    CUDA, mode='reduce-overhead'.
    """

    def __init__(self, adapter: ModelAdapter, cache: BoundedKVCache, chunk_size: int, mode: str = "static", *,
                 sizes: tuple[int, ...] | None = None, compile_options: dict | None = None):
        if mode not in ("static", "compiled"):
            raise ValueError(f"StaticIngester mode must be 'static' or 'compiled', got {mode!r}")
        self.adapter, self.cache, self.mode = adapter, cache, mode
        self.sizes = sizes or block_sizes(chunk_size, adapter.device)
        if max(self.sizes) < chunk_size:
            raise ValueError(f"block sizes {self.sizes} leave blocks of up to {chunk_size} tokens out")
        self.compile_options = compile_options or {}
        self._bound_to: list[int] | None = None
        self._steps: dict[tuple[int, bool], Callable] = {}
        self._made = False  # every block size's step made (compiled, where compiled) by `warm_up`
        self.blocks = 0  # blocks taken in through the step

    @property
    def ready(self) -> bool:
        """Every block size's step made, over the cache's storage as it is (a memory restored into new storage
        makes them again at its next input)."""
        return self._made and self._bound_to == self.cache.storage_pointers()

    def padded_size(self, n: int) -> int | None:
        """The size a block of n tokens is padded to (None: longer than any)."""
        return next((size for size in self.sizes if size >= n), None)

    def fits(self, plan: "ForwardPlan", *, all_logits: bool) -> bool:
        """Whether the staged block of n tokens can go through the step: the steps are made (`warm_up`, after the
        memory's first input: a step that cannot be made fails there, not in an input), the layers share their
        storage (so that one pass writes every layer-head), the padded block fits in the slots, and neither every
        token's logits nor the layers' queries are asked for (the eager path gives those)."""
        size = self.padded_size(len(plan))
        cache = self.cache
        return (self.ready and size is not None and not all_logits and plan.capture is None
                and cache.stacked_layers() is not None and cache.fill + size <= cache.slots)

    # --- the step ----------------------------------------------------------------------------------------
    def _bind(self) -> None:
        """Views of the cache's storage and the step's state tensors: made once, again only if the storage was
        made anew (a restored memory may allocate it)."""
        pointers = self.cache.storage_pointers()
        if pointers == self._bound_to:
            return
        cache = self.cache
        rows = cache.stacked_layers()
        if rows is None:
            raise RuntimeError("the static ingest step needs layers that share their storage")
        device = cache.layers[0].device
        self.rows = rows
        self.fill = torch.zeros(1, dtype=torch.long, device=device)
        self.valid_count = torch.zeros(1, dtype=torch.long, device=device)
        self.slot_index = torch.arange(cache.slots, device=device)
        # Per block size: its slots (fill .. fill+P-1, advanced on the device) and the layers that write there.
        self._slots = {size: torch.zeros(size, dtype=torch.long, device=device) for size in self.sizes}
        self._writers = {size: Cache(layers=[SlotLayer(layer.keys, layer.values, slots) for layer in cache.layers])
                         for size, slots in self._slots.items()}
        self.window_attention = rows.window_attention.view(len(cache.layers), -1, cache.slots)
        if device.type == "cuda":
            # Fixed addresses, so that CUDA graphs replay over the live storage instead of copying it.
            layer_kv = (t for layer in cache.layers for t in (layer.keys, layer.values))
            for t in (self.fill, self.valid_count, self.slot_index, self.window_attention, *self._slots.values(),
                      *self._stores(), *layer_kv):
                torch._dynamo.mark_static_address(t)
        self._steps, self._made = {}, False
        self._bound_to = pointers

    def _stores(self) -> list[Tensor]:
        rows = self.rows
        stores = [rows.keys, rows.values, *rows.slot_tensors()]
        return stores if rows.key_origin is None else stores + [rows.key_origin]

    def _step_for(self, size: int, scores: bool) -> Callable:
        step = self._steps.get((size, scores))
        if step is None:
            def eager(embeds, position_ids, start, end, seq, frame, pinned):
                return self._eager_step(size, scores, embeds, position_ids, start, end, seq, frame, pinned)
            step = eager
            if self.mode == "compiled":
                step = compile_step(eager, self.adapter.model, self.rows.device, self.compile_options)
            self._steps[size, scores] = step
        return step

    def _eager_step(self, size: int, scores: bool, embeds: Tensor, position_ids: Tensor, start: Tensor, end: Tensor,
                    seq: Tensor, frame: Tensor, pinned: Tensor) -> Tensor:
        """A padded block of `size` tokens at slots fill.. (of which the first `valid_count` are real): its slots'
        bookkeeping, its forward, and its scores if asked. Returns the last real token's logits [1, vocab]."""
        rows, slots = self.rows, self._slots[size]
        slots.copy_(self.fill + torch.arange(size, device=slots.device))
        write_block_rows(rows, slots, start, end, seq, frame, pinned)
        mask = (self.slot_index[None, :] <= slots[:, None])[None, None]
        extra = {}
        if scores:
            valid = torch.arange(size, device=slots.device) < self.valid_count
            extra[SCORES_ARGUMENT] = (self.window_attention, valid)
        logits = self.adapter.forward(embeds, position_ids, self._writers[size], attention_mask=mask,
                                      logits_at=(self.valid_count - 1).clamp(min=0), **extra)
        keep_key_origin(rows, slots, start)
        return logits

    def warm_up(self) -> None:
        """Make every block size's step (compile it) with no real token: it writes only slots past the fill, which
        nothing reads before they are written again, and adds nothing to any score."""
        cache = self.cache
        if cache.stacked_layers() is None:
            return  # the storage is made with the first block (or the layers do not share it: eager then)
        self._bind()
        device, hidden = self.rows.device, self.adapter.model.get_input_embeddings().weight.shape[1]
        for size in self.sizes:
            if cache.fill + size > cache.slots:
                continue
            self.fill.fill_(cache.fill)
            self.valid_count.fill_(0)
            with torch.inference_mode():
                positions = torch.full((size,), cache.next_position, dtype=torch.long, device=device)
                embeds = torch.zeros(size, hidden, dtype=self.rows.dtype, device=device)
                flags = torch.zeros(size, dtype=torch.bool, device=device)
                self._step_for(size, cache.policy.needs_attention)(
                    embeds, self.adapter.model_position_ids(self.adapter.text_position_ids(positions), 0),
                    positions.clone(), positions + 1, positions.clone(), flags, flags.clone())
        self._made = True

    # --- a block -------------------------------------------------------------------------------------------
    def run(self, embeds: Tensor, position_ids: Tensor, plan: "ForwardPlan") -> Tensor:
        """Take the block staged on the cache with `plan` (`BoundedKVCache.stage`): its embeddings [n, hidden]
        and model position ids (`ModelAdapter.model_position_ids`) through the step, then the eager rest:
        the plan's recording, the layers' counters, the eviction and re-pack. Returns the last token's logits."""
        cache, positions = self.cache, plan.positions
        n = embeds.shape[0]
        size = self.padded_size(n)
        self._bind()
        fill, device = cache.fill, self.rows.device
        self.fill.fill_(fill)
        self.valid_count.fill_(n)
        scores = cache.wants_scores
        # Every input made anew here and in inference mode, as in `warm_up`: a guard of the graph tells apart
        # inference tensors from others, and views from tensors of their own.
        with torch.inference_mode():
            block = padded_block(embeds, position_ids, positions, size, device)
            logits = self._step_for(size, scores)(block.embeds, block.position_ids, block.start, block.end, block.seq,
                                                  block.frame, block.pinned)
        finish_block(cache, plan, fill, n, scored=scores)
        self.blocks += 1
        return logits


@dataclass
class PaddedBlock:
    """A block's inputs padded to its step's size: embeddings [size, hidden], model position ids, and its slots'
    bookkeeping ([size] each: start and end positions, stream index, frame and pin flags)."""

    embeds: Tensor
    position_ids: Tensor
    start: Tensor
    end: Tensor
    seq: Tensor
    frame: Tensor
    pinned: Tensor


def padded_block(embeds: Tensor, position_ids: Tensor, positions: PromptPositions, size: int,
                 device: torch.device) -> PaddedBlock:
    """A block of n tokens ([n, hidden] embeddings, its model position ids and positions) padded to `size`: zero
    embeddings at the last real position, stream indices past the block's, neither frame nor pin."""
    n = embeds.shape[0]
    pad = size - n
    seq, pinned = positions.seq, positions.pinned
    pinned = (pinned.to(device) if isinstance(pinned, Tensor)
              else torch.full((n,), pinned, dtype=torch.bool, device=device))
    return PaddedBlock(
        torch.cat([embeds, embeds.new_zeros(pad, embeds.shape[1])]),
        _pad_last(position_ids, pad),
        _pad_last(positions.start, pad), _pad_last(positions.end, pad),
        torch.cat([seq, seq[-1] + 1 + torch.arange(pad, device=seq.device)]),
        torch.full((size,), positions.frame, dtype=torch.bool, device=device),
        torch.cat([pinned, pinned.new_zeros(pad)]),
    )


def write_block_rows(rows: "BoundedLayer", slots: Tensor, start: Tensor, end: Tensor, seq: Tensor, frame: Tensor,
                     pinned: Tensor) -> None:
    """The bookkeeping of a padded block's slots, on every layer-head of `rows` (a cache's stacked layers): its
    positions, stream indices, frame and pin flags; no retrieval-window score and no policy statistic yet."""
    heads = rows.pos_start.shape[0]
    for store, value in ((rows.pos_start, start), (rows.pos_end, end), (rows.seq, seq), (rows.frame, frame),
                         (rows.pinned, pinned)):
        store.index_copy_(1, slots, value[None].expand(heads, -1))
    rows.window_attention.index_fill_(1, slots, 0)
    for stat in rows.stats.values():
        stat.index_fill_(1, slots, 0)


def keep_key_origin(rows: "BoundedLayer", slots: Tensor, start: Tensor) -> None:
    """In half precision, each new key as the model rotated it, with its position (re-rotations start from it)."""
    if rows.key_origin is not None:
        rows.key_origin.index_copy_(2, slots, rows.keys.index_select(2, slots))
        rows.pos_origin.index_copy_(1, slots, start[None].expand(rows.pos_start.shape[0], -1))


def finish_block(cache: "BoundedKVCache", plan: "ForwardPlan", fill: int, n: int, *, scored: bool) -> None:
    """What follows a block written into the cache's storage by a step (n real tokens from slot `fill`): the
    plan's recording (copies: the eviction moves the slots), every layer's counters, the eviction and re-pack."""
    if plan.recorder is not None:
        for i, layer in enumerate(cache.layers):
            new = slice(fill, fill + n)
            plan.recorder.take(i, layer.keys[:, :, new].clone(), layer.values[:, :, new].clone())
    for layer in cache.layers:
        layer.took(n, plan.positions, scored=scored)
    with torch.inference_mode():
        cache.end_forward()


def _pad_last(t: Tensor, pad: int) -> Tensor:
    """A new tensor: `t` with its last entry along the last dimension repeated `pad` times (positions of padding:
    in range)."""
    return torch.cat([t, t[..., -1:].expand(*t.shape[:-1], pad)], dim=-1)

