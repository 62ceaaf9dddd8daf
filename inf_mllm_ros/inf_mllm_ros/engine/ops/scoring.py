"""Retrieval-window scores: how much attention each cached key receives from a new prompt.

The cache evicts after each block it takes (up to chunk_size tokens). The block's queries (the retrieval
window) attend causally over the old cache plus the block itself; summing each key's attention over the
window gives the score that decides which keys stay. This module computes that sum, either with a
blocked PyTorch path (CPU or CUDA) or with a Triton kernel that never builds the attention matrix, or,
where no fused attention exists (CPU), together with the attention output from one softmax
(`attention_with_window_scores`).
"""

from __future__ import annotations

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "triton")


def visible_counts(n_past: int, q: int, device=None) -> Tensor:
    """How many window queries see each key: q for cached keys, q - i for the i-th window key.

    Dividing window scores by these counts gives the per-query average the eviction ranks by.
    """
    cached = torch.full((n_past,), float(q), dtype=torch.float32, device=device)
    window = torch.arange(q, 0, -1, dtype=torch.float32, device=device)
    return torch.cat([cached, window])


def window_scores(
    query: Tensor,
    key: Tensor,
    n_past: int,
    scaling: float,
    *,
    backend: str = "auto",
    block_size: int = 64,
) -> Tensor:
    """Attention each key receives from the retrieval window's queries, summed over the window.

    query: [num_heads, q, head_dim]  (one sequence; the q newest tokens are the retrieval window;
           RoPE already applied)
    key:   [num_kv_heads, n_past + q, head_dim]  (cached keys followed by the window's own keys)
    Grouped-query attention: query head h belongs to kv head h // (num_heads // num_kv_heads).
    Causal: window query t (0..q-1) sees keys 0..n_past+t.
    Returns float32 [num_kv_heads, n_past + q]: for each kv head and key j, the sum over the query
    heads of its group and over the window queries t that see j of softmax_j(scaling * q_t . k_j).
    """
    _check_shapes(query, key, n_past)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if backend == "auto":
        backend = "triton" if query.is_cuda and _triton_available() else "torch"
    if backend == "triton":
        from . import triton_scoring

        if not triton_scoring.available():
            raise RuntimeError("backend='triton' requested but triton cannot be imported")
        return triton_scoring.window_scores_triton(query, key, n_past, scaling)
    return window_scores_torch(query, key, n_past, scaling, block_size=block_size)


def window_scores_torch(
    query: Tensor, key: Tensor, n_past: int, scaling: float, *, block_size: int = 64
) -> Tensor:
    """Blocked PyTorch path: memory O(num_heads * block_size * keys), float32 throughout."""
    num_heads, q, head_dim = query.shape
    num_kv, n_keys, _ = key.shape
    group = num_heads // num_kv
    # Upcast once: logits in bf16/fp16 would lose the small probabilities that decide eviction.
    k = key.to(torch.float32).transpose(1, 2)  # [kv, d, keys]
    # Scaling the queries once is cheaper than scaling every logit.
    q_all = (query.to(torch.float32) * scaling).reshape(num_kv, group, q, head_dim)
    # Window query t sees keys 0..n_past+t: cached keys are visible to all, only the window's own keys
    # need the causal mask.
    causal = torch.ones(q, q, dtype=torch.bool, device=key.device).triu_(1)
    scores = torch.zeros(num_kv, n_keys, dtype=torch.float32, device=key.device)
    for start in range(0, q, block_size):
        stop = min(start + block_size, q)
        rows = group * (stop - start)
        # One batched matmul per kv head (a broadcast matmul would copy the keys for every group).
        logits = torch.bmm(q_all[:, :, start:stop].reshape(num_kv, rows, head_dim), k)
        logits = logits.view(num_kv, group, stop - start, n_keys)
        logits[..., n_past:].masked_fill_(causal[start:stop], float("-inf"))
        scores += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
    return scores


def attention_with_window_scores(
    query: Tensor, key: Tensor, value: Tensor, n_past: int, scaling: float, *, block_size: int = 128
) -> tuple[Tensor, Tensor]:
    """Causal attention output [num_heads, q, head_dim] and the window scores, from one softmax.

    Where no fused kernel exists (CPU), computing the probabilities once for both the output and the
    eviction scores saves the second QK^T pass that `window_scores` would add to every prompt.
    """
    _check_shapes(query, key, n_past)
    num_heads, q, head_dim = query.shape
    num_kv, n_keys, _ = key.shape
    group = num_heads // num_kv
    k = key.transpose(1, 2)
    q_all = (query * scaling).reshape(num_kv, group, q, head_dim)
    causal = torch.ones(q, q, dtype=torch.bool, device=key.device).triu_(1)
    scores = torch.zeros(num_kv, n_keys, dtype=torch.float32, device=key.device)
    output = torch.empty(num_kv, group, q, value.shape[-1], dtype=value.dtype, device=value.device)
    for start in range(0, q, block_size):
        stop = min(start + block_size, q)
        rows = group * (stop - start)
        logits = torch.bmm(q_all[:, :, start:stop].reshape(num_kv, rows, head_dim), k).float()
        logits = logits.view(num_kv, group, stop - start, n_keys)
        logits[..., n_past:].masked_fill_(causal[start:stop], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        scores += probs.sum(dim=(1, 2))
        out = torch.bmm(probs.to(value.dtype).view(num_kv, rows, n_keys), value)
        output[:, :, start:stop] = out.view(num_kv, group, stop - start, -1)
    return output.view(num_heads, q, -1), scores


def _check_shapes(query: Tensor, key: Tensor, n_past: int) -> None:
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query and key must be 3-D, got {tuple(query.shape)}, {tuple(key.shape)}")
    num_heads, q, head_dim = query.shape
    num_kv, n_keys, key_dim = key.shape
    if head_dim != key_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, key {key_dim}")
    if num_kv < 1 or num_heads % num_kv != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv}")
    if n_past < 0 or q < 1 or n_keys != n_past + q:
        raise ValueError(f"key length {n_keys} must equal n_past {n_past} + q {q} (q >= 1)")
    if query.device != key.device:
        raise ValueError(f"query on {query.device}, key on {key.device}")


def _triton_available() -> bool:
    from . import triton_scoring

    return triton_scoring.available()
