"""The memory on disk: a stream's whole state in one file, written atomically and checked before use.

The file is a safetensors file: named tensors (the cache's slots, and the archive's blocks where there is
an archive) and a text header, data only (nothing in it is ever
executed or unpickled). The header says what the file is (`format`, `version`), which model made it
(a fingerprint of its configuration and weights), the cache settings it needs, the stream's clock and
counters, and a sha256 over every tensor's bytes and that clock.

Writing goes to a temporary file beside the target, which is flushed to disk and then renamed over
the target, and the folder is flushed too: a crash at any moment leaves either the previous file or
the new one, never a mixture. Reading refuses, with a `MemoryFileError` whose `kind` says why, a file
that is missing, cut short, corrupt, of another format version, from another model or for other cache
settings; a refused file is never half-loaded.
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

FORMAT = "inf_mllm_ros.memory"
VERSION = 2  # 2: every slot's kind, pin and the window's query count; the stream's time origin; the clock checksummed

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
    bytes: int
    seconds: float
    tokens_seen: int
    fill: int


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
            sample = param.detach().reshape(-1)[:64].to("cpu", torch.bfloat16).float().contiguous()
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def required_settings(stream) -> dict:
    """What a saved memory must have been made with to be used by this stream."""
    return {
        "capacity": stream.cache.capacity,
        "policy": stream.policy.name,
        "position_mode": stream.cache.position_mode,
        "dtype": str(stream.adapter.dtype).replace("torch.", ""),
        "layers": len(stream.cache.layers),
    }


def _checksum(tensors: dict[str, torch.Tensor], clock: str) -> str:
    """Over every tensor and the stream's clock and counters (the header's other fields are checked
    against this stream: a damaged one is refused anyway)."""
    digest = hashlib.sha256(clock.encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_memory(stream, path: str | os.PathLike, fingerprint: str | None = None) -> MemoryFileInfo:
    """Write the stream's memory to `path` atomically. Run it where nothing else uses the stream."""
    start = time.monotonic()
    path = Path(path).resolve()  # through a link: replace the file it names, not the link
    tensors = {**stream.cache.export_state(), **stream.archive.export_state()}
    clock = json.dumps(stream.clock_state(), sort_keys=True)
    header = {
        "format": FORMAT,
        "version": str(VERSION),
        "model": fingerprint or model_fingerprint(stream.adapter),
        "settings": json.dumps(required_settings(stream), sort_keys=True),
        "stream": clock,
        "saved_at": f"{time.time():.3f}",
        "sha256": _checksum(tensors, clock),
    }
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
    _fsync_dir(path.parent)
    return MemoryFileInfo(str(path), len(data), time.monotonic() - start, stream.tokens_seen, stream.cache.fill)


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
    if header.get("model") != (fingerprint or model_fingerprint(stream.adapter)):
        raise MemoryFileError(MODEL_MISMATCH, f"{path} was written by another model")
    try:
        saved = json.loads(header["settings"])
        clock = json.loads(header["stream"])
    except (KeyError, ValueError) as exc:
        raise MemoryFileError(CORRUPT, f"{path}: unreadable header ({exc})") from exc
    wanted = required_settings(stream)
    differ = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k} {old!r} in the file, {new!r} here" for k, (old, new) in sorted(differ.items()))
        raise MemoryFileError(SETTINGS_MISMATCH, f"{path} was saved with other cache settings: {detail}")
    try:
        tensors = st_load(data)
    except Exception as exc:
        raise MemoryFileError(CORRUPT, f"{path}: unreadable tensors ({exc})") from exc
    if _checksum(tensors, header["stream"]) != header.get("sha256"):
        raise MemoryFileError(CORRUPT, f"{path}: checksum mismatch (the file was changed or damaged)")
    try:
        stream.cache.import_state({k: t for k, t in tensors.items() if not k.startswith("archive.")},
                                  dtype=stream.adapter.dtype, device=stream.adapter.device)
        stream.archive.import_state(tensors, dtype=stream.adapter.dtype)
        stream.restore_clock(clock)
    except (KeyError, ValueError, RuntimeError) as exc:
        stream.reset()
        raise MemoryFileError(CORRUPT, f"{path}: inconsistent memory ({exc})") from exc
    return MemoryFileInfo(str(path), len(data), time.monotonic() - start, stream.tokens_seen, stream.cache.fill)


def set_aside(path: str | os.PathLike) -> Path | None:
    """Rename a refused file out of the way (kept for inspection, never overwritten); None if absent."""
    path = Path(path).resolve()  # through a link, as save_memory writes
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        aside = aside.with_name(f"{path.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    os.replace(path, aside)
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


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot flush a folder; the rename is still atomic
    finally:
        os.close(fd)


__all__ = ["MemoryFileError", "MemoryFileInfo", "load_memory", "model_fingerprint", "save_memory", "set_aside"]
