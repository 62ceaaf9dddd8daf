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

The slots of one layer are a `BoundedLayer` (engine/memory/cache_layer.py); the RoPE arithmetic of a re-pack
is in engine/ops/rotary.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from .cache_layer import BoundedLayer, LayerSpec
from .forward_plan import ForwardPlan, PromptPositions
from .policies import EvictionPolicy

POSITION_MODES = ("cache", "original")
# The most one temporary tensor of a gather or a re-pack may take: with every layer evicted in one pass, a
# rotation of every key at once would briefly hold several float32 copies of the whole cache.
TEMPORARY_BYTES = 4 << 20


__all__ = ["BoundedKVCache", "CacheOverflowError", "ForwardPlan", "PromptPositions", "POSITION_MODES"]


class CacheOverflowError(RuntimeError):
    """More tokens were pushed than the storage can hold before the next eviction."""


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
        # The forward under way (engine/memory/forward_plan.py): staged before it, given to each layer with its tokens.
        self._plan: ForwardPlan | None = None
        self.tokens_evicted = 0
        self.evictions = 0
        self.stack_layers = stack_layers
        # Storage of every layer by name, [layers, ...]: each layer holds a slice. A layer of another shape
        # (some models vary heads per layer) gets storage of its own and the layers are evicted one by one.
        self._storage: dict[str, Tensor] = {}
        self._uniform = True
        self._stacked: BoundedLayer | None = None  # one layer over the whole storage, rows layer by layer
        spec = LayerSpec(slots=self.slots, room=capacity if policy.evicts else self.slots,
                         slot_stats=tuple(policy.slot_stats), rerotates=position_mode == "cache",
                         scoring_backend=scoring_backend)
        self.layer_spec = spec
        super().__init__(layers=[BoundedLayer(i, spec, self.storage_for(i)) for i in range(num_layers)])

    @property
    def slots(self) -> int:
        return self.capacity + self.headroom

    @property
    def temporary_bytes(self) -> int:
        """The most one temporary tensor of a gather or a re-pack may take (this module's TEMPORARY_BYTES,
        read when asked)."""
        return TEMPORARY_BYTES

    # --- driven by the engine around each forward pass ------------------------------------------------
    def stage(self, plan: ForwardPlan) -> None:
        """Take the plan of the next forward (its tokens' positions; whether eviction runs after it, whether
        positions may be re-packed then, whether the retrieval window is kept, what is recorded and captured)."""
        if self.fill + len(plan) > self.slots:
            raise CacheOverflowError(f"{len(plan)} new tokens do not fit: {self.fill} cached, room for {self.slots}")
        self.read_frontiers()  # once for every layer, not once per layer as each takes the tokens
        self._plan = replace(plan, evict=plan.evict and self.policy.evicts,
                             pack=plan.pack and self.position_mode == "cache")

    def unstage(self) -> None:
        """The forward is over (or failed): nothing of its plan is kept."""
        self._plan = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """transformers' call as a layer's new keys and values come: they go to that layer with the forward's plan."""
        if self._plan is None:
            raise RuntimeError("positions of the incoming tokens were not staged on the cache")
        return self.layers[layer_idx].append(key_states, value_states, self._plan)

    @property
    def wants_scores(self) -> bool:
        """Whether the staged forward's attention must produce retrieval-window scores."""
        return self._plan is not None and self._plan.observe and self.policy.needs_attention

    def after_attention(self, layer_idx: int, query: Tensor, key: Tensor, scaling: float,
                        scores: Tensor | None = None) -> None:
        """Called by the attention function once a layer has attended: score, capture its queries if the plan
        asks; after the last layer, maybe evict and re-pack. (Every layer already holds the new block while it
        attends, so waiting for the last one leaves the peak where it was.)"""
        if self.wants_scores:
            self.layers[layer_idx].observe(query, key, scaling, scores)
        if self._plan.capture is not None:
            self._plan.capture[layer_idx] = query[0].detach().clone()
        if layer_idx == len(self.layers) - 1:
            self.end_forward()

    def end_forward(self) -> None:
        """Every layer has attended to the staged tokens: evict and re-pack, if the plan asks for it."""
        plan = self._plan
        if not (plan.evict or plan.pack):
            return
        stacked = self.stacked_layers()
        if stacked is not None:
            self._evict_and_pack(plan, stacked, self.layers)
        else:
            for layer in self.layers:
                self._evict_and_pack(plan, layer, [layer])

    def _evict_and_pack(self, plan: ForwardPlan, rows: BoundedLayer, layers: list[BoundedLayer]) -> None:
        """Evict and re-pack `rows`, the storage of `layers` (one layer, or all of them stacked)."""
        temporary_bytes = self.temporary_bytes
        if plan.evict and rows.fill > self.capacity:
            evicted = rows.evict(self.policy, self.capacity, plan.positions.seq_end, temporary_bytes)
            if layers[0] is self.layers[0]:
                self.tokens_evicted += evicted
                self.evictions += 1
            for layer in layers:
                layer.evicted_to(rows.fill)
        if plan.pack and any(layer.frontier > layer.fill for layer in layers):
            end = rows.pack_positions(self.rope_inv_freq, temporary_bytes)
            if rows is not layers[0] and rows.fill:
                # Each layer's frontier: the largest position end among its own rows.
                ends = end.reshape(len(layers), -1).amax(-1)
                for i, layer in enumerate(layers):
                    layer.frontier_left_on_device(ends[i])

    def storage_for(self, index: int):
        """A function giving layer `index` its zeroed storage of a name, shape and dtype on a device: a slice of
        the layers' shared block, or its own where its shape differs from the first layer's."""
        def store(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
            shared = self._storage.get(name)
            if shared is None and self.stack_layers and self._uniform:
                shared = self._storage[name] = torch.zeros(len(self.layers), *shape, dtype=dtype, device=device)
            if shared is not None and shared.shape[1:] == shape and shared.dtype == dtype and shared.device == device:
                return shared[index]
            self._uniform = False
            return torch.zeros(*shape, dtype=dtype, device=device)
        return store

    def stacked_layers(self) -> "BoundedLayer | None":
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
            names = ("pos_start", "pos_end", "seq", "frame", "pinned", "window_attention")
            tensors = {"keys": kv("keys"), "values": kv("values"),
                       "key_origin": None if first.key_origin is None else kv("key_origin"),
                       "pos_origin": None if first.pos_origin is None else rows("pos_origin"),
                       **{name: rows(name) for name in names},
                       **{f"stat.{name}": rows(f"stat.{name}") for name in first.stats}}
            self._stacked = BoundedLayer.over(self.layer_spec, first, tensors)
        self._stacked.follow(self.layers)
        return self._stacked

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
                layer.place(keys[i], values[i], start, end, seq, frame)

    def tail(self, first: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Keys and values [layers, heads, n, dk] of the slots from `first` to the fill, with their start positions
        and stream indices [n]: tokens put after the held ones for one answer (alike in every layer and head, as
        nothing has been evicted among them)."""
        layers = self.layers
        keys = torch.stack([layer.keys[0, :, first : layer.fill] for layer in layers])
        values = torch.stack([layer.values[0, :, first : layer.fill] for layer in layers])
        head = layers[0]
        return keys, values, head.pos_start[0, first : head.fill].clone(), head.seq[0, first : head.fill].clone()

    def holds(self, first: Tensor, end: Tensor) -> Tensor:
        """[blocks] bool: whether every layer-head holds every stream index in [first, end) of each block."""
        held = torch.ones(first.shape, dtype=torch.bool)
        stacked = self.stacked_layers()
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
        self.read_frontiers()
        return max(layer.frontier for layer in self.layers)

    def read_frontiers(self) -> None:
        """Bring every layer's frontier left on the device by a re-pack to the host in one read."""
        waiting = [layer for layer in self.layers if layer.frontier_on_device is not None]
        if waiting:
            values = torch.stack([layer.frontier_on_device for layer in waiting]).tolist()
            for layer, value in zip(waiting, values):
                layer.frontier = value  # the setter forgets the tensor on the device

    def frontiers(self) -> list[int]:
        """Every layer's next free position (they differ where re-packs closed different gaps)."""
        self.read_frontiers()
        return [layer.frontier for layer in self.layers]

    def truncate(self, fill: int, frontier: int | list[int]) -> None:
        """Drop tokens appended after a snapshot of (fill, frontier) taken with no eviction since: `frontier`, the
        `frontiers()` of the snapshot (each layer back to its own), or one position for every layer."""
        frontiers = frontier if isinstance(frontier, list) else [frontier] * len(self.layers)
        self.read_frontiers()
        for layer, before in zip(self.layers, frontiers):
            layer.truncate(fill, before)

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
