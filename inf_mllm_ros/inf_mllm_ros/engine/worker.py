"""The engine's worker thread, as a part of `StreamingEngine`: it loads the model, then takes jobs in the
work queue's order (work_queue.py), applies a new snapshot of the live settings between two jobs, pushes
texts in batches and keeps the figures `stats()` gives, and saves the memory when a checkpoint is due.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .checkpoints import MemoryCheckpoints
from .loading import use_torch_threads
from .stream import KVStream

if TYPE_CHECKING:
    from .live_settings import LiveSettings
    from .work_queue import Job


class EngineWorker(MemoryCheckpoints):
    """The worker's side of `StreamingEngine` (engine.py): its loop and what runs on it. It uses the engine's
    `_lock`, `_work`, `_settings`, `_applied`, `_stream`, `_stats`, `_closed`, `config`, `counters`,
    `ready`, `load_error`, `torch_threads`, `_on_ingested`, `_count_query` and `close`.
    """

    def _run(self, loader) -> None:
        use_torch_threads(self.torch_threads)
        try:
            adapter = loader()
            with self._lock:  # with the settings changed while it loaded
                self._applied = self._settings
                self._stream = KVStream(adapter, self._applied.stream_config(self.config))
            if self._stream.archive.enabled:
                self._stream.retrieval_heads()  # found (or read) while loading, so that no question waits for them
            if self.memory_file is not None:
                self._restore(self._stream)
            self._snapshot_stats()
            self.ready.set()
        except Exception as exc:  # reported through load_error and every later query
            self.load_error = exc
            self.close(timeout=0)
            return
        while True:
            with self._lock:
                while not (self._closed or self._work):
                    if time.monotonic() >= self._next_checkpoint:
                        break
                    self._lock.wait(min(self._next_checkpoint - time.monotonic(), 3600.0))
                if self._closed:
                    break
                jobs = (self._work.next_jobs(self._settings.frame_period, self.config.capacity, self.config.chunk_size)
                        if self._work else [])
                settings = self._settings
            if settings is not self._applied:
                self._apply(settings)
            if not jobs:  # a checkpoint is due and nothing waits
                self._checkpoint()
                continue
            kind = jobs[0].kind
            if kind == "text":
                ok = self._run_texts(jobs)
            else:
                job = jobs[0]
                if not job.future.set_running_or_notify_cancel():
                    continue
                started = time.monotonic()
                try:
                    outcome, ok = job.run(self._stream), True
                except Exception as exc:  # the caller gets the reason (a prompt that failed part-way in,
                    # out of memory say, leaves the blocks that went in: a message cut short)
                    outcome, ok = exc, False
                if kind == "frame" and ok:
                    with self._lock:
                        self._work.took_frame(time.monotonic() - started)
                self._snapshot_stats()
                if kind == "query":
                    self._count_query(job.future, ok)
                (job.future.set_result if ok else job.future.set_exception)(outcome)
            # Only an input that went in changed the memory (a description of an unchanged one is skipped).
            if ok and self._on_ingested is not None and kind in ("text", "frame"):
                self._on_ingested(kind)
            if time.monotonic() >= self._next_checkpoint:
                self._checkpoint()
        if self.memory_file is not None:
            self._checkpoint()  # the last save, after the job that close() stopped or let finish

    def _apply(self, settings: LiveSettings) -> None:
        """Give the stream a new snapshot of the live settings (on the worker, between jobs)."""
        stream, before = self._stream, self._applied
        for name, value in settings.policy_settings.items():
            if before.policy_settings.get(name) != value:
                stream.set_policy_knob(name, value)
        stream.config = settings.stream_config(stream.config)
        self._applied = settings

    def _run_texts(self, batch: list[Job]) -> bool:
        """Push a batch of texts in one model call; each future gets its own token count. False if none
        went in."""
        live = [(job.text, job.future) for job in batch if job.future.set_running_or_notify_cancel()]
        if not live:
            return False
        start = time.monotonic()
        wait = start - min(job.submitted for job in batch)
        self.counters.longest_text_wait_s = max(self.counters.longest_text_wait_s, wait)
        try:
            counts = self._stream.push_texts([item for item, _ in live])
        except Exception as exc:  # every caller gets the reason (see _run on a prompt failed part-way in)
            self._snapshot_stats()
            for _, future in live:
                future.set_exception(exc)
            return False
        with self._lock:
            self._work.took_texts(sum(len(item[0]) for item, _ in live), time.monotonic() - start)
        self._snapshot_stats()
        for (_, future), n in zip(live, counts):
            future.set_result(n)
        return True

    def _snapshot_stats(self) -> None:
        """Take the figures `stats()` gives before any caller hears that a job ended, so that one who
        reads them next (a reset's caller publishing stats) never sees the memory as it was before."""
        with self._lock:
            self._stats = self._stream.stats()
