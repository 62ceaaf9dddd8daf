"""RoPE arithmetic on keys already in a cache: moving a rotated key to another position, and closing the
gaps that evicted tokens leave in the positions of the survivors.

RoPE rotates each key by its position, so a key can be moved from position p to p + d by rotating it
by d alone (`shift_rotary`): the bounded cache (engine/memory/cache_layer.py) does so when it re-packs
positions after an eviction, and the archive (engine/archive/archive.py) when it stores keys at their place in
a block and when it sets a question's queries where they read a block. Which positions the survivors
of an eviction get is `packed_positions`.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
