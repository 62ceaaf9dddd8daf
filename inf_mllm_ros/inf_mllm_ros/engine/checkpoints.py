"""The engine's memory file, as a part of `StreamingEngine`: restored once the model is loaded, saved every
`checkpoint_period` seconds when the memory has changed, on request and at close. Saving runs on the worker
between jobs, so a file never holds half a block.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .memory_file import MemoryFileError, MemoryFileInfo, load_memory, model_fingerprint, save_memory, set_aside

if TYPE_CHECKING:
    from .stream import KVStream


class MemoryCheckpoints:
    """Restoring and saving the memory file. A part of `StreamingEngine` (engine.py): it uses the engine's
    `memory_file`, `memory_status`, `last_saved`, `save_error`, `counters`, `_stream`, `_settings`,
    `_saved_state`, `_next_checkpoint` and `_fingerprint`, and runs on its worker only.
    """

    def _memory_state(self, stream: KVStream) -> tuple:
        return (stream.tokens_seen, stream.cache.fill, stream.cache.evictions, stream.texts_ingested,
                stream.frames_ingested)

    def _restore(self, stream: KVStream) -> None:
        self._fingerprint = model_fingerprint(stream.adapter)
        try:
            info = load_memory(stream, self.memory_file, self._fingerprint)
        except MemoryFileError as exc:
            if exc.kind == "missing":
                self.memory_status = f"no memory file at {self.memory_file} yet; starting fresh"
            else:
                try:
                    aside = f"kept aside as {set_aside(self.memory_file)}"
                except OSError as move_exc:
                    aside = f"could not move it aside ({move_exc}); the next save replaces it"
                self.memory_status = f"memory file refused ({exc.kind}): {exc}; {aside}; starting fresh"
        else:
            lost = f", {info.blocks_lost} archive blocks lost to a damaged log" if info.blocks_lost else ""
            self.memory_status = (f"memory restored from {info.path}: {info.fill} tokens held, "
                                  f"{info.tokens_seen} seen, "
                                  f"{info.bytes / 1e6:.1f} MB in {info.seconds:.2f} s{lost}")
            self._saved_state = self._memory_state(stream)
        self._schedule_checkpoint()

    def _save(self, stream: KVStream) -> MemoryFileInfo:
        try:
            info = save_memory(stream, self.memory_file, self._fingerprint)
        except Exception as exc:
            self.save_error = f"saving to {self.memory_file} failed: {type(exc).__name__}: {exc}"
            raise
        self.last_saved, self.save_error = info, None
        self._saved_state = self._memory_state(stream)
        self._schedule_checkpoint()
        return info

    def _checkpoint(self) -> None:
        """Save if the memory changed since the last save; a failure is reported, never raised."""
        stream = self._stream
        if stream is None or self.memory_file is None:
            return
        if self._memory_state(stream) == self._saved_state:
            self._schedule_checkpoint()
            return
        try:
            self._save(stream)
        except Exception:  # a full disk must not stop the robot's memory: save_error says why
            self.counters.checkpoints_failed += 1
            self._schedule_checkpoint()

    def _schedule_checkpoint(self) -> None:
        period = self._settings.checkpoint_period
        self._next_checkpoint = time.monotonic() + period if self.memory_file and period > 0 else float("inf")

