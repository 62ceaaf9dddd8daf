"""The archive's blocks on disk: append-only segment files beside the memory file.

Archived blocks never change once written, so a checkpoint appends only the blocks archived since the last one
and then replaces the memory file (the cache and the list of blocks held: small) atomically
(engine/persistence/memory_file.py).
The memory file names the log it continues (`memory_id`), its segments and how far each is committed; bytes past
a committed length (an append a crash cut short) are never read and are cut off by the next append.

A segment holds records: a header (magic, payload length, sha256 of the payload) and a payload with the blocks'
tensors in safetensors form, laid out as `KVArchive.export_state` lays them out. The payload is packed losslessly:
its bytes are split by their place in an element of the keys' width and the top bytes (sign and exponent, which
vary little across a layer's keys and values) compressed, the rest stored as they are; this writes about 15 %
fewer bytes in float32 and 30 % fewer in bfloat16 for a few milliseconds a megabyte (records of the older,
unpacked kind are still read). A new segment starts once the last one
holds SEGMENT_BYTES; a segment whose blocks have all left the archive is no longer named by the memory file and
is deleted once the memory file that drops it is in place. So the files hold at most the archive's bound plus
one segment, and nothing is ever rewritten.

Reading stops at the first record that is cut short, damaged or missing: the blocks before it are loaded, the
rest counted as lost (the cache and every other part of the memory do not depend on them).
"""

from __future__ import annotations

import hashlib
import os
import struct
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SEGMENT_BYTES = 64 << 20
RECORD = struct.Struct("<4sQ32s")  # magic, payload length, sha256 of the payload
MAGIC = b"IMAB"  # a record whose payload is the safetensors bytes as they are
PACKED = b"IMAZ"  # a record whose payload is packed (pack_payload)
PACKING = struct.Struct("<QBQ")  # the payload's length, the element width, the compressed top bytes' length
SUFFIX = ".blocks"


def pack_payload(payload: bytes, width: int) -> bytes:
    """`payload` split into `width`-byte elements; every element's top byte compressed, the others kept as they are."""
    if width < 2:
        return PACKING.pack(len(payload), 1, 0) + payload
    padded = np.frombuffer(payload + bytes(-len(payload) % width), np.uint8).reshape(-1, width)
    top = zlib.compress(padded[:, -1].tobytes(), 1)
    return PACKING.pack(len(payload), width, len(top)) + top + padded[:, :-1].tobytes()


def unpack_payload(packed: bytes) -> bytes:
    """The payload pack_payload packed; ValueError where the bytes are not one of its packings."""
    if len(packed) < PACKING.size:
        raise ValueError("packed payload cut short")
    size, width, top_size = PACKING.unpack_from(packed)
    body = memoryview(packed)[PACKING.size :]
    if width < 2:
        return bytes(body)
    try:
        top = zlib.decompress(body[:top_size])
    except zlib.error as exc:
        raise ValueError(f"packed payload damaged: {exc}") from exc
    rest = np.frombuffer(body[top_size:], np.uint8)
    if len(top) * (width - 1) != rest.size or len(top) * width < size:
        raise ValueError("packed payload of the wrong size")
    padded = np.empty((len(top), width), np.uint8)
    padded[:, -1] = np.frombuffer(top, np.uint8)
    padded[:, :-1] = rest.reshape(-1, width - 1)
    return padded.tobytes()[:size]


def new_memory_id() -> str:
    return uuid.uuid4().hex


def folder_for(memory_file: Path) -> Path:
    """Where a memory file's segments live."""
    return memory_file.with_name(memory_file.name + ".archive")


@dataclass
class Segment:
    """One segment file of a log, as the memory file names it."""

    name: str
    length: int  # bytes committed
    last_block: int  # the largest block index in it

    def to_list(self) -> list:
        return [self.name, self.length, self.last_block]


@dataclass
class ArchiveLog:
    """A memory's segments, as the memory file names them."""

    memory_id: str
    segments: list[Segment] = field(default_factory=list)

    @property
    def last_block(self) -> int:
        return max((s.last_block for s in self.segments), default=-1)

    def describe(self) -> dict:
        return {"memory_id": self.memory_id, "segments": [s.to_list() for s in self.segments]}

    @classmethod
    def from_description(cls, description: dict) -> ArchiveLog:
        return cls(str(description["memory_id"]), [Segment(str(n), int(length), int(last))
                                                   for n, length, last in description["segments"]])

    def append(self, folder: Path, state: dict[str, torch.Tensor]) -> int:
        """Append the blocks of `state` (KVArchive.export_state's layout) as one record, flushed to disk; the bytes
        written. The memory file that commits it is the caller's to write."""
        payload = pack_payload(st_save({k: v.contiguous() for k, v in state.items()}),
                               state["archive.keys"].element_size())
        record = RECORD.pack(PACKED, len(payload), hashlib.sha256(payload).digest()) + payload
        if not self.segments or self.segments[-1].length >= SEGMENT_BYTES:
            number = int(self.segments[-1].name[len(self.memory_id) + 1 : -len(SUFFIX)]) + 1 if self.segments else 0
            self.segments.append(Segment(f"{self.memory_id}-{number:06d}{SUFFIX}", 0, -1))
        segment = self.segments[-1]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / segment.name
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.truncate(segment.length)  # what an append cut short by a crash left
            f.seek(segment.length)
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        if segment.length == 0:
            fsync_dir(folder)
        segment.length += len(record)
        segment.last_block = max(segment.last_block, int(state["archive.blocks"][:, 0].max()))
        return len(record)

    def retire(self, oldest_held: int | None) -> None:
        """Stop naming the segments whose blocks have all left the archive (all of them when none is held)."""
        self.segments = [s for s in self.segments if oldest_held is not None and s.last_block >= oldest_held]

    def remove_unnamed(self, folder: Path) -> None:
        """Delete segment files this log does not name (retired, or left by a crashed writer)."""
        named = {s.name for s in self.segments}
        for path in folder.glob(f"*{SUFFIX}") if folder.is_dir() else []:
            if path.name not in named:
                path.unlink(missing_ok=True)

    def read(self, folder: Path) -> tuple[list[dict[str, torch.Tensor]], bool]:
        """Every complete record's blocks, oldest first, up to the first record that is missing, cut short or
        damaged; and whether one was."""
        records = []
        for segment in self.segments:
            try:
                with open(folder / segment.name, "rb") as f:
                    data = f.read(segment.length)
            except OSError:
                return records, True
            offset = 0
            while offset < segment.length:
                if offset + RECORD.size > len(data):
                    return records, True
                magic, size, digest = RECORD.unpack_from(data, offset)
                payload = data[offset + RECORD.size : offset + RECORD.size + size]
                if magic not in (MAGIC, PACKED) or len(payload) != size or hashlib.sha256(payload).digest() != digest:
                    return records, True
                try:
                    records.append(st_load(unpack_payload(payload) if magic == PACKED else payload))
                except Exception:
                    return records, True
                offset += RECORD.size + size
        return records, False


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot flush a folder
    finally:
        os.close(fd)
