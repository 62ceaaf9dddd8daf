"""The attention function that lets the bounded cache see each layer's queries.

transformers calls the registered attention function with the layer's RoPE-rotated queries and the
keys the cache returned. It attends (SDPA; on CPU, when the cache wants scores, one softmax that also
gives them), then hands the queries and keys to the cache that is active on this thread, which scores the
retrieval window and, after the last layer, evicts. The cache is
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

from .scoring import attention_with_window_scores

ATTENTION_NAME = "inf_mllm"

_active = threading.local()


def bounded_cache_attention(module, query, key, value, attention_mask, **kwargs):
    cache = getattr(_active, "cache", None)
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None or module not in _active.modules:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    if cache.wants_scores and not query.is_cuda and query.shape[0] == 1:
        # On CPU one softmax serves both the output and the eviction scores. The cache's layout is
        # [kept slots | new tokens], so the mask is the plain causal one for the new tokens.
        n_past = key.shape[-2] - query.shape[-2]
        output, scores = attention_with_window_scores(query[0], key[0], value[0], n_past, scaling)
        cache.after_attention(layer_idx, query, key, scaling, scores=scores)
        return output.transpose(0, 1).unsqueeze(0).contiguous(), None
    output = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
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
