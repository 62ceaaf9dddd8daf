"""How a prompt is cut into the archive's blocks (engine/archive/archive.py), along its turns.

A short message is a block of its own (or shares one with its short neighbours), a long one is cut into
near-equal pieces of at most the archive's block size. (A camera frame is one block whatever its size;
the archive does not cut it.)
"""

from __future__ import annotations


def clip_turns(turns: list[int], total: int) -> list[int]:
    """The turns cut at `total` tokens."""
    out, left = [], total
    for t in turns:
        if left <= 0:
            break
        out.append(min(t, left))
        left -= t
    if left > 0:
        out.append(left)
    return out


def cut_turns(turns: list[int], block: int) -> list[tuple[int, int]]:
    """Blocks along the turns, as (length, the turn it is a piece of, or -1 for whole turns): a long turn in
    near-equal pieces of at most `block`, short whole turns merged with their neighbours while the merged
    block stays within `block`."""
    pieces: list[tuple[int, int]] = []
    for i, t in enumerate(turns):
        if t <= block:
            pieces.append((t, -1))
        else:
            parts = -(-t // block)
            base, extra = divmod(t, parts)
            pieces.extend((base + (k < extra), i) for k in range(parts))
    out: list[tuple[int, int]] = []
    for length, piece_of in pieces:
        if piece_of < 0 and out and out[-1][1] < 0 and out[-1][0] + length <= block:
            out[-1] = (out[-1][0] + length, -1)
        else:
            out.append((length, piece_of))
    return out
