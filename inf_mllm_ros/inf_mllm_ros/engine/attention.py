"""The attention function that lets the bounded cache see each layer's queries.

transformers calls the registered attention function with the layer's RoPE-rotated queries and the
keys the cache returned. We run the normal SDPA attention, then hand the queries and keys to the
cache that is active on this thread, which scores the retrieval window and evicts. The cache is
found through a thread-local set only while the engine runs its language model, so other attention
modules (a vision tower) and other threads are untouched.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "inf_mllm"

_active = threading.local()


def bounded_cache_attention(module, query, key, value, attention_mask, **kwargs):
    output = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    cache = getattr(_active, "cache", None)
    layer_idx = getattr(module, "layer_idx", None)
    if cache is not None and layer_idx is not None and module in _active.modules:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        cache.after_attention(layer_idx, query, key, scaling)
    return output


AttentionInterface.register(ATTENTION_NAME, bounded_cache_attention)
# Without a matching mask function transformers would silently pass no mask at all.
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextmanager
def cache_observing(cache, modules) -> Iterator[None]:
    """Route the given attention modules' queries to `cache` for the duration of one forward."""
    _active.cache, _active.modules = cache, modules
    try:
        yield
    finally:
        _active.cache, _active.modules = None, ()
