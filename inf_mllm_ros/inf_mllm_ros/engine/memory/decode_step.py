"""An answer's decoding as one fixed-shape step per token, over the bounded cache's own storage.

The eager way to decode (`KVStream._forward` for each token) stages positions on the host, attends over
the filled slots only (a shape that grows by one each token) and reads every token back to pick the next:
on a GPU, Python launching kernels and waiting for the device sets the pace (measured: docs/benchmarks.md,
GPU speed). For an answer that is not kept in memory none of the cache's
bookkeeping is needed (the answer's slots are taken away again, nothing is scored or evicted), so its
token step can be a pure function of fixed shapes, as in gpt-fast (pytorch-labs):

- the token's key and value are written at slot `slot` of every layer's storage (`index_copy_`), and
  attention runs over **all** the slots with a mask of the filled ones (`slot index <= slot`);
- the token, its slot and its position live on the device and advance there; the next token is chosen
  there (greedy);
- the host reads the tokens back every `sync_every` tokens, to see whether a stop token came, to report
  progress and to honour a cancel.

The step runs through the model's own decoder (the family's transformers classes), with a 4-D mask that
transformers takes as given and without the engine's `bounded_cache` argument, so attention is plain SDPA.
`compiled` puts it under `torch.compile(fullgraph=True, dynamic=False)` (on CUDA with
`mode="reduce-overhead"`: CUDA graphs); one graph serves every answer of the stream, since the storage
never moves and every changing value is a tensor. Tokens and logits are the eager path's (tests).
"""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from ..models.adapters import ModelAdapter
    from .cache import BoundedKVCache

from ..ops.few_rows import unpack_linears
from ..stream_config import STEP_MODES
# How often the host reads the tokens back: each read makes it wait for the device.
SYNC_EVERY = 8


def resolve_decode_step(setting: str, device: torch.device, name: str = "decode_step") -> str:
    """The step an answer decodes (or an input goes in) with: 'auto' compiles on CUDA and stays eager elsewhere
    (on a CPU, decoding is bound by reading the weights, and compiling buys nothing: docs/benchmarks.md)."""
    if setting not in STEP_MODES:
        raise ValueError(f"{name} must be one of {STEP_MODES}, got {setting!r}")
    if setting == "auto":
        return "compiled" if torch.device(device).type == "cuda" else "eager"
    return setting


# Graphs dynamo keeps of one function: each block size of the ingest step is one, and every memory made in a
# process (a model reloaded, a cache resized) adds its own; past dynamo's default of 8 a step could not be made.
RECOMPILE_LIMIT = 64


def compile_step(step: Callable, model: torch.nn.Module, device: torch.device, options: dict | None = None) -> Callable:
    """`step` (a pass through `model`) under torch.compile with fixed shapes and no graph break (fullgraph=True,
    dynamic=False), as CUDA graphs on CUDA (mode='reduce-overhead'); `options` override (tests pass a counting
    backend). On the CPU the model's linears go back to torch's own weights first (engine/ops/few_rows.py)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    defaults = {"fullgraph": True, "dynamic": False}
    if torch.device(device).type == "cuda":
        defaults["mode"] = "reduce-overhead"
    else:
        unpack_linears(model)
    return torch.compile(step, **{**defaults, **(options or {})})


class StorageLayer(CacheLayerMixin, ABC):
    """A layer's keys and values in storage a fixed-shape step writes into at given slots (`slot`, a device tensor
    the step advances), attention getting every slot: positions are given explicitly, nothing grows. Its kinds say
    which storage and how a step's tokens go in."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: Tensor, values: Tensor, slot: Tensor):
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return 0  # positions are given explicitly

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class SlotLayer(StorageLayer):
    """One layer's storage of the bounded cache, seen by a fixed-shape step: the new tokens' keys and values go to
    the slots in `slot` (one slot for a decode step, a padded block's for the ingest step of
    engine/memory/ingest_step.py)."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError("the static step writes into storage the bounded cache already holds")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values


class StaticDecoder:
    """Greedy decoding over a bounded cache's storage in fixed-shape steps (eager or compiled).

    mode: 'static' (the fixed-shape step, not compiled) or 'compiled'. compile_options: extra arguments of
    `torch.compile` (tests pass a counting backend); the defaults are fullgraph=True, dynamic=False and, on
    CUDA, mode='reduce-overhead'.
    """

    def __init__(self, adapter: ModelAdapter, cache: BoundedKVCache, mode: str = "static", *,
                 sync_every: int = SYNC_EVERY, compile_options: dict | None = None):
        if mode not in ("static", "compiled"):
            raise ValueError(f"StaticDecoder mode must be 'static' or 'compiled', got {mode!r}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.adapter, self.cache, self.mode, self.sync_every = adapter, cache, mode, sync_every
        self.compile_options = compile_options or {}
        self._bound_to: list[int] | None = None
        self._step: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    # --- the step ----------------------------------------------------------------------------------------
    def _bind(self) -> None:
        """Views of the cache's storage and the step's state tensors: made once, again only if the storage
        was made anew (it never is once allocated; a restored memory may allocate it)."""
        pointers = self.cache.storage_pointers()
        if pointers == self._bound_to:
            return
        layers = self.cache.layers
        if not layers or not all(layer.is_initialized for layer in layers):
            raise RuntimeError("nothing to decode over: the cache holds no tokens yet")
        device = layers[0].device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.slot_index = torch.arange(self.cache.slots, device=device)
        self.writer = Cache(layers=[SlotLayer(layer.keys, layer.values, self.slot) for layer in layers])
        if device.type == "cuda":
            # Fixed addresses, so that CUDA graphs replay over the live storage instead of copying it.
            for t in (self.token, self.slot, self.position, self.slot_index,
                      *(t for layer in layers for t in (layer.keys, layer.values))):
                torch._dynamo.mark_static_address(t)
        self._step = self._eager_step
        if self.mode == "compiled":
            self._step = compile_step(self._eager_step, self.adapter.model, device, self.compile_options)
        self._bound_to = pointers

    def _eager_step(self, token: Tensor, slot: Tensor, position: Tensor) -> Tensor:
        """One token through the decoder: written at `slot`, attending to slots 0..slot, at `position`; the
        greedy next token replaces `token`, and slot and position advance. Returns its logits [1, vocab]."""
        adapter = self.adapter
        embeds = adapter.model.get_input_embeddings()(token)
        position_ids = adapter.model_position_ids(adapter.text_position_ids(position), 0)
        mask = (self.slot_index <= slot)[None, None, None, :]
        logits = adapter.forward(embeds, position_ids, self.writer, attention_mask=mask)
        token.copy_(logits[-1].argmax(-1, keepdim=True))
        slot.add_(1)
        position.add_(1)
        return logits

    @property
    def ready(self) -> bool:
        """Bound to the cache's storage (and compiled, where compiled)."""
        return self._bound_to is not None

    def warm_up(self) -> None:
        """Bind (and compile) now, with one step into the slot after the cache's filled ones, which nothing reads
        before it is written again, so that the first answer does not wait for the compiler (a minute or so)."""
        if not 0 < self.cache.fill < self.cache.slots:
            return  # nothing to bind to yet, or no free slot to step into (a full cache that never evicts)
        self._bind()
        self.token.zero_()
        self.slot.fill_(self.cache.fill)
        self.position.fill_(self.cache.next_position)
        self.step()

    def start(self, logits: Tensor) -> None:
        """Begin an answer after the prompt whose last logits are given: the first token is chosen from them,
        and goes to the slot after the cache's filled ones, at the next position."""
        self._bind()
        self.token.copy_(logits[-1].argmax(-1, keepdim=True))
        self.slot.fill_(self.cache.fill)
        self.position.fill_(self.cache.next_position)

    def step(self) -> Tensor:
        """Feed the current token; returns its logits (the next token is chosen on the device)."""
        with torch.inference_mode():
            return self._step(self.token, self.slot, self.position)

    # --- an answer -----------------------------------------------------------------------------------------
    def generate(self, logits: Tensor, max_new: int, stop_ids: set[int],
                 on_read: Callable[[list[int]], None]) -> list[int]:
        """Greedy tokens after the prompt whose last `logits` are given, up to `max_new` or the first stop token
        (returned, not fed). `on_read` gets the tokens so far each time they are read back (every `sync_every`
        tokens and at the end); it may raise to end the answer (a stop or a cancel)."""
        if max_new < 1:
            return []
        if self.cache.fill + max_new - 1 > self.cache.slots:
            raise ValueError(f"{max_new} tokens do not fit after {self.cache.fill} cached in {self.cache.slots} slots")
        self.start(logits)
        chosen = torch.empty(max_new, dtype=torch.long, device=self.token.device)
        tokens: list[int] = []
        for i in range(max_new):
            chosen[i : i + 1].copy_(self.token)
            last = i == max_new - 1
            if last or (i + 1) % self.sync_every == 0:
                for token in chosen[len(tokens) : i + 1].tolist():
                    tokens.append(token)
                    if token in stop_ids:
                        break
                on_read(tokens)
                if tokens[-1] in stop_ids:
                    return tokens
            if not last:
                self.step()
        return tokens
