"""The attention function that lets the bounded cache see each layer's queries.

transformers calls the registered attention function with the layer's RoPE-rotated queries and the
keys the cache returned, and with the keyword arguments given to the decoder's forward. The engine gives
the decoder its cache as `bounded_cache=` (`ModelAdapter.forward`): the function attends (SDPA; on CPU,
when the cache wants scores, one softmax that also gives them), then hands the queries and keys to that
cache, which scores the retrieval window and, after the last layer, evicts. Without the argument (a vision
tower, the static decode step of engine/memory/decode_step.py) it is plain SDPA: an explicit argument rather than
a lookup of state elsewhere, so that a compiled step traces through it without a graph break.

The static ingest step (engine/memory/ingest_step.py) gives `window_scores_into=(into, valid)` instead: attention
over all the cache's slots with the given mask, from one softmax that also adds the attention the valid
(not padding) queries pay to each slot into `into[layer]` ([layers, kv heads, slots]): the retrieval
window's scores, as the cache's own path computes them, on fixed shapes. A batch of several streams' blocks
(engine/memory/batched_ingest.py) gives the same with a batch dimension, and `queries_into={}` where a question's
queries are wanted: each layer's queries land there by layer index.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .scoring import attention_with_window_scores

ATTENTION_NAME = "inf_mllm"
CACHE_ARGUMENT = "bounded_cache"
SCORES_ARGUMENT = "window_scores_into"
QUERIES_ARGUMENT = "queries_into"


def bounded_cache_attention(module, query, key, value, attention_mask, **kwargs):
    cache = kwargs.pop(CACHE_ARGUMENT, None)
    scores_into = kwargs.pop(SCORES_ARGUMENT, None)
    queries_into = kwargs.pop(QUERIES_ARGUMENT, None)
    layer_idx = getattr(module, "layer_idx", None)
    if queries_into is not None and layer_idx is not None:
        queries_into[layer_idx] = query.detach().clone()
    if scores_into is not None and layer_idx is not None:
        into, valid = scores_into
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return masked_attention_with_scores(query, key, value, attention_mask, valid, scaling, into[layer_idx])
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


def masked_attention_with_scores(query, key, value, mask, valid, scaling, scores):
    """Attention of query [b, heads, q, d] over key and value [b, kv heads, slots, d] under a boolean mask
    [b, 1, q, slots] (True: visible); the probabilities that the `valid` queries ([q] bool, or [b, q] for a batch of
    streams' blocks) pay each slot, summed over the queries and the heads of each kv head's group, are added to
    `scores` ([kv heads, slots] float32; [b, kv heads, slots] for a batch)."""
    b, heads, q, dim = query.shape
    kv, slots = key.shape[1], key.shape[2]
    group = heads // kv
    logits = torch.matmul((query * scaling).reshape(b, kv, group * q, dim), key.transpose(2, 3)).float()
    logits = logits.view(b, kv, group, q, slots).masked_fill_(~mask[:, :, None], float("-inf"))  # its own tensor
    probs = torch.softmax(logits, dim=-1)
    scores.add_((probs * valid.view(-1, 1, 1, q, 1)).sum(dim=(2, 3)).view_as(scores))
    output = torch.matmul(probs.to(value.dtype).view(b, kv, group * q, slots), value)
    return output.view(b, heads, q, -1).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, bounded_cache_attention)
# Without a matching mask function transformers would silently pass no mask at all.
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
