"""One decoder layer's storage in the bounded KV cache (engine/memory/cache.py): keys, values, the positions
they were rotated with, and the per-slot bookkeeping an eviction policy ranks them by.

A `BoundedLayer` appends each prompt's tokens after the slots it holds, keeps the attention they are
paid while the retrieval window lasts (`observe`), and at an eviction gathers the slots a policy
chose to the front (`evict`) and re-packs their positions, re-rotating the keys (`pack_positions`).
Its storage is a slice of what the cache shares among layers of one shape; the cache also builds one
`BoundedLayer` over every layer's rows at once, so that one pass evicts the whole model. Temporaries
of a gather or a re-pack are bounded by the cache's `temporary_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from .forward_plan import ForwardPlan, PromptPositions
from .policies import EvictionPolicy, SlotView
from ..ops.rotary import packed_positions, shift_rotary
from ..ops.scoring import window_scores

# Gives a layer its zeroed storage of a name, shape and dtype on a device: a slice of what the cache shares among
# layers of one shape, or storage of the layer's own (BoundedKVCache.storage_for).
LayerStorage = Callable[[str, tuple, torch.dtype, torch.device], Tensor]


@dataclass(frozen=True)
class LayerSpec:
    """What every layer of one cache is made with, given to each at its making."""

    slots: int  # capacity + headroom
    room: int  # the most slots a saved layer may hold: the capacity, or every slot for a cache that never evicts
    slot_stats: tuple[str, ...]  # the eviction policy's per-slot statistics
    rerotates: bool  # positions are re-packed ("cache" mode), so keys are rotated again at each re-pack
    scoring_backend: str  # how the retrieval window's scores are computed (engine/ops/scoring.py)


class BoundedLayer(CacheLayerMixin):
    """One decoder layer's slots: keys, values, positions and attention statistics.

    index: its place among the cache's layers. spec: what it shares with the other layers. storage: where its
    tensors come from (None: a view over storage made elsewhere, see `over`). Each forward's tokens come with
    the forward's plan (`append`); nothing else is read from outside.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, index: int, spec: LayerSpec, storage: LayerStorage | None):
        super().__init__()
        self.index = index
        self.spec = spec
        self._storage = storage
        self.fill = 0
        # Queries scored since the last eviction (the retrieval window), each seeing every older slot: a
        # count on the host, so that the policy's average needs no per-slot tally on the device.
        self.window_queries = 0
        self.window_start = 0  # first slot appended since the last eviction
        self._frontier = 0  # next free position after the tokens this layer has seen
        self.frontier_on_device: Tensor | None = None  # the same, once a re-pack left it on the device
        # Whether a pinned token, or a frame's, came in since the layer was last empty: known on the host, so
        # a policy need not ask the device (on a GPU every question makes the host wait).
        self.may_hold_pins = False
        self.may_hold_frames = False

    @property
    def frontier(self) -> int:
        if self.frontier_on_device is not None:  # the cache reads every layer's at once before a forward
            self.frontier = int(self.frontier_on_device)
        return self._frontier

    @frontier.setter
    def frontier(self, value: int) -> None:
        self._frontier, self.frontier_on_device = value, None

    # --- storage -----------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        slots, device = self.spec.slots, key_states.device
        self.dtype, self.device = key_states.dtype, device

        def store(name: str, shape: tuple, dtype: torch.dtype) -> Tensor:
            return self._storage(name, shape, dtype, device)

        self.keys = store("keys", (1, heads, slots, head_dim), key_states.dtype)
        self.values = store("values", (1, heads, slots, value_states.shape[-1]), value_states.dtype)
        # In half precision every re-pack would round the re-rotated keys again, and long-lived keys (the
        # saddles) are re-packed most. Keeping each key as the model rotated it, with that position, lets
        # every re-pack rotate from the original: one rounding, however often a key moves.
        exact = key_states.dtype == torch.float32 or not self.spec.rerotates
        self.key_origin = None if exact else store("key_origin", self.keys.shape, key_states.dtype)
        self.pos_start = store("pos_start", (heads, slots), torch.long)
        self.pos_end = store("pos_end", (heads, slots), torch.long)
        self.pos_origin = None if exact else store("pos_origin", (heads, slots), torch.long)
        self.seq = store("seq", (heads, slots), torch.long)
        self.frame = store("frame", (heads, slots), torch.bool)
        self.pinned = store("pinned", (heads, slots), torch.bool)
        self.window_attention = store("window_attention", (heads, slots), torch.float32)
        self.window_start = 0
        self.stats = {name: store(f"stat.{name}", (heads, slots), torch.float32) for name in self.spec.slot_stats}
        self.is_initialized = True

    @classmethod
    def over(cls, spec: LayerSpec, like: "BoundedLayer", tensors: dict[str, Tensor | None]) -> "BoundedLayer":
        """A layer whose tensors are the given views (every layer-head of a cache at once, engine/memory/cache.py), of
        `like`'s dtype and device: `tensors` by the names `lazy_initialization` gives them ("stat.NAME" for a
        statistic)."""
        layer = cls(-1, spec, None)
        layer.dtype, layer.device = like.dtype, like.device
        for name in ("keys", "values", "key_origin", "pos_start", "pos_end", "pos_origin", "seq", "frame", "pinned",
                     "window_attention"):
            setattr(layer, name, tensors[name])
        layer.stats = {name: tensors[f"stat.{name}"] for name in spec.slot_stats}
        layer.is_initialized = True
        return layer

    def follow(self, layers: list["BoundedLayer"]) -> None:
        """Take the counters of the layers this one views (they are the same in every layer)."""
        first = layers[0]
        self.fill, self.window_queries, self.window_start = first.fill, first.window_queries, first.window_start
        self.may_hold_pins = any(layer.may_hold_pins for layer in layers)
        self.may_hold_frames = any(layer.may_hold_frames for layer in layers)

    @property
    def num_heads(self) -> int:
        return self.keys.shape[1]

    def slot_tensors(self) -> list[Tensor]:
        """Every per-slot tensor that moves with the slots at an eviction ([heads, slots])."""
        tensors = [self.pos_start, self.pos_end, self.seq, self.frame, self.pinned, self.window_attention,
                   *self.stats.values()]
        return tensors if self.pos_origin is None else tensors + [self.pos_origin]

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, *self.slot_tensors()]
        if self.key_origin is not None:
            tensors.append(self.key_origin)
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # --- tokens in ----------------------------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("a bounded layer takes tokens with the forward's plan: BoundedKVCache.update")

    def append(self, key_states: Tensor, value_states: Tensor, plan: ForwardPlan) -> tuple[Tensor, Tensor]:
        """Write the forward's new keys and values after the held slots, with the plan's positions; the plan's
        recorder (if any) gets a copy. Returns every held key and value, the new ones included."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.fill + q
        if key_states.shape[0] != 1:
            raise ValueError("the bounded cache holds one stream: batch size must be 1")
        self.keys[:, :, self.fill : end] = key_states
        self.values[:, :, self.fill : end] = value_states
        if plan.recorder is not None:
            plan.recorder.take(self.index, key_states, value_states)
        positions = plan.positions
        if len(positions) != q:
            raise RuntimeError(f"{q} incoming tokens, but the forward's plan places {len(positions)}")
        self.pos_start[:, self.fill : end] = positions.start
        self.pos_end[:, self.fill : end] = positions.end
        self.seq[:, self.fill : end] = positions.seq
        self.frame[:, self.fill : end] = positions.frame
        self.pinned[:, self.fill : end] = positions.pinned
        if self.key_origin is not None:
            self.key_origin[:, :, self.fill : end] = key_states
            self.pos_origin[:, self.fill : end] = positions.start
        self.window_attention[:, self.fill : end] = 0
        for stat in self.stats.values():
            stat[:, self.fill : end] = 0
        self.took(q, positions, scored=False)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def took(self, n: int, positions: PromptPositions, *, scored: bool) -> None:
        """Count `n` tokens written after the held slots (here, or by the static ingest step straight into the
        storage), with their positions; `scored`: their queries were added to the retrieval window."""
        self.fill += n
        if scored:
            self.window_queries += n
        self.frontier = max(self.frontier, positions.last_end)
        self.may_hold_pins |= positions.pinned is not False
        self.may_hold_frames |= positions.frame

    def place(self, keys: Tensor, values: Tensor, start: Tensor, end: Tensor, seq: Tensor, frame: Tensor) -> None:
        """Append tokens made elsewhere (archived ones, re-rotated to `start`), without a forward: keys
        [heads, n, dk]. They are not window queries and count for no policy statistic."""
        if not self.is_initialized:
            raise RuntimeError("nothing to splice into: the cache holds no tokens yet")
        a, b = self.fill, self.fill + keys.shape[1]
        self.keys[0, :, a:b] = keys.to(self.device, self.dtype)
        self.values[0, :, a:b] = values.to(self.device, self.dtype)
        if self.key_origin is not None:
            self.key_origin[0, :, a:b] = self.keys[0, :, a:b]
            self.pos_origin[:, a:b] = start.to(self.device)
        for name, value in (("pos_start", start), ("pos_end", end), ("seq", seq), ("frame", frame)):
            getattr(self, name)[:, a:b] = value.to(self.device)
        self.pinned[:, a:b] = False
        self.window_attention[:, a:b] = 0
        for stat in self.stats.values():
            stat[:, a:b] = 0
        self.fill = b
        self.frontier = max(self.frontier, int(end.max()))

    def truncate(self, fill: int, frontier: int) -> None:
        """Drop the tokens after `fill`, appended with no eviction since (back to the frontier they came after)."""
        if self.fill < fill:
            raise ValueError(f"cannot truncate to {fill}: layer holds {self.fill}")
        self.fill = fill
        self.frontier = min(self.frontier, frontier)

    # --- transformers cache protocol -----------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.fill

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The physical layout is [kept slots | new tokens]: a plain causal mask over it is right.
        return self.fill + query_length, 0

    def get_max_length(self) -> int:
        return self.spec.slots

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
        room = self.spec.room
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
            scores = window_scores(query[0], key[0], n_past, scaling, backend=self.spec.scoring_backend)
        self.window_attention[:, : self.fill].add_(scores)
        self.window_queries += q

    def evict(self, policy: EvictionPolicy, keep: int, stream_end: int, temporary_bytes: int) -> int:
        """Keep `keep` slots chosen by the policy, the stream's clock at `stream_end` (one past its newest token);
        returns how many tokens were evicted. Temporaries of the gather take at most `temporary_bytes` each."""
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
            stream_end=stream_end,
            stats={name: stat[:, :n] for name, stat in self.stats.items()},
        )
        idx = policy.select(view, keep)
        self._gather(idx, temporary_bytes)
        # The retrieval window ends with the eviction it drove.
        self.window_attention[:, :keep] = 0
        self.evicted_to(keep)
        return n - keep

    def evicted_to(self, keep: int) -> None:
        """The slots were gathered to the first `keep` (here, or by a layer viewing this one's storage): the
        retrieval window starts again after them."""
        self.fill = self.window_start = keep
        self.window_queries = 0

    def _gather(self, idx: Tensor, temporary_bytes: int) -> None:
        keep = idx.shape[-1]
        stores = (self.keys, self.values) if self.key_origin is None else (self.keys, self.values, self.key_origin)
        for store in stores:
            dim = store.shape[-1]
            for rows in self._row_blocks(keep * dim * store.element_size(), temporary_bytes):
                full = idx[rows, :, None].expand(-1, -1, dim)
                store[0, rows, :keep] = torch.gather(store[0, rows], 1, full)
        for meta in self.slot_tensors():
            meta[:, :keep] = torch.gather(meta, 1, idx)

    def pack_positions(self, inv_freq: Tensor, temporary_bytes: int) -> Tensor:
        """Close position gaps (cache mode) and rotate the keys to match, in blocks of rows whose temporaries
        take at most `temporary_bytes` each. Returns the slots' new ends."""
        n = self.fill
        start, end = packed_positions(self.pos_start[:, :n], self.pos_end[:, :n], self.seq[:, :n])
        # Rotated whether or not anything moved: a re-pack follows gaps, so something nearly always has, and
        # asking would make the host wait for a GPU.
        if self.key_origin is None:
            source, shift = self.keys, start - self.pos_start[:, :n]
        else:
            source, shift = self.key_origin, start - self.pos_origin[:, :n]
        for rows in self._row_blocks(n * self.keys.shape[-1] * 4, temporary_bytes):  # the rotation runs in float32
            self.keys[0, rows, :n] = shift_rotary(source[0, rows, :n], shift[rows], inv_freq)
        self.pos_start[:, :n] = start
        self.pos_end[:, :n] = end
        self.frontier_left_on_device(end.max() if n else None)
        return end

    def frontier_left_on_device(self, end: Tensor | None) -> None:
        """The next free position is now `end` (a 0-d tensor on the device, read with every layer's at once when
        next needed; None: the layer is empty)."""
        self.frontier = 0
        self.frontier_on_device = end

    def _row_blocks(self, bytes_per_row: int, temporary_bytes: int) -> list[slice]:
        """The rows (layer-heads) in blocks whose temporaries take at most `temporary_bytes` each: all at once for a
        small model, where launches dominate; a bounded peak for a large model and cache."""
        rows = self.keys.shape[1]
        step = max(1, temporary_bytes // max(bytes_per_row, 1))
        return [slice(first, min(first + step, rows)) for first in range(0, rows, step)]
