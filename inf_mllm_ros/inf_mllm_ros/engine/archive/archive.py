"""A second memory: the stream's KV, archived in host memory and retrieved when a question comes.

The bounded cache keeps what attention chose; a fact nobody attends to again is gone once it leaves the
recent window. The archive keeps a copy of every block of the stream (text and frames alike, keys and
values as the model produced them) in host memory, up to `size` tokens, dropping the oldest blocks past
that. When a question comes, its own queries score the archived blocks, and the best ones, up to a token
budget, are placed between the cache and the question for that answer only (`BoundedKVCache.splice`).

Blocks. A prompt is cut into blocks of at most `block_tokens` tokens along its turns (engine/archive/archive_blocks.py);
a camera frame is one block, whatever its size, so that its 2-D layout comes back whole.

Positions. Each block's keys are kept rotated as if the block began at position 0 (its tokens' positions
relative to its first; a frame keeps its M-RoPE layout), so that a block can be placed at any position by
one uniform rotation, and every block is scored alike, wherever it came from.

Scoring (`index`, engine/archive/retrieval_index.py). The queries of the question's own words are compared with the
archived keys on the model's retrieval heads (engine/archive/retrieval_heads.py), less half the score of a
reference question about nothing in particular; one selection serves every layer, so that the placed
blocks are whole turns at one set of positions. The scoring heads' keys are copied, as they are archived, to
an index on the model's device.

Recording from a GPU copies each forward's keys and values to pinned host memory without waiting for them; the
prompt's end waits once, before it cuts them into blocks.

Host bytes per archived token: layers x KV heads x (key dim + value dim) x the cache's element size,
plus 20 bytes of bookkeeping (two positions, the block index and the token).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .archive_blocks import clip_turns, cut_turns
from ..persistence.archive_log import new_memory_id
from ..poses import POSE_FIELDS, Pose
from .retrieval_index import RetrievalIndex
from ..ops.rotary import shift_rotary

# Bookkeeping per archived token: relative position start and end (int32 each), its block's index (int64) and
# its token (int32).
BOOKKEEPING_BYTES = 20

@dataclass
class ArchivedBlock:
    """One contiguous run of the stream, held in the archive's slots [slot, slot + length)."""

    index: int  # increasing with stream order, never reused
    slot: int
    length: int
    first_seq: int  # stream index of its first token
    extent: int  # positions it spans (one past its largest relative position)
    frame: bool
    stamp: float | None  # the input's stream time, where it had one
    message: int = -1  # shared by the pieces of one long message (retrieved with it), else the block's own
    pose: Pose | None = None  # where the robot was at the input's stamp, where known
    camera: str = ""  # the camera a frame came from, where the robot has several

    @property
    def seq_end(self) -> int:
        return self.first_seq + self.length


@dataclass(frozen=True)
class Turn:
    """One message of a prompt, as the archive's blocks keep it: its token count, stream time (None: unstamped),
    where the robot was then and, for a frame of a named camera, which."""

    length: int
    stamp: float | None = None
    pose: Pose | None = None
    camera: str = ""


# A camera's name as the archive saves it: UTF-8, zero-padded to this many bytes (the node's names are ROS name
# tokens, and the engine's rule bounds their length: engine/text_rules.py, `checked_camera`).
CAMERA_NAME_BYTES = 32


def camera_codes(names: list[str]) -> Tensor:
    """[len(names), CAMERA_NAME_BYTES] uint8: the names as saved."""
    out = torch.zeros((len(names), CAMERA_NAME_BYTES), dtype=torch.uint8)
    for i, name in enumerate(names):
        raw = name.encode()[:CAMERA_NAME_BYTES]
        out[i, : len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return out


def camera_names(codes: Tensor) -> list[str]:
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in codes.tolist()]


@dataclass
class _Pending:
    """What a prompt has put through the model so far, per forward, waiting to be cut into blocks."""

    keys: list[Tensor]  # [layers, heads, q, dk] each, on the host
    values: list[Tensor]
    start: list[Tensor]  # [q] int64 each: the positions the keys were rotated with
    end: list[Tensor]
    first_seq: int


class ForwardRecording:
    """One forward's keys and values, layer by layer, as the cache's layers took them: what the stream hands the
    forward in its plan (engine/memory/forward_plan.py, a `LayerRecorder`) and gives the archive once it is complete."""

    def __init__(self, num_layers: int):
        self.layers: list[tuple[Tensor, Tensor] | None] = [None] * num_layers

    def take(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """One layer's new keys and values ([1, heads, q, dim], rotated as the cache received them)."""
        self.layers[layer] = (keys[0], values[0])


class KVArchive:
    """Host-memory archive of the stream's KV blocks, bounded to `size` tokens.

    The stream hands each recorded forward a `ForwardRecording` (`recording`), which the cache's layers fill
    with their new keys and values; the stream then closes the forward (`end_forward`) and each prompt
    (`end_prompt`), which cuts what came into blocks.
    """

    def __init__(self, size: int, block_tokens: int, rope_inv_freq: Tensor | None):
        if size < 0:
            raise ValueError(f"archive size must be >= 0 tokens, got {size}")
        if block_tokens < 1:
            raise ValueError(f"archive block must be >= 1 token, got {block_tokens}")
        self.size = size
        self.block_tokens = block_tokens
        self.inv_freq = None if rope_inv_freq is None else rope_inv_freq.detach().to("cpu", torch.float32)
        self.blocks: deque[ArchivedBlock] = deque()
        self._next_index = 0
        self._next_message = 0
        self._head = 0  # next free slot
        self.keys: Tensor | None = None  # [layers, heads, size, dk]
        self.values: Tensor | None = None
        self.pos_start: Tensor | None = None  # [size] int32, relative to the block's first position
        self.pos_end: Tensor | None = None
        self.block_of: Tensor | None = None  # [size] int64: the index of the block a slot belongs to
        self.token_ids: Tensor | None = None  # [size] int32: each slot's token (-1: a frame's), to quote a block
        self._pending: _Pending | None = None
        self._copied: torch.cuda.Event | None = None  # the recording's last copy from a GPU
        self.blocks_dropped = 0
        # The scoring heads' keys on the model's device, made at the memory's first retrieval (`build_index`).
        self.index: RetrievalIndex | None = None
        # Names this memory's blocks on disk (engine/persistence/archive_log.py): new with each new memory (a reset).
        self.memory_id = new_memory_id()

    @property
    def enabled(self) -> bool:
        return self.size > 0 and self.inv_freq is not None

    # --- recording -----------------------------------------------------------------------------------
    def recording(self, num_layers: int) -> "ForwardRecording | None":
        """A new copy of one forward's keys and values for the archive (None where it keeps nothing)."""
        return ForwardRecording(num_layers) if self.enabled else None

    def end_forward(self, recording: "ForwardRecording", start: Tensor, end: Tensor, first_seq: int) -> None:
        """The forward that filled `recording` is complete: move its keys and values to the host."""
        layers = recording.layers
        if not layers or any(entry is None for entry in layers):
            return  # nothing was recorded (or a forward failed part-way)
        shapes = {(k.shape, v.shape) for k, v in layers}
        if len(shapes) != 1:
            return  # layers of differing shapes are not archived (no model here has them)
        if self._pending is None:
            self._pending = _Pending([], [], [], [], first_seq)
        p = self._pending
        p.keys.append(self._to_host(torch.stack([k for k, _ in layers])))
        p.values.append(self._to_host(torch.stack([v for _, v in layers])))
        p.start.append(self._to_host(start))
        p.end.append(self._to_host(end))

    def _to_host(self, tensor: Tensor) -> Tensor:
        """A host copy of a forward's tensor; from a GPU into pinned memory, not waited for (`_host_copies_done`)."""
        if not tensor.is_cuda:
            return tensor.to("cpu")
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return host

    def _host_copies_done(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def discard_pending(self) -> None:
        self._pending = None

    def end_prompt(self, *, frame: bool, turns: list[Turn], token_ids: Tensor | None = None) -> None:
        """Cut what the prompt put through the model into blocks and archive them. `turns`: each message in it,
        so that blocks follow messages; tokens recorded before them (a kept answer's, generated one by one) are a
        turn of their own. `token_ids`: the prompt's (text)."""
        pending, self._pending = self._pending, None
        self._host_copies_done()
        if pending is None or not self.enabled:
            return
        keys, values = torch.cat(pending.keys, dim=2), torch.cat(pending.values, dim=2)
        start, end = torch.cat(pending.start), torch.cat(pending.end)
        total = keys.shape[2]
        lengths = [turn.length for turn in turns]
        ids = torch.full((total,), -1, dtype=torch.int32)
        if token_ids is not None:
            known = token_ids.reshape(-1)[-total:] if sum(lengths) < total else token_ids.reshape(-1)[:total]
            ids[total - len(known) :] = known.to("cpu", torch.int32)
        if sum(lengths) < total:
            turns, lengths = [Turn(total - sum(lengths))] + list(turns), [total - sum(lengths)] + lengths
        elif sum(lengths) > total:  # the prompt went in only part-way (a stop): it ends where it stopped
            lengths = clip_turns(lengths, total)
        pieces = [(total, -1)] if frame else cut_turns(lengths, self.block_tokens)
        turn_starts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
        offset, own = 0, len(lengths)
        for length, piece_of in pieces:
            sl = slice(offset, offset + length)
            turn = int((turn_starts <= offset).sum()) - 1  # the message the block begins in
            if piece_of < 0:  # whole messages (or a frame): a message of its own
                piece_of, own = own, own + 1
            self._add(keys[:, :, sl], values[:, :, sl], start[sl], end[sl], pending.first_seq + offset, frame,
                      turns[turn], self._next_message + piece_of, ids[sl])
            offset += length
        self._next_message += own

    def _add(self, keys: Tensor, values: Tensor, start: Tensor, end: Tensor, first_seq: int, frame: bool,
             turn: Turn, message: int, token_ids: Tensor) -> None:
        n = keys.shape[2]
        if n > self.size:
            return  # a block larger than the whole archive is not kept
        if self.keys is None or self.keys.shape[:2] != keys.shape[:2] or self.keys.dtype != keys.dtype:
            self._allocate(keys, values)
        if frame:
            base = int(start.min())
            rel_start, rel_end = start - base, end - base
        else:
            # Text is 1-D and contiguous: its tokens sit at 0..n-1 wherever the re-packs had put them.
            rel_start = torch.arange(n, dtype=torch.long)
            rel_end = rel_start + 1
        # Rotate every key from the position it was given to its place in the block.
        flat = keys.flatten(0, 1)  # [layers * heads, n, dk]
        delta = (rel_start - start)[None].expand(flat.shape[0], -1)
        flat = shift_rotary(flat, delta, self.inv_freq)
        slot = self._make_room(n)
        self.keys[:, :, slot : slot + n] = flat.view_as(keys)
        self.values[:, :, slot : slot + n] = values
        self.pos_start[slot : slot + n] = rel_start.to(torch.int32)
        self.pos_end[slot : slot + n] = rel_end.to(torch.int32)
        block = ArchivedBlock(self._next_index, slot, n, first_seq, int(rel_end.max()), frame, turn.stamp, message,
                              turn.pose, turn.camera)
        self.block_of[slot : slot + n] = block.index
        self.token_ids[slot : slot + n] = token_ids
        self._next_index += 1
        self._head = slot + n
        self.blocks.append(block)
        if self.index is not None:
            self.index.write(slot, self.keys[:, :, slot : slot + n])

    def _allocate(self, keys: Tensor, values: Tensor) -> None:
        """Storage for `size` tokens (pages are touched as they fill, so host memory grows up to the bound)."""
        layers, heads = keys.shape[:2]
        self.keys = torch.empty(layers, heads, self.size, keys.shape[-1], dtype=keys.dtype)
        self.values = torch.empty(layers, heads, self.size, values.shape[-1], dtype=values.dtype)
        self.pos_start = torch.zeros(self.size, dtype=torch.int32)
        self.pos_end = torch.zeros(self.size, dtype=torch.int32)
        self.block_of = torch.full((self.size,), -1, dtype=torch.long)
        self.token_ids = torch.full((self.size,), -1, dtype=torch.int32)
        self.blocks.clear()
        self._head = 0
        self.index = None

    def _make_room(self, n: int) -> int:
        """The slot where `n` tokens go next, after dropping the blocks there: the oldest ones, as writing goes
        round. A block never wraps: one that does not fit before the end starts again at slot 0, and the
        tail it leaves goes with the blocks in it."""
        wrap = self._head + n > self.size
        slot = 0 if wrap else self._head
        while self.blocks:
            oldest = self.blocks[0]
            in_tail = wrap and oldest.slot >= self._head
            if not (in_tail or (oldest.slot < slot + n and slot < oldest.slot + oldest.length)):
                break
            self.blocks.popleft()
            self.block_of[oldest.slot : oldest.slot + oldest.length] = -1
            self.blocks_dropped += 1
        return slot

    # --- size ---------------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return sum(b.length for b in self.blocks)

    def nbytes(self) -> int:
        """Host bytes the archive's storage takes once full (what it is allocated for)."""
        if self.keys is None:
            return 0
        return (self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
                + self.size * BOOKKEEPING_BYTES)

    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        layers, heads = self.keys.shape[:2]
        return (layers * heads * (self.keys.shape[-1] * self.keys.element_size()
                                  + self.values.shape[-1] * self.values.element_size()) + BOOKKEEPING_BYTES)

    def reset(self) -> None:
        self.blocks.clear()
        self._head = 0
        self.index = None  # its reference question was asked of the memory now gone
        self.memory_id = new_memory_id()
        self.discard_pending()
        if self.block_of is not None:
            self.block_of.fill_(-1)

    def resize(self, size: int) -> None:
        """A new bound in tokens: the newest blocks that fit are kept (0 turns the archive off)."""
        if size < 0:
            raise ValueError(f"archive size must be >= 0 tokens, got {size}")
        if size == self.size:
            return
        kept = []
        room = size
        for block in reversed(self.blocks):
            if block.length > room:
                break
            kept.append(block)
            room -= block.length
        old = (self.keys, self.values, self.pos_start, self.pos_end, self.token_ids)
        self.size = size
        self.keys = None
        self.index = None
        self.blocks.clear()
        self._head = 0
        if size == 0 or old[0] is None:
            self.values = self.pos_start = self.pos_end = self.block_of = self.token_ids = None
            return
        for block in reversed(kept):
            sl = slice(block.slot, block.slot + block.length)
            self._place(block, old[0][:, :, sl], old[1][:, :, sl], old[2][sl], old[3][sl], old[4][sl])

    def _place(self, block: ArchivedBlock, keys: Tensor, values: Tensor, rel_start: Tensor, rel_end: Tensor,
               token_ids: Tensor | None = None) -> None:
        """Put an already rotated block at the head (resize and restore)."""
        if self.keys is None:
            self._allocate(keys, values)
        n = block.length
        slot = self._make_room(n)
        self.keys[:, :, slot : slot + n] = keys
        self.values[:, :, slot : slot + n] = values
        self.pos_start[slot : slot + n] = rel_start
        self.pos_end[slot : slot + n] = rel_end
        self.token_ids[slot : slot + n] = -1 if token_ids is None else token_ids
        block.slot = slot
        self.block_of[slot : slot + n] = block.index
        self._next_index = max(self._next_index, block.index + 1)
        self._head = slot + n
        self.blocks.append(block)
        if self.index is not None:
            self.index.write(slot, keys)

    # --- saved state ---------------------------------------------------------------------------------------
    def export_state(self, newer_than: int = -1) -> dict[str, Tensor]:
        """The held blocks (those of index above `newer_than`), oldest first, as named tensors (empty: none)."""
        blocks = [b for b in self.blocks if b.index > newer_than]
        if not blocks:
            return {}
        slots = torch.cat([torch.arange(b.slot, b.slot + b.length) for b in blocks])
        return {
            "archive.keys": self.keys.index_select(2, slots),
            "archive.values": self.values.index_select(2, slots),
            "archive.pos_start": self.pos_start[slots],
            "archive.pos_end": self.pos_end[slots],
            # index, length, first stream index, extent, frame, message; and the stream time (NaN: none)
            "archive.blocks": torch.tensor([[b.index, b.length, b.first_seq, b.extent, int(b.frame), b.message]
                                            for b in blocks], dtype=torch.long),
            "archive.stamps": torch.tensor([math.nan if b.stamp is None else b.stamp for b in blocks],
                                           dtype=torch.float64),
            "archive.poses": torch.tensor([[math.nan] * POSE_FIELDS if b.pose is None else b.pose.as_tuple()
                                           for b in blocks], dtype=torch.float64),
            "archive.token_ids": self.token_ids[slots],
            "archive.cameras": camera_codes([b.camera for b in blocks]),
        }

    def import_state(self, state: dict[str, Tensor], *, dtype: torch.dtype, memory_id: str | None = None) -> None:
        """Replace the held blocks with saved ones (the newest that fit this archive's size); a memory saved
        without an archive leaves it empty. ValueError where the saved blocks do not add up. `memory_id`: the saved
        memory's, which names its blocks on disk (None: a new one)."""
        self.reset()
        if memory_id is not None:
            self.memory_id = memory_id
        if "archive.blocks" not in state or not self.enabled:
            return
        blocks, stamps = state["archive.blocks"], state["archive.stamps"]
        keys, values = state["archive.keys"].to(dtype), state["archive.values"].to(dtype)
        lengths = blocks[:, 1]
        total = int(lengths.sum())
        if blocks.dim() != 2 or blocks.shape[1] != 6 or total != keys.shape[2] or total != values.shape[2] \
                or stamps.shape[0] != blocks.shape[0] or state["archive.pos_start"].shape[0] != total:
            raise ValueError("saved archive blocks do not match their tensors")
        if self.keys is not None and (self.keys.shape[:2] != keys.shape[:2] or self.keys.shape[-1] != keys.shape[-1]):
            raise ValueError(f"saved archive keys {tuple(keys.shape)} do not fit this model's")
        starts = (lengths.cumsum(0) - lengths).tolist()
        # The newest blocks that fit, placed oldest first.
        first, room = len(starts), self.size
        while first > 0 and int(lengths[first - 1]) <= room:
            first -= 1
            room -= int(lengths[first])
        poses = state.get("archive.poses", torch.full((len(blocks), POSE_FIELDS), math.nan)).tolist()
        token_ids = state.get("archive.token_ids")
        # A memory saved before frames named their camera: none is named.
        cameras = camera_names(state["archive.cameras"]) if "archive.cameras" in state else [""] * len(blocks)
        for row, start, stamp, pose, camera in zip(blocks[first:].tolist(), starts[first:], stamps[first:].tolist(),
                                                   poses[first:], cameras[first:]):
            index, length, first_seq, extent, frame, message = row
            sl = slice(start, start + length)
            stamp = None if math.isnan(stamp) else stamp
            pose = None if math.isnan(pose[0]) else Pose(*pose)
            block = ArchivedBlock(index, 0, length, first_seq, extent, bool(frame), stamp, message, pose, camera)
            self._next_message = max(self._next_message, message + 1)
            self._place(block, keys[:, :, sl], values[:, :, sl], state["archive.pos_start"][sl],
                        state["archive.pos_end"][sl], None if token_ids is None else token_ids[sl])

    # --- retrieval -----------------------------------------------------------------------------------
    def build_index(self, heads: Tensor, reference: tuple[Tensor, Tensor] | None, device: torch.device | str) -> None:
        """An index of the scoring `heads` ([layers, query heads] bool) on `device`, with the `reference`
        question's queries and positions (None: none is taken off), over every block held."""
        if self.keys is None:
            raise ValueError("nothing archived to index")
        index = RetrievalIndex(heads, kv_heads=self.keys.shape[1], head_dim=self.keys.shape[-1], size=self.size,
                               block_tokens=self.block_tokens, inv_freq=self.inv_freq, device=device)
        if reference is not None:
            index.set_reference(*reference)
        for block in self.blocks:
            index.write(block.slot, self.keys[:, :, block.slot : block.slot + block.length])
        self.index = index

    def block_token_ids(self, block: ArchivedBlock) -> list[int]:
        """The block's tokens, where it is text (a frame's are -1)."""
        return self.token_ids[block.slot : block.slot + block.length].tolist()

    def append_copy(self, block: ArchivedBlock, first_seq: int) -> ArchivedBlock:
        """Write a held block again as the newest, its tokens numbered from `first_seq`: an archive of any size
        without streaming that many tokens (scoring costs the same whatever the blocks hold), for benchmarks."""
        k, v, s, e = self.block_tensors(block)
        copy = replace(block, index=self._next_index, slot=0, first_seq=first_seq,
                                   message=-1 - self._next_index)
        self._place(copy, k.clone(), v.clone(), s.int(), e.int())
        return copy

    def block_tensors(self, block: ArchivedBlock) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A block's keys and values ([layers, heads, n, dim], rotated as if it began at position 0) and its
        tokens' relative position starts and ends ([n])."""
        sl = slice(block.slot, block.slot + block.length)
        return (self.keys[:, :, sl], self.values[:, :, sl], self.pos_start[sl].long(), self.pos_end[sl].long())
