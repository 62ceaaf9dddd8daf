"""The engine's memory file: restored once the model is loaded, saved every `checkpoint_period` seconds when the
memory has changed, on request and at close. `Checkpointer` is owned by `StreamingEngine` (engine.py) and called
on its worker only, between jobs, so a file never holds half a block. A periodic save holds the worker only while
the memory is copied; the copy is written on a thread of its own while the model goes on (one write at a time:
the next save waits for the one before).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from typing import TYPE_CHECKING

from ..persistence.memory_file import (MemoryFileError, MemoryFileInfo, MemorySnapshot, load_memory, set_aside,
                          snapshot_memory, write_memory)

if TYPE_CHECKING:
    from .stream import KVStream


class Checkpointer:
    """One memory file and what happened to it.

    memory_file: the file's path (None: no file; nothing is restored or saved).
    status: what happened at load (restored, refused and set aside, missing); last_saved: the last save that went
    through; save_error: why the last save failed (None once one succeeds).
    """

    def __init__(self, memory_file: str | None):
        self.memory_file = os.path.expanduser(memory_file) if memory_file else None
        if self.memory_file is not None and os.path.isdir(self.memory_file):
            raise ValueError(f"memory_file {self.memory_file} is a directory; give the path of a file "
                             "(in it or elsewhere)")
        self.status = "no memory file" if self.memory_file is None else "not restored yet"
        self.last_saved: MemoryFileInfo | None = None
        self.save_error: str | None = None
        self.next_due = float("inf")  # time.monotonic() of the next periodic save
        self._saved_state: tuple | None = None  # the memory's counters at the last save: changed since?
        self._fingerprint: str | None = None  # the model's, found once at restore
        self._writer: threading.Thread | None = None  # the write in progress
        self._write_failed = False  # the last write on the writer thread failed, not reported yet

    @property
    def due(self) -> bool:
        return time.monotonic() >= self.next_due

    def schedule(self, period: float) -> None:
        """The next periodic save `period` seconds from now (none for 0 or without a file)."""
        self.next_due = time.monotonic() + period if self.memory_file and period > 0 else float("inf")

    def restore(self, stream: KVStream, period: float) -> None:
        """Load the file into `stream`; a file that cannot be used is set aside with the reason in `status`."""
        self._fingerprint = stream.model_fingerprint()
        try:
            info = load_memory(stream, self.memory_file, self._fingerprint)
        except MemoryFileError as exc:
            if exc.kind == "missing":
                self.status = f"no memory file at {self.memory_file} yet; starting fresh"
            else:
                try:
                    aside = f"kept aside as {set_aside(self.memory_file)}"
                except OSError as move_exc:
                    aside = f"could not move it aside ({move_exc}); the next save replaces it"
                self.status = f"memory file refused ({exc.kind}): {exc}; {aside}; starting fresh"
        else:
            lost = f", {info.blocks_lost} archive blocks lost to a damaged log" if info.blocks_lost else ""
            self.status = (f"memory restored from {info.path}: {info.fill} tokens held, {info.tokens_seen} seen, "
                           f"{info.bytes / 1e6:.1f} MB in {info.seconds:.2f} s{lost}")
            self._saved_state = stream.version()
        self.schedule(period)

    def save(self, stream: KVStream, period: float) -> MemoryFileInfo:
        """Save now and wait for the file; raises what failed (and keeps it in `save_error`)."""
        # A failed write before this one is kept for the next checkpoint to report (the caller counts them there).
        self._write_failed = not self.wait()
        info = self._write(self._snapshot(stream, period))
        self._saved_state = stream.version()
        return info

    def checkpoint(self, stream: KVStream | None, period: float, *, wait: bool = False) -> bool:
        """Save if the memory changed since the last save: the memory is copied here and written on the writer
        thread (here too with `wait`, as at close). A failure is kept in `save_error`, never raised (a full disk
        must not stop the robot's memory): returns False where the copy failed, or the write before this one."""
        if stream is None or self.memory_file is None:
            return True
        ok = self.wait()
        if stream.version() == self._saved_state:
            self.schedule(period)
            return ok
        try:
            snapshot = self._snapshot(stream, period)
        except Exception:
            return False
        self._saved_state = stream.version()  # cleared again where the write fails
        if wait:
            try:
                self._write(snapshot)
            except Exception:
                return False
            return ok
        # Handed over in a list the writer empties: Thread keeps its args until run() returns, and the copy must be
        # freed before the writer gives the memory back.
        self._writer = threading.Thread(target=self._write_quietly, args=([snapshot],), name="inf_mllm_memory_writer",
                                        daemon=True)
        self._writer.start()
        return ok

    def wait(self) -> bool:
        """Wait for the write in progress; whether the last write on the writer thread went through (reported once)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failed, self._write_failed = self._write_failed, False
        return not failed

    def _snapshot(self, stream: KVStream, period: float) -> MemorySnapshot:
        try:
            return snapshot_memory(stream, self.memory_file, self._fingerprint)
        except Exception as exc:
            self.save_error = f"saving to {self.memory_file} failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.schedule(period)

    def _write(self, snapshot: MemorySnapshot) -> MemoryFileInfo:
        try:
            info = write_memory(snapshot)
        except Exception as exc:
            self.save_error = f"saving to {self.memory_file} failed: {type(exc).__name__}: {exc}"
            self._saved_state = None  # not saved: the next checkpoint tries again
            raise
        self.last_saved, self.save_error = info, None
        return info

    def _write_quietly(self, handed_over: list[MemorySnapshot]) -> None:
        snapshot = handed_over.pop()
        try:
            self._write(snapshot)
        except Exception:
            self._write_failed = True
        finally:
            del snapshot
            release_free_memory()


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give the memory freed by a checkpoint back to the system. The copy (tens of MB) is freed on the writer
    thread, into glibc's per-thread arena, which keeps it: without this the node's resident memory swung by up to
    75 MiB from one checkpoint to the next (small model, cache 1,024; flat within 2 MiB with it), which on a
    Jetson is GPU memory too."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
