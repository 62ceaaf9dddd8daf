"""A bounded KV cache for transformers decoder models.

Each layer has storage for `capacity + headroom` tokens, allocated once at the first update and
never reallocated. New tokens are appended; after each block of a prompt (at most chunk_size tokens;
"prompt" below means one such staged forward pass) the eviction policy chooses, per KV head, which
`capacity` slots survive, and they are gathered to the front in stream order.

Layers of one shape (the usual case) share one block of storage, each layer a slice of it, so that
eviction and re-packing run once for the whole model after the last layer has attended, on every
layer-head at once: a fixed number of tensor operations per prompt instead of that many per layer (on
a GPU a small model's time goes mostly to launching them). The choice is the same slot for slot:
each layer-head is still ranked on its own attention.

Positions. Every slot remembers the RoPE position its key was rotated with (`pos_start`; `pos_end`
is one past the largest position component the token uses, which differs from `pos_start + 1` only
for M-RoPE image tokens). In "cache" mode the survivors are re-packed after eviction: gaps left by
evicted tokens are closed and each key is rotated by its shift, so positions stay below the cache
size however long the stream runs (StreamingLLM's reason for stability past the training context).
In "original" mode positions are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from .policies import EvictionPolicy, SlotView
from .scoring import window_scores

POSITION_MODES = ("cache", "original")
# The most one temporary tensor of a gather or a re-pack may take: with every layer evicted in one pass, a
# rotation of every key at once would briefly hold several float32 copies of the whole cache.
TEMPORARY_BYTES = 4 << 20


class CacheOverflowError(RuntimeError):
    """More tokens were pushed than the storage can hold before the next eviction."""


@dataclass
class PromptPositions:
    """Positions of the tokens about to be appended (same for every layer and head)."""

    start: Tensor  # [q] int64: the position the key is rotated with
    end: Tensor  # [q] int64: one past the largest position component of the token
    first_seq: int  # index in the stream of the first of these tokens (the others follow it)
    frame: bool = False  # the tokens belong to a camera frame's prompt (else to text)
    pinned: bool | Tensor = False  # the caller asked to keep these tokens (or [q] bool, per token)

    @classmethod
    def contiguous(cls, first_position: int, first_seq: int, length: int, device=None) -> "PromptPositions":
        pos = torch.arange(first_position, first_position + length, dtype=torch.long, device=device)
        return cls(pos, pos + 1, first_seq)

    def __len__(self) -> int:
        return int(self.start.shape[0])

    @property
    def seq_end(self) -> int:
        """One past the stream index of the last of these tokens: the stream's clock once they are in."""
        return self.first_seq + len(self)

    @cached_property
    def seq(self) -> Tensor:
        """[q] int64: index of each token in the stream, made once per prompt on the positions' device."""
        return torch.arange(self.first_seq, self.seq_end, dtype=torch.long, device=self.start.device)

    @cached_property
    def last_end(self) -> int:
        """One past the largest position of these tokens: read once per prompt, not once per layer (on a
        GPU every read waits for the device)."""
        return int(self.end.max())


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_rotary(keys: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate RoPE keys by `delta` positions: R(p + d) k = R(d) R(p) k.

    keys [heads, n, head_dim], delta [heads, n]. Only the first 2 * len(inv_freq) dims are rotary.
    The math runs in float32 so repeated shifts do not accumulate rounding of low-precision dtypes.
    """
    rot = inv_freq.shape[0] * 2
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(device=keys.device, dtype=torch.float32)
    angles = torch.cat((angles, angles), dim=-1)
    k = keys[..., :rot].to(torch.float32)
    rotated = k * angles.cos() + rotate_half(k) * angles.sin()
    if rot == keys.shape[-1]:
        return rotated.to(keys.dtype)
    return torch.cat((rotated.to(keys.dtype), keys[..., rot:]), dim=-1)


def packed_positions(start: Tensor, end: Tensor, seq: Tensor) -> tuple[Tensor, Tensor]:
    """Close the gaps that evicted tokens left, per head. Returns (new_start, new_end).

    Runs of tokens that were adjacent in the stream keep their relative positions (so an image's
    2-D layout survives); each run starts where the previous run's positions ended.
    """
    heads, n = start.shape
    if n == 0:
        return start, end
    new_run = torch.ones_like(seq, dtype=torch.bool)
    new_run[:, 1:] = seq[:, 1:] != seq[:, :-1] + 1
    run_id = new_run.long().cumsum(-1) - 1  # [heads, n]
    # Room for n runs, the most there can be: reading the count would make the host wait for the device.
    # Unused runs stay at 0 extent and shift nothing.
    empty = torch.zeros(heads, n, dtype=start.dtype, device=start.device)
    run_first = empty.scatter_reduce(1, run_id, start, reduce="amin", include_self=False)
    run_last_end = empty.scatter_reduce(1, run_id, end, reduce="amax", include_self=False)
    extent = run_last_end - run_first
    run_new_first = extent.cumsum(-1) - extent
    delta = (run_new_first - run_first).gather(1, run_id)
    return start + delta, end + delta


class BoundedLayer(CacheLayerMixin):
    """One decoder layer's slots: keys, values, positions and attention statistics."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "BoundedKVCache", index: int = 0):
        super().__init__()
        self.owner = owner
        self.index = index  # place among the cache's layers (its slice of shared storage)
        self.fill = 0
        # Queries scored since the last eviction (the retrieval window), each seeing every older slot: a
        # count on the host, so that the policy's average needs no per-slot tally on the device.
        self.window_queries = 0
        self._frontier = 0  # next free position after the tokens this layer has seen
        self.frontier_on_device: Tensor | None = None  # the same, once a re-pack left it on the device
        # Whether a pinned token, or a frame's, came in since the layer was last empty: known on the host, so
        # a policy need not ask the device (on a GPU every question makes the host wait).
        self.may_hold_pins = False
        self.may_hold_frames = False

    @property
    def frontier(self) -> int:
        if self.frontier_on_device is not None:
            self.owner.read_frontiers()
        return self._frontier

    @frontier.setter
    def frontier(self, value: int) -> None:
        self._frontier, self.frontier_on_device = value, None

    # --- storage -----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        slots = self.owner.slots
        self.dtype, self.device = key_states.dtype, key_states.device
        store = self.owner.storage_for(self.index, key_states.device)
        self.keys = store("keys", (1, heads, slots, head_dim), key_states.dtype)
        self.values = store("values", (1, heads, slots, value_states.shape[-1]), value_states.dtype)
        # In half precision every re-pack would round the re-rotated keys again, and long-lived keys (the
        # saddles) are re-packed most. Keeping each key as the model rotated it, with that position, lets
        # every re-pack rotate from the original: one rounding, however often a key moves.
        exact = key_states.dtype == torch.float32 or self.owner.position_mode != "cache"
        self.key_origin = None if exact else store("key_origin", self.keys.shape, key_states.dtype)
        self.pos_start = store("pos_start", (heads, slots), torch.long)
        self.pos_end = store("pos_end", (heads, slots), torch.long)
        self.pos_origin = None if exact else store("pos_origin", (heads, slots), torch.long)
        self.seq = store("seq", (heads, slots), torch.long)
        self.frame = store("frame", (heads, slots), torch.bool)
        self.pinned = store("pinned", (heads, slots), torch.bool)
        self.window_attention = store("window_attention", (heads, slots), torch.float32)
        self.window_start = 0  # first slot appended since the last eviction
        self.stats = {name: store(f"stat.{name}", (heads, slots), torch.float32)
                      for name in self.owner.policy.slot_stats}
        self.is_initialized = True

    @property
    def num_heads(self) -> int:
        return self.keys.shape[1]

    def _per_head(self) -> list[Tensor]:
        """Every per-slot tensor that moves with the slots at an eviction ([heads, slots])."""
        tensors = [self.pos_start, self.pos_end, self.seq, self.frame, self.pinned, self.window_attention,
                   *self.stats.values()]
        return tensors if self.pos_origin is None else tensors + [self.pos_origin]

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, *self._per_head()]
        if self.key_origin is not None:
            tensors.append(self.key_origin)
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # --- transformers cache protocol -----------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.fill + q
        if key_states.shape[0] != 1:
            raise ValueError("the bounded cache holds one stream: batch size must be 1")
        self.keys[:, :, self.fill : end] = key_states
        self.values[:, :, self.fill : end] = value_states
        if self.owner.recording:
            self.owner.archive.take(self.index, key_states, value_states, len(self.owner.layers))
        staged = self.owner.staged
        if staged is None or len(staged) != q:
            raise RuntimeError("positions of the incoming tokens were not staged on the cache")
        self.pos_start[:, self.fill : end] = staged.start
        self.pos_end[:, self.fill : end] = staged.end
        self.seq[:, self.fill : end] = staged.seq
        self.frame[:, self.fill : end] = staged.frame
        self.pinned[:, self.fill : end] = staged.pinned
        self.may_hold_pins |= staged.pinned is not False
        self.may_hold_frames |= staged.frame
        if self.key_origin is not None:
            self.key_origin[:, :, self.fill : end] = key_states
            self.pos_origin[:, self.fill : end] = staged.start
        self.window_attention[:, self.fill : end] = 0
        for stat in self.stats.values():
            stat[:, self.fill : end] = 0
        self.frontier = max(self.frontier, staged.last_end)
        self.fill = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.fill

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The physical layout is [kept slots | new tokens]: a plain causal mask over it is right.
        return self.fill + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.slots

    def reset(self) -> None:
        self.fill = 0
        self.frontier = 0
        self.window_start = self.window_queries = 0
        self.may_hold_pins = self.may_hold_frames = False

    # --- saved state -----------------------------------------------------------------------------------
    def export_state(self) -> dict[str, Tensor]:
        """The held slots and their bookkeeping, trimmed to `fill` (empty before the first token)."""
        if not self.is_initialized:
            return {}
        n = self.fill
        state = {
            "keys": self.keys[0, :, :n], "values": self.values[0, :, :n],
            "pos_start": self.pos_start[:, :n], "pos_end": self.pos_end[:, :n], "seq": self.seq[:, :n],
            "frame": self.frame[:, :n], "pinned": self.pinned[:, :n],
            "window_attention": self.window_attention[:, :n],
            "counters": torch.tensor([self.fill, self.frontier, self.window_start, self.window_queries],
                                     dtype=torch.long),
        }
        state.update({f"stat.{name}": stat[:, :n] for name, stat in self.stats.items()})
        if self.key_origin is not None:
            state.update(key_origin=self.key_origin[0, :, :n], pos_origin=self.pos_origin[:, :n])
        return {name: t.contiguous() for name, t in state.items()}

    def import_state(self, state: dict[str, Tensor], *, dtype: torch.dtype, device: torch.device) -> None:
        """Restore what `export_state` gave (storage is allocated here if it was not yet)."""
        if not state:
            self.reset()
            return
        fill, frontier, window_start, window_queries = (int(v) for v in state["counters"])
        keys, values = state["keys"], state["values"]
        # The full cache never evicts, so it may hold its headroom too; the others keep their capacity.
        room = self.owner.capacity if self.owner.policy.evicts else self.owner.slots
        if fill > room or keys.shape[1] != fill:
            raise ValueError(f"saved layer holds {keys.shape[1]} tokens (fill {fill}); the cache keeps {room}")
        if not self.is_initialized:
            self.lazy_initialization(keys[None].to(device, dtype), values[None].to(device, dtype))
        if self.keys.shape[1] != keys.shape[0] or self.keys.shape[-1] != keys.shape[-1]:
            raise ValueError(f"saved keys {tuple(keys.shape)} do not fit this model's {tuple(self.keys.shape[1:])}")
        saved_stats = {k[5:] for k in state if k.startswith("stat.")}
        if set(self.stats) != saved_stats:
            raise ValueError(f"saved policy statistics {sorted(saved_stats)} differ from this policy's "
                             f"{sorted(self.stats)} (saved by another version of the policy)")
        self.keys[0, :, :fill] = keys.to(device, dtype)
        self.values[0, :, :fill] = values.to(device, dtype)
        for name in ("pos_start", "pos_end", "seq", "window_attention"):
            getattr(self, name)[:, :fill] = state[name].to(device)
        self.frame[:, :fill] = state["frame"].to(device)
        self.pinned[:, :fill] = state["pinned"].to(device)
        for name, stat in self.stats.items():
            stat[:, :fill] = state[f"stat.{name}"].to(device)
        if self.key_origin is not None:  # half precision (the file's dtype is this cache's)
            self.key_origin[0, :, :fill] = state["key_origin"].to(device, dtype)
            self.pos_origin[:, :fill] = state["pos_origin"].to(device)
        self.fill, self.frontier, self.window_start = fill, frontier, window_start
        self.window_queries = window_queries
        self.may_hold_pins = bool(self.pinned[:, :fill].any())
        self.may_hold_frames = bool(self.frame[:, :fill].any())

    # --- Inf-MLLM bookkeeping --------------------------------------------------------------------------
    def observe(self, query: Tensor, key: Tensor, scaling: float, scores: Tensor | None = None) -> None:
        """Add the attention the new queries pay to every visible slot (computed here unless given)."""
        q = query.shape[-2]
        n_past = self.fill - q
        if scores is None:
            scores = window_scores(query[0], key[0], n_past, scaling, backend=self.owner.scoring_backend)
        self.window_attention[:, : self.fill].add_(scores)
        self.window_queries += q

    def evict(self, policy: EvictionPolicy, keep: int) -> int:
        """Keep `keep` slots chosen by the policy; returns how many tokens were evicted."""
        n = self.fill
        if n <= keep:
            return 0
        view = SlotView(
            fill=n,
            num_heads=self.num_heads,
            seq=self.seq[:, :n],
            frame=self.frame[:, :n] if self.may_hold_frames else None,
            pinned=self.pinned[:, :n] if self.may_hold_pins else None,
            window_attention=self.window_attention[:, :n],
            window_queries=self.window_queries,
            new=n - self.window_start,
            stream_end=self.owner.staged.seq_end,
            stats={name: stat[:, :n] for name, stat in self.stats.items()},
        )
        idx = policy.select(view, keep)
        self._gather(idx)
        self.fill = keep
        # The retrieval window ends with the eviction it drove.
        self.window_attention[:, :keep] = 0
        self.window_queries = 0
        self.window_start = keep
        return n - keep

    def _gather(self, idx: Tensor) -> None:
        keep = idx.shape[-1]
        stores = (self.keys, self.values) if self.key_origin is None else (self.keys, self.values, self.key_origin)
        for store in stores:
            dim = store.shape[-1]
            for rows in self._row_blocks(keep * dim * store.element_size()):
                full = idx[rows, :, None].expand(-1, -1, dim)
                store[0, rows, :keep] = torch.gather(store[0, rows], 1, full)
        for meta in self._per_head():
            meta[:, :keep] = torch.gather(meta, 1, idx)

    def pack_positions(self, inv_freq: Tensor) -> Tensor:
        """Close position gaps (cache mode) and rotate the keys to match. Returns the slots' new ends."""
        n = self.fill
        start, end = packed_positions(self.pos_start[:, :n], self.pos_end[:, :n], self.seq[:, :n])
        # Rotated whether or not anything moved: a re-pack follows gaps, so something nearly always has, and
        # asking would make the host wait for a GPU.
        if self.key_origin is None:
            source, shift = self.keys, start - self.pos_start[:, :n]
        else:
            source, shift = self.key_origin, start - self.pos_origin[:, :n]
        for rows in self._row_blocks(n * self.keys.shape[-1] * 4):  # the rotation runs in float32
            self.keys[0, rows, :n] = shift_rotary(source[0, rows, :n], shift[rows], inv_freq)
        self.pos_start[:, :n] = start
        self.pos_end[:, :n] = end
        self.frontier = 0
        if n:
            self.frontier_on_device = end.max()  # read with every layer's at once, when next needed
        return end

    def _row_blocks(self, bytes_per_row: int) -> list[slice]:
        """The rows (layer-heads) in blocks whose temporaries take at most TEMPORARY_BYTES each: all at once
        for a small model, where launches dominate; a bounded peak for a large model and cache."""
        rows = self.keys.shape[1]
        step = max(1, TEMPORARY_BYTES // max(bytes_per_row, 1))
        return [slice(first, min(first + step, rows)) for first in range(0, rows, step)]


class BoundedKVCache(Cache):
    """A KV cache of fixed size for one stream, with a pluggable eviction policy.

    capacity: tokens kept after each eviction.
    headroom: extra slots for the block being pushed (at least one chunk) or a question and its answer
        (StreamConfig decides it: max(chunk_size, 256) unless given).
    rope_inv_freq: the model's RoPE inverse frequencies, needed to re-pack positions in "cache" mode.
    stack_layers: evict and re-pack every layer in one pass over storage shared by the layers (when they
        are of one shape); False: one layer at a time. Either way after the last layer has attended, and
        the same slots are kept.
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        policy: EvictionPolicy,
        *,
        headroom: int,
        position_mode: str = "cache",
        rope_inv_freq: Tensor | None = None,
        scoring_backend: str = "auto",
        stack_layers: bool = True,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if headroom < 1:
            raise ValueError(f"headroom must be >= 1, got {headroom}")
        if position_mode not in POSITION_MODES:
            raise ValueError(f"position_mode must be one of {POSITION_MODES}, got {position_mode!r}")
        if position_mode == "cache" and policy.evicts and rope_inv_freq is None:
            raise ValueError("position_mode 'cache' needs the model's RoPE inverse frequencies")
        self.capacity = capacity
        self.headroom = headroom
        self.policy = policy
        self.position_mode = position_mode
        self.rope_inv_freq = rope_inv_freq
        self.scoring_backend = scoring_backend
        self.staged: PromptPositions | None = None
        self.evict_after_prompt = False
        self.pack_after_prompt = False
        self.observing = True
        # The archive that copies what goes through the model (engine/archive.py), while `recording`; and, while
        # it is a dict, each layer's queries of the forward (a question's, to score the archive with).
        self.archive = None
        self.recording = False
        self.captured_queries: dict[int, Tensor] | None = None
        self.tokens_evicted = 0
        self.evictions = 0
        self.stack_layers = stack_layers
        # Storage of every layer by name, [layers, ...]: each layer holds a slice. A layer of another shape
        # (some models vary heads per layer) gets storage of its own and the layers are evicted one by one.
        self._storage: dict[str, Tensor] = {}
        self._uniform = True
        self._stacked: BoundedLayer | None = None  # one layer over the whole storage, rows layer by layer
        super().__init__(layers=[BoundedLayer(self, i) for i in range(num_layers)])

    @property
    def slots(self) -> int:
        return self.capacity + self.headroom

    # --- driven by the engine around each forward pass ------------------------------------------------
    def stage(self, positions: PromptPositions, *, evict: bool, pack: bool = True, observe: bool = True,
              record: bool = False) -> None:
        """Declare the next forward's tokens, whether eviction runs after it, whether positions may be
        re-packed then (not between the blocks of one frame, whose layout must stay whole), and whether the
        archive (if any) copies them."""
        if self.fill + len(positions) > self.slots:
            raise CacheOverflowError(
                f"{len(positions)} new tokens do not fit: {self.fill} cached, room for {self.slots}"
            )
        self.staged = positions
        self.evict_after_prompt = evict and self.policy.evicts
        self.pack_after_prompt = pack and self.position_mode == "cache"
        self.observing = observe
        self.recording = record and self.archive is not None

    @property
    def wants_scores(self) -> bool:
        """Whether the next attention must produce retrieval-window scores."""
        return self.observing and self.policy.needs_attention

    def after_attention(self, layer_idx: int, query: Tensor, key: Tensor, scaling: float,
                        scores: Tensor | None = None) -> None:
        """Called by the attention function once a layer has attended: score; after the last layer, maybe
        evict and re-pack. (Every layer already holds the new block while it attends, so waiting for the
        last one leaves the peak where it was.)"""
        if self.wants_scores:
            self.layers[layer_idx].observe(query, key, scaling, scores)
        if self.captured_queries is not None:
            self.captured_queries[layer_idx] = query[0].detach().clone()
        if layer_idx != len(self.layers) - 1 or not (self.evict_after_prompt or self.pack_after_prompt):
            return
        stacked = self._all_layers()
        if stacked is not None:
            self._evict_and_pack(stacked, self.layers)
        else:
            for layer in self.layers:
                self._evict_and_pack(layer, [layer])

    def _evict_and_pack(self, rows: "BoundedLayer", layers: list["BoundedLayer"]) -> None:
        """Evict and re-pack `rows`, the storage of `layers` (one layer, or all of them stacked)."""
        if self.evict_after_prompt and rows.fill > self.capacity:
            evicted = rows.evict(self.policy, self.capacity)
            if layers[0] is self.layers[0]:
                self.tokens_evicted += evicted
                self.evictions += 1
            for layer in layers:
                layer.fill, layer.window_queries, layer.window_start = rows.fill, 0, rows.window_start
        if self.pack_after_prompt and any(layer.frontier > layer.fill for layer in layers):
            end = rows.pack_positions(self.rope_inv_freq)
            if rows is not layers[0] and rows.fill:
                # Each layer's frontier: the largest position end among its own rows.
                ends = end.reshape(len(layers), -1).amax(-1)
                for i, layer in enumerate(layers):
                    layer.frontier = 0
                    layer.frontier_on_device = ends[i]

    def storage_for(self, index: int, device: torch.device):
        """A function giving layer `index` its zeroed storage of a name, shape and dtype: a slice of the
        layers' shared block, or its own where its shape differs from the first layer's."""
        def store(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
            shared = self._storage.get(name)
            if shared is None and self.stack_layers and self._uniform:
                shared = self._storage[name] = torch.zeros(len(self.layers), *shape, dtype=dtype, device=device)
            if shared is not None and shared.shape[1:] == shape and shared.dtype == dtype and shared.device == device:
                return shared[index]
            self._uniform = False
            return torch.zeros(*shape, dtype=dtype, device=device)
        return store

    def _all_layers(self) -> "BoundedLayer | None":
        """One layer object whose rows are every layer-head (layer by layer), or None where the layers do
        not share their storage. Its counters are the layers' (the same in every layer)."""
        if not (self.stack_layers and self._uniform and all(layer.is_initialized for layer in self.layers)):
            return None
        if self._stacked is None:
            def rows(name: str) -> Tensor:  # [layers, heads, slots] -> [layers * heads, slots]
                return self._storage[name].flatten(0, 1)

            def kv(name: str) -> Tensor:  # [layers, 1, heads, slots, dim] -> [1, layers * heads, slots, dim]
                return self._storage[name].transpose(0, 1).flatten(1, 2)

            first = self.layers[0]
            stacked = BoundedLayer(self, -1)
            stacked.dtype, stacked.device = first.dtype, first.device
            stacked.keys, stacked.values = kv("keys"), kv("values")
            stacked.key_origin = None if first.key_origin is None else kv("key_origin")
            stacked.pos_origin = None if first.pos_origin is None else rows("pos_origin")
            for name in ("pos_start", "pos_end", "seq", "frame", "pinned", "window_attention"):
                setattr(stacked, name, rows(name))
            stacked.stats = {name: rows(f"stat.{name}") for name in first.stats}
            stacked.is_initialized = True
            self._stacked = stacked
        stacked, first = self._stacked, self.layers[0]
        stacked.fill, stacked.window_queries = first.fill, first.window_queries
        stacked.window_start = first.window_start
        stacked.may_hold_pins = any(layer.may_hold_pins for layer in self.layers)
        stacked.may_hold_frames = any(layer.may_hold_frames for layer in self.layers)
        return stacked

    # --- retrieval ---------------------------------------------------------------------------------------
    def splice(self, keys: Tensor, values: Tensor, start: Tensor, end: Tensor, seq: Tensor, frame: Tensor) -> None:
        """Append archived tokens after the held ones, in every layer and head, without a forward: keys
        [layers, heads, n, dk] already rotated to the positions `start` [n] (with `end`, `seq`, `frame`, [n]).
        They are not window queries and count for no policy statistic; `truncate` takes them away again."""
        n = keys.shape[2]
        if self.fill + n > self.slots:
            raise CacheOverflowError(f"{n} retrieved tokens do not fit: {self.fill} cached, room for {self.slots}")
        with torch.inference_mode():
            for i, layer in enumerate(self.layers):
                if not layer.is_initialized:
                    raise RuntimeError("nothing to splice into: the cache holds no tokens yet")
                a, b = layer.fill, layer.fill + n
                layer.keys[0, :, a:b] = keys[i].to(layer.device, layer.dtype)
                layer.values[0, :, a:b] = values[i].to(layer.device, layer.dtype)
                if layer.key_origin is not None:
                    layer.key_origin[0, :, a:b] = layer.keys[0, :, a:b]
                    layer.pos_origin[:, a:b] = start.to(layer.device)
                for name, value in (("pos_start", start), ("pos_end", end), ("seq", seq), ("frame", frame)):
                    getattr(layer, name)[:, a:b] = value.to(layer.device)
                layer.pinned[:, a:b] = False
                layer.window_attention[:, a:b] = 0
                for stat in layer.stats.values():
                    stat[:, a:b] = 0
                layer.fill = b
                layer.frontier = max(layer.frontier, int(end.max()))

    def holds(self, first: Tensor, end: Tensor) -> Tensor:
        """[blocks] bool: whether every layer-head holds every stream index in [first, end) of each block."""
        held = torch.ones(first.shape, dtype=torch.bool)
        stacked = self._all_layers()
        for layer in [stacked] if stacked is not None else self.layers:
            if not layer.is_initialized or layer.fill == 0:
                return torch.zeros(first.shape, dtype=torch.bool)
            seq = layer.seq[:, : layer.fill].contiguous()  # stream order within each row
            rows = seq.shape[0]
            lo = torch.searchsorted(seq, first.to(seq.device)[None].expand(rows, -1).contiguous())
            hi = torch.searchsorted(seq, end.to(seq.device)[None].expand(rows, -1).contiguous())
            held &= ((hi - lo) == (end - first).to(seq.device)).all(0).cpu()
        return held

    # --- state -----------------------------------------------------------------------------------------
    @property
    def fill(self) -> int:
        return self.layers[0].fill

    @property
    def next_position(self) -> int:
        """The position the next token gets: one past every position in use."""
        return max(layer.frontier for layer in self.layers)

    def read_frontiers(self) -> None:
        """Bring every layer's frontier left on the device by a re-pack to the host in one read."""
        waiting = [layer for layer in self.layers if layer.frontier_on_device is not None]
        if waiting:
            values = torch.stack([layer.frontier_on_device for layer in waiting]).tolist()
            for layer, value in zip(waiting, values):
                layer.frontier = value

    def truncate(self, fill: int, frontier: int) -> None:
        """Drop tokens appended after a snapshot of (fill, next_position) taken with no eviction since."""
        for layer in self.layers:
            if layer.fill < fill:
                raise ValueError(f"cannot truncate to {fill}: layer holds {layer.fill}")
            layer.fill = fill
            layer.frontier = min(layer.frontier, frontier)

    def pinned_held(self) -> int:
        """Tokens of pinned texts held in every layer and head (the fewest any layer-head holds)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers or not all(layer.may_hold_pins for layer in layers):
            return 0  # known on the host: no wait for a GPU after every input
        # One read for every layer, not one per layer.
        return int(torch.stack([layer.pinned[:, : layer.fill].sum(-1).min() for layer in layers]).min())

    def kv_nbytes(self) -> int:
        return sum(layer.kv_nbytes() for layer in self.layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def storage_pointers(self) -> list[int]:
        """Data pointers of every layer's key and value storage (they must never change)."""
        return [t.data_ptr() for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values)]

    def cached_seq(self, layer_idx: int = 0) -> Tensor:
        """Stream indices of the tokens held by one layer: [heads, fill]."""
        layer = self.layers[layer_idx]
        return layer.seq[:, : layer.fill]

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.tokens_evicted = 0
        self.evictions = 0

    def export_state(self) -> dict[str, Tensor]:
        """Every layer's slots and the cache's counters, as named tensors (see `import_state`)."""
        state = {"cache.counters": torch.tensor([self.tokens_evicted, self.evictions], dtype=torch.long)}
        for i, layer in enumerate(self.layers):
            state.update({f"layer.{i}.{name}": t.cpu() for name, t in layer.export_state().items()})
        return state

    def import_state(self, state: dict[str, Tensor], *, dtype: torch.dtype, device: torch.device) -> None:
        """Replace the whole memory with a saved one; on an error the cache is left empty."""
        # The storage is made inside the model's forward (inference mode): write it the same way.
        with torch.inference_mode():
            self._import_state(state, dtype=dtype, device=device)

    def _import_state(self, state: dict[str, Tensor], *, dtype: torch.dtype, device: torch.device) -> None:
        try:
            for i, layer in enumerate(self.layers):
                prefix = f"layer.{i}."
                layer.import_state({k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix)},
                                   dtype=dtype, device=device)
            if any(k.startswith(f"layer.{len(self.layers)}.") for k in state):
                raise ValueError("saved memory has more layers than this model")
            self.tokens_evicted, self.evictions = (int(v) for v in state["cache.counters"])
        except Exception:
            self.reset()
            raise
