"""The memory on disk: a stream's whole state in a file, written atomically and checked before use, and the
archive's blocks in a log beside it that only grows by what is new (engine/persistence/archive_log.py).

The file is a safetensors file: named tensors (the cache's slots, and the indices of the archive's blocks held)
and a text header, data only (nothing in it is ever executed or unpickled). The header says what the file is
(`format`, `version`), which model made it (a fingerprint of its configuration and weights), the cache settings
it needs, the stream's clock and counters, the archive log it continues (its segments and how far each is
committed), and a sha256 over every tensor's bytes, that clock and that log. A checkpoint writes the blocks
archived since the last one and this file: its bytes are the new tokens' and the cache's, not the archive's.

Writing goes to a temporary file beside the target, which is flushed to disk and then renamed over
the target, and the folder is flushed too: a crash at any moment leaves either the previous file or
the new one, never a mixture; the log's segments are appended and flushed before the file that commits them.
Reading refuses, with a `MemoryFileError` whose `kind` says why, a file that is missing, cut short, corrupt, of
another format version, from another model or for other cache settings; a refused file is never half-loaded.
Archive blocks whose record in the log is missing or damaged are left out (`MemoryFileInfo.blocks_lost`), with
every block after them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..archive.archive import CAMERA_NAME_BYTES
from ..ops.few_rows import dense
from .archive_log import ArchiveLog, fsync_dir, folder_for

FORMAT = "inf_mllm_ros.memory"
# 2: every slot's kind, pin and the window's query count; the stream's time origin; the clock checksummed.
# 3: the archive's blocks in a log beside the file.
VERSION = 3

# Why a file was refused (MemoryFileError.kind).
MISSING, TORN, CORRUPT, VERSION_MISMATCH, MODEL_MISMATCH, SETTINGS_MISMATCH = (
    "missing", "torn", "corrupt", "version", "model_mismatch", "settings_mismatch")


class MemoryFileError(RuntimeError):
    """A memory file that cannot be used; `kind` says why (missing, torn, corrupt, version, model, settings)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class MemoryFileInfo:
    """A memory file written or read: where, how big, how long it took, and the memory it holds."""

    path: str
    bytes: int  # written (the file and the blocks appended to the log) or read
    seconds: float
    tokens_seen: int
    fill: int
    blocks_lost: int = 0  # archive blocks held when saved whose record could not be read
    held_s: float = 0.0  # of `seconds`, how long the stream was held while its memory was copied (a save)


@dataclass
class MemorySnapshot:
    """A stream's memory copied for writing (`snapshot_memory`): the model can go on while `write_memory` writes it."""

    path: Path
    log: ArchiveLog  # the log the file at `path` names, to be continued
    new_blocks: dict[str, torch.Tensor]  # the archive's blocks since the log's last one
    held: list[int]  # the indices of the archive's blocks held
    tensors: dict[str, torch.Tensor]  # the cache's, and the blocks held
    header: dict[str, str]  # without the log and the checksum
    tokens_seen: int
    fill: int
    started: float  # time.monotonic() when the copy began
    held_s: float  # how long the copy took


# Configuration entries that do not describe the model: where it was loaded from, the transformers release
# that wrote it (an upgrade must not orphan every memory), the precision (a cache setting of its own).
_NOT_THE_MODEL = frozenset({"_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype"})


def _model_config(config: dict) -> dict:
    """`config` without the entries that do not describe the model, in nested configurations too."""
    return {k: _model_config(v) if isinstance(v, dict) else v for k, v in config.items() if k not in _NOT_THE_MODEL}


def model_fingerprint(adapter) -> str:
    """Identifies a model's configuration and weights (a sample of every parameter), not its folder, the
    transformers release or the precision it was loaded in."""
    digest = hashlib.sha256()
    digest.update(type(adapter.model).__name__.encode())
    config = _model_config(adapter.model.config.to_dict())
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in adapter.model.named_parameters():
            digest.update(name.encode())
            # Through bfloat16: the same weights sample alike whatever precision they were loaded in.
            sample = dense(param.detach()).reshape(-1)[:64].to("cpu", torch.bfloat16).float().contiguous()
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _checksum(tensors: dict[str, torch.Tensor], clock: str, log: str) -> str:
    """Over every tensor, the stream's clock and counters and the archive log's description (the header's other
    fields are checked against this stream: a damaged one is refused anyway)."""
    digest = hashlib.sha256(clock.encode() + b"\0" + log.encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def snapshot_memory(stream, path: str | os.PathLike, fingerprint: str | None = None) -> MemorySnapshot:
    """Copy what a save of the stream's memory to `path` writes: the cache, the archive's blocks new since the log
    the file there continues, the clock. Run it where nothing else uses the stream, and where no write of the same
    file is in progress (it reads that file's log)."""
    start = time.monotonic()
    path = Path(path).resolve()  # through a link: replace the file it names, not the link
    log = _continued_log(path, stream.memory_id) or ArchiveLog(stream.memory_id)
    memory = stream.export_memory(blocks_after=log.last_block)
    tensors = memory.cache
    if memory.held:
        tensors["archive.held"] = torch.tensor(memory.held, dtype=torch.long)
    header = {
        "format": FORMAT,
        "version": str(VERSION),
        "model": fingerprint or stream.model_fingerprint(),
        "settings": json.dumps(stream.memory_settings(), sort_keys=True),
        "stream": json.dumps(memory.clock, sort_keys=True),
        "saved_at": f"{time.time():.3f}",
    }
    return MemorySnapshot(path, log, memory.new_blocks, memory.held, tensors, header, memory.tokens_seen, memory.fill,
                          start, time.monotonic() - start)


def write_memory(snapshot: MemorySnapshot) -> MemoryFileInfo:
    """Write a snapshot atomically: the log's new blocks appended and flushed, then the file that commits them."""
    path, log, tensors = snapshot.path, snapshot.log, snapshot.tensors
    folder = folder_for(path)
    appended = log.append(folder, snapshot.new_blocks) if snapshot.new_blocks else 0
    log.retire(min(snapshot.held) if snapshot.held else None)
    described = json.dumps(log.describe(), sort_keys=True)
    header = {**snapshot.header, "archive_log": described,
              "sha256": _checksum(tensors, snapshot.header["stream"], described)}
    data = st_save(tensors, metadata=header)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed (one writer per file)
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    log.remove_unnamed(folder)  # only once the file that no longer names them is in place
    return MemoryFileInfo(str(path), len(data) + appended, time.monotonic() - snapshot.started, snapshot.tokens_seen,
                          snapshot.fill, held_s=snapshot.held_s)


def save_memory(stream, path: str | os.PathLike, fingerprint: str | None = None) -> MemoryFileInfo:
    """Write the stream's memory to `path` atomically. Run it where nothing else uses the stream."""
    return write_memory(snapshot_memory(stream, path, fingerprint))


def _continued_log(path: Path, memory_id: str) -> ArchiveLog | None:
    """The archive log of the memory file at `path` where it is this memory's (None: another memory's, or no
    readable file): only its header is read."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            metadata = json.loads(f.read(size))["__metadata__"]
        log = ArchiveLog.from_description(json.loads(metadata["archive_log"]))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return log if log.memory_id == memory_id and metadata.get("version") == str(VERSION) else None


def load_memory(stream, path: str | os.PathLike, fingerprint: str | None = None) -> MemoryFileInfo:
    """Replace the stream's memory with the file's, or raise MemoryFileError: the stream is left as it was,
    or empty where the file's memory proved inconsistent while it was being taken in."""
    start = time.monotonic()
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MemoryFileError(MISSING, f"no memory file at {path}") from None
    except OSError as exc:
        raise MemoryFileError(CORRUPT, f"cannot read memory file {path}: {exc}") from exc
    header = _read_header(data, path)
    if header.get("format") != FORMAT:
        raise MemoryFileError(CORRUPT, f"{path} is not a memory file (format {header.get('format')!r})")
    if header.get("version") != str(VERSION):
        raise MemoryFileError(VERSION_MISMATCH,
                              f"{path} has format version {header.get('version')}; this build reads version {VERSION}")
    if header.get("model") != (fingerprint or stream.model_fingerprint()):
        raise MemoryFileError(MODEL_MISMATCH, f"{path} was written by another model")
    try:
        saved = json.loads(header["settings"])
        clock = json.loads(header["stream"])
        log = ArchiveLog.from_description(json.loads(header["archive_log"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise MemoryFileError(CORRUPT, f"{path}: unreadable header ({exc})") from exc
    wanted = stream.memory_settings()
    differ = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k} {old!r} in the file, {new!r} here" for k, (old, new) in sorted(differ.items()))
        raise MemoryFileError(SETTINGS_MISMATCH, f"{path} was saved with other cache settings: {detail}")
    try:
        tensors = st_load(data)
    except Exception as exc:
        raise MemoryFileError(CORRUPT, f"{path}: unreadable tensors ({exc})") from exc
    if _checksum(tensors, header["stream"], header["archive_log"]) != header.get("sha256"):
        raise MemoryFileError(CORRUPT, f"{path}: checksum mismatch (the file was changed or damaged)")
    held = tensors.pop("archive.held", torch.zeros(0, dtype=torch.long)).tolist()
    records, _ = log.read(folder_for(path.resolve())) if held and stream.archives else ([], False)
    blocks = held_blocks(records, set(held))
    try:
        stream.import_memory(tensors, blocks, log.memory_id, clock)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise MemoryFileError(CORRUPT, f"{path}: inconsistent memory ({exc})") from exc
    found = len(blocks["archive.blocks"]) if blocks else 0
    lost = len(held) - found if stream.archives else 0
    return MemoryFileInfo(str(path), len(data), time.monotonic() - start, stream.tokens_seen, stream.fill,
                          blocks_lost=lost)


def held_blocks(records: list[dict[str, torch.Tensor]], held: set[int]) -> dict[str, torch.Tensor]:
    """The blocks named in `held`, gathered from the log's records in stream order, in KVArchive.export_state's
    layout (empty where none is found)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for record in records:
        rows, lengths = record["archive.blocks"], record["archive.blocks"][:, 1]
        starts = (lengths.cumsum(0) - lengths).tolist()
        for i, (row, start) in enumerate(zip(rows.tolist(), starts)):
            if row[0] not in held:
                continue
            tokens = slice(start, start + row[1])
            pieces = {"archive.keys": record["archive.keys"][:, :, tokens],
                      "archive.values": record["archive.values"][:, :, tokens],
                      "archive.pos_start": record["archive.pos_start"][tokens],
                      "archive.pos_end": record["archive.pos_end"][tokens],
                      "archive.token_ids": record["archive.token_ids"][tokens],
                      "archive.blocks": rows[i : i + 1], "archive.stamps": record["archive.stamps"][i : i + 1],
                      "archive.poses": record["archive.poses"][i : i + 1]}
            if "archive.cameras" in record:  # a record written before frames named their camera names none
                pieces["archive.cameras"] = record["archive.cameras"][i : i + 1]
            else:
                pieces["archive.cameras"] = torch.zeros((1, CAMERA_NAME_BYTES), dtype=torch.uint8)
            for name, piece in pieces.items():
                parts.setdefault(name, []).append(piece)
    return {name: torch.cat(pieces, dim=2 if name in ("archive.keys", "archive.values") else 0)
            for name, pieces in parts.items()}


def set_aside(path: str | os.PathLike) -> Path | None:
    """Rename a refused file out of the way (kept for inspection, never overwritten); None if absent."""
    path = Path(path).resolve()  # through a link, as save_memory writes
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists() or folder_for(aside).exists():
        aside = aside.with_name(f"{path.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    os.replace(path, aside)
    if folder_for(path).is_dir():  # its archive blocks go with it
        os.replace(folder_for(path), folder_for(aside))
    return aside


def _read_header(data: bytes, path: Path) -> dict:
    if len(data) < 8:
        raise MemoryFileError(TORN, f"{path} is cut short ({len(data)} bytes)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise MemoryFileError(TORN, f"{path} is cut short (header of {size} bytes, {len(data) - 8} present)")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as exc:
        raise MemoryFileError(CORRUPT, f"{path}: unreadable header ({exc})") from exc
    ends = [end for name, info in header.items() if name != "__metadata__" for end in info.get("data_offsets", [])[1:]]
    if max(ends, default=0) > len(data) - 8 - size:
        raise MemoryFileError(TORN, f"{path} is cut short (tensor data ends before {max(ends)} bytes)")
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise MemoryFileError(CORRUPT, f"{path} has no memory header")
    return metadata


__all__ = ["MemoryFileError", "MemoryFileInfo", "MemorySnapshot", "load_memory", "model_fingerprint", "save_memory",
           "set_aside", "snapshot_memory", "write_memory"]
