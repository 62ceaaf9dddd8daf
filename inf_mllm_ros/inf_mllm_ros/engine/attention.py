"""The attention function that lets the bounded cache see each layer's queries.

transformers calls the registered attention function with the layer's RoPE-rotated queries and the
keys the cache returned, and with the keyword arguments given to the decoder's forward. The engine gives
the decoder its cache as `bounded_cache=` (`ModelAdapter.forward`): the function attends (SDPA; on CPU,
when the cache wants scores, one softmax that also gives them), then hands the queries and keys to that
cache, which scores the retrieval window and, after the last layer, evicts. Without the argument (a vision
tower, the static decode step of engine/decode_step.py) it is plain SDPA: an explicit argument rather than
a lookup of state elsewhere, so that a compiled step traces through it without a graph break.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .scoring import attention_with_window_scores

ATTENTION_NAME = "inf_mllm"
CACHE_ARGUMENT = "bounded_cache"


def bounded_cache_attention(module, query, key, value, attention_mask, **kwargs):
    cache = kwargs.pop(CACHE_ARGUMENT, None)
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None:
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
