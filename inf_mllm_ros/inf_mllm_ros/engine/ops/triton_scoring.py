"""Triton kernels for retrieval-window scores, without building the attention matrix.

Two passes, flash-attention style:
  1. per (query head, window query): the log-sum-exp of its visible logits, with an online
     max/sum over key blocks;
  2. per (kv head, key block): loop over the group's query heads and the window queries that can
     see the block, accumulating exp(logit - lse) into the block's column sums.
Logits are recomputed in pass 2, so the cost is about twice that of one attention forward,
and memory is O(num_heads * q) beyond the inputs.

Triton is optional: without it this module still imports and `available()` returns False.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton is absent on CPU-only installs and on some Jetson images.
    import triton
    import triton.language as tl

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    _IMPORT_ERROR = exc

_LOG2E = 1.4426950408889634


def available() -> bool:
    """True when triton imports (kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def interpreting() -> bool:
    """Whether triton runs its kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def import_error() -> Exception | None:
    """Why triton could not be imported, for error messages."""
    return _IMPORT_ERROR


if triton is not None:

    @triton.jit
    def _lse_kernel(
        q_ptr, k_ptr, lse_ptr,
        stride_qh, stride_qt, stride_qd,
        stride_kh, stride_kn, stride_kd,
        n_past, n_q, head_dim, group, qk_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):
        # One program per (query head, block of window queries); lse is in base 2.
        head = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        t_ok = t < n_q
        q = tl.load(
            q_ptr + head * stride_qh + t[:, None] * stride_qt + d[None, :] * stride_qd,
            mask=t_ok[:, None] & (d[None, :] < head_dim), other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        k_base = k_ptr + (head // group) * stride_kh
        last_visible = n_past + t  # window query t sees keys 0..n_past+t
        # Finite start so rows of padding queries (no visible key) stay NaN-free.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_end = n_past + tl.minimum(n_q, (tl.program_id(1) + 1) * BLOCK_M)
        for start in range(0, n_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            k = tl.load(
                k_base + n[:, None] * stride_kn + d[None, :] * stride_kd,
                mask=(n[:, None] < n_end) & (d[None, :] < head_dim), other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            visible = (n[None, :] <= last_visible[:, None]) & t_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
            m_i = m_new
        lse = m_i + tl.log2(tl.maximum(l_i, 1.0e-30))
        tl.store(lse_ptr + head * n_q + t, lse, mask=t_ok)

    @triton.jit
    def _colsum_kernel(
        q_ptr, k_ptr, lse_ptr, out_ptr,
        stride_qh, stride_qt, stride_qd,
        stride_kh, stride_kn, stride_kd,
        n_past, n_q, head_dim, group, qk_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):
        # One program per (kv head, key block): it owns its output slice, so no atomics.
        kv = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        n_keys = n_past + n_q
        n_ok = n < n_keys
        k = tl.load(
            k_ptr + kv * stride_kh + n[:, None] * stride_kn + d[None, :] * stride_kd,
            mask=n_ok[:, None] & (d[None, :] < head_dim), other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        k_t = tl.trans(k)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Queries before t_first see none of this block's keys: skip them.
        t_first = tl.maximum(tl.program_id(1) * BLOCK_N - n_past, 0)
        t_first = (t_first // BLOCK_M) * BLOCK_M
        for g in range(0, group):
            head = kv * group + g
            for t_start in range(t_first, n_q, BLOCK_M):
                t = t_start + tl.arange(0, BLOCK_M)
                t_ok = t < n_q
                q = tl.load(
                    q_ptr + head * stride_qh + t[:, None] * stride_qt + d[None, :] * stride_qd,
                    mask=t_ok[:, None] & (d[None, :] < head_dim), other=0.0,
                )
                if UPCAST:
                    q = q.to(tl.float32)
                lse = tl.load(lse_ptr + head * n_q + t, mask=t_ok, other=0.0)
                if IEEE:
                    s = tl.dot(q, k_t, input_precision="ieee")
                else:
                    s = tl.dot(q, k_t)
                s = s * qk_scale - lse[:, None]
                visible = (n[None, :] <= n_past + t[:, None]) & t_ok[:, None] & n_ok[None, :]
                # Mask before exp2 so hidden pairs cannot overflow.
                p = tl.exp2(tl.where(visible, s, float("-inf")))
                acc += tl.sum(p, axis=0)
        tl.store(out_ptr + kv * n_keys + n, acc, mask=n_ok)


def window_scores_triton(
    query: Tensor,
    key: Tensor,
    n_past: int,
    scaling: float,
    *,
    block_m: int | None = None,
    block_n: int = 64,
) -> Tensor:
    """Triton path of `scoring.window_scores`; same shapes and result (float32 [num_kv, keys]).

    block_m (window queries per tile) defaults to 16 for short windows (decode steps, tl.dot's
    minimum) and 64 for long ones (prefill chunks, 32 in fp32); block_n is the keys per tile.
    """
    if triton is None:
        raise RuntimeError(f"triton is not available: {_IMPORT_ERROR}")
    num_heads, n_q, head_dim = query.shape
    num_kv, n_keys, _ = key.shape
    group = num_heads // num_kv
    if block_m is None:
        # fp32 tiles of 64 queries x 128 dims nearly fill the 99 KiB of shared memory on sm_86/89.
        block_m = 16 if n_q <= 16 else (32 if query.element_size() == 4 else 64)
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
    # tl.dot needs K >= 16; pad the head dim to a power of two and mask the tail.
    block_d = max(16, triton.next_power_of_2(head_dim))
    # fp32 inputs would otherwise go through TF32 on Ampere+, a 1e-3 relative error in the logits.
    ieee = query.dtype == torch.float32
    # The CPU interpreter multiplies bf16 tiles as raw 16-bit integers; upcast them there.
    upcast = interpreting() and query.dtype == torch.bfloat16
    qk_scale = float(scaling) * _LOG2E
    lse = torch.empty(num_heads, n_q, dtype=torch.float32, device=query.device)
    out = torch.empty(num_kv, n_keys, dtype=torch.float32, device=query.device)
    common = dict(
        n_past=n_past, n_q=n_q, head_dim=head_dim, group=group, qk_scale=qk_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=ieee, UPCAST=upcast,
    )
    _lse_kernel[(num_heads, triton.cdiv(n_q, block_m))](
        query, key, lse, *query.stride(), *key.stride(), **common
    )
    _colsum_kernel[(num_kv, triton.cdiv(n_keys, block_n))](
        query, key, lse, out, *query.stride(), *key.stride(), **common
    )
    return out
