"""A thread-safe front for one `KVStream`: one worker runs the model, callers get futures.

Order of work. Each time the worker is free it takes, in this order:

1. control (a reset or a save), at once;
2. the waiting camera frame, if it is due: the previous job was not a frame and at least
   `frame_period` seconds have passed since the last frame was taken (`frame_period` 0: frames and
   other work alternate);
3. otherwise the oldest message: a question alone, or the texts waiting in a row before the next
   question (up to about a cache's worth of characters, and while a camera is live what the model takes
   in half a frame period, by its measured speed), pushed together in one model call
   (`KVStream.push_texts`: each text still its own user turn with its own time marker, counted one by
   one in `texts_ingested`, its future resolved with its own token count);
4. otherwise the frame.

So a question sees every text submitted before it, and waits behind the text calls for those texts
and a frame; under a flood of texts a frame still goes in every `frame_period` seconds (a text call then
lasts about half a period) or every other job, and under a camera faster than the model texts and
questions still get every other job. Frames
are kept one deep: a frame that arrives while another waits replaces it and the older one counts as
dropped, so a camera faster than the model never builds a backlog.
Texts and questions have bounded queues; when one is full the call is refused at once with a reason.

Memory file. With `memory_file` set, the worker restores the memory from it once the model is loaded
(a file that cannot be used is renamed aside with the reason in `memory_status`, and the stream starts
fresh), saves it every `checkpoint_period` seconds when it has changed, on `submit_save`, and last of
all when the engine closes (an answer stops at its next token, a text message at the end of its block:
see KVStream). Saving runs on the worker between jobs, so a file never holds half a block.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .adapters import ModelAdapter
from .chat import check_stamp
from .loading import DEFAULT_MODEL, load_model, use_torch_threads
from .memory_file import MemoryFileError, MemoryFileInfo, load_memory, model_fingerprint, save_memory, set_aside
from .policies import make_policy
from .stream import Answer, KVStream, StreamConfig, StreamStats
from .text_rules import text_problem


# Bounds of the waiting queues (the node's max_pending_texts and max_pending_queries default to these).
DEFAULT_MAX_PENDING_TEXTS = 64
DEFAULT_MAX_PENDING_QUERIES = 8


class EngineNotReadyError(RuntimeError):
    """The model is still loading, failed to load, or the engine was closed."""


class EngineBusyError(RuntimeError):
    """A bounded queue is full; the input was refused, nothing else changed."""


class FrameDroppedError(RuntimeError):
    """A newer frame replaced this one before the model could take it."""


@dataclass
class EngineCounters:
    """What the engine counts as it runs: refusals, drops, answers, failed saves, the longest text wait."""

    frames_dropped: int = 0
    texts_refused: int = 0
    queries_answered: int = 0
    queries_failed: int = 0
    checkpoints_failed: int = 0
    longest_text_wait_s: float = 0.0  # from a text's submission to the start of the model call that takes it


class StreamingEngine:
    """Runs a model over a stream on a worker thread.

    model: a model folder or an embedded model ("onevision-qwen2.5-0.5b", the default, or the small
        "smolvlm-smollm2": real text answers, untrained vision; "smollm2" or "qwen2.5-0.5b": text only; see
        loading.py); or pass `adapter` already loaded.
    The model loads on the worker; `ready` is set when it is usable, `load_error` says why not.
    """

    def __init__(
        self,
        model: str | None = DEFAULT_MODEL,
        config: StreamConfig | None = None,
        *,
        adapter: ModelAdapter | None = None,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        max_pending_texts: int = DEFAULT_MAX_PENDING_TEXTS,
        max_pending_queries: int = DEFAULT_MAX_PENDING_QUERIES,
        on_ingested: Callable[[str], None] | None = None,
        frame_period: float = 0.0,
        memory_file: str | None = None,
        checkpoint_period: float = 0.0,
        torch_threads: int = 0,
    ):
        self.config = config or StreamConfig()
        self.max_pending_texts = max_pending_texts
        self.max_pending_queries = max_pending_queries
        self.counters = EngineCounters()
        self.ready = threading.Event()
        self.load_error: Exception | None = None
        self._on_ingested = on_ingested
        self._stream: KVStream | None = None
        self._stats: StreamStats | None = None
        self._lock = threading.Condition()
        self._control: deque[_Job] = deque()  # resets and saves, first of all
        self._messages: deque[_Job] = deque()  # texts and queries in arrival order
        self._pending_texts = 0
        self._pending_queries = 0
        self._frame: _Job | None = None  # the newest frame only
        self._abandoned: set[Future] = set()  # running queries whose callers were told they failed
        self.frame_period = frame_period  # seconds; may change at any time (see the module docstring)
        self._last_frame_taken = float("-inf")
        self._last_frame_offered = float("-inf")
        self._seconds_per_char: float | None = None  # the model's time per character of text, measured
        self._last_kind: str | None = None
        self._closed = False
        self.memory_file = os.path.expanduser(memory_file) if memory_file else None
        if self.memory_file is not None and os.path.isdir(self.memory_file):
            raise ValueError(f"memory_file {self.memory_file} is a directory; give the path of a file "
                             "(in it or elsewhere)")
        self.checkpoint_period = checkpoint_period
        self.memory_status = "no memory file" if self.memory_file is None else "not restored yet"
        self.last_saved: MemoryFileInfo | None = None
        self.save_error: str | None = None  # why the last save failed; None once one succeeds
        self._saved_state: tuple | None = None
        self._next_checkpoint = float("inf")
        self._fingerprint: str | None = None
        loader = (lambda: adapter) if adapter is not None else (
            lambda: load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        )
        self.torch_threads = torch_threads  # 0: torch's default
        self._worker = threading.Thread(target=self._run, args=(loader,), name="inf_mllm_engine", daemon=True)
        self._worker.start()

    # --- submitting ----------------------------------------------------------------------------------
    def submit_text(self, text: str, stamp: float | None = None, *, pin: bool = False) -> Future:
        """Queue a message for the memory (`pin`: keep it ahead of what attention chooses; see
        `KVStream.push_text`). The future gives its token count."""
        # Refused at the door: queued texts go into the model together, and one bad text would fail them all.
        problem = text_problem(text)
        if problem:
            return _failed(ValueError(problem))
        try:
            check_stamp(stamp, "text")
        except ValueError as exc:
            return _failed(exc)
        with self._lock:
            self._check_open()
            if self._pending_texts >= self.max_pending_texts:
                self.counters.texts_refused += 1
                return _failed(EngineBusyError(f"text queue full ({self.max_pending_texts} waiting); message refused"))
            self._pending_texts += 1
            return self._enqueue(self._messages, _Job("text", text=(text, stamp, pin)))

    def submit_frame(self, rgb: np.ndarray, stamp: float | None = None) -> Future:
        job = _Job("frame", run=lambda s: s.push_frame(rgb, stamp))
        with self._lock:
            self._check_open()
            self._last_frame_offered = time.monotonic()
            if self._frame is not None:
                self.counters.frames_dropped += 1
                _fail(self._frame.future, FrameDroppedError("a newer frame replaced this one"))
            self._frame = job
            self._lock.notify()
        return job.future

    def submit_ask(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
                   on_token=None, cancel: threading.Event | None = None) -> Future:
        """Queue a question; `on_token` and `cancel` as in KVStream.ask (on_token runs on the worker thread)."""
        problem = text_problem(question, "question")
        if problem:
            with self._lock:
                self.counters.queries_failed += 1
            return _failed(ValueError(problem))
        return self._submit_query(lambda s: s.ask(question, max_new_tokens=max_new_tokens,
                                                  keep_in_memory=keep_in_memory,
                                                  on_token=on_token, cancel=cancel))

    def submit_describe(self, prompt: str | None = None, *, max_new_tokens: int | None = None) -> Future:
        return self._submit_query(lambda s: s.describe(prompt, max_new_tokens=max_new_tokens))

    def submit_reset(self) -> Future:
        with self._lock:
            self._check_open()
            return self._enqueue(self._control, _Job("control", run=lambda s: s.reset()))

    def submit_save(self) -> Future:
        """Save the memory to `memory_file` now (after the job in progress); the future gives MemoryFileInfo."""
        if self.memory_file is None:
            return _failed(ValueError("no memory_file is set; nothing to save to"))
        with self._lock:
            if not self.ready.is_set():
                return _failed(EngineNotReadyError(self._closed_reason() if self._closed else "model is still loading"))
            self._check_open()
            return self._enqueue(self._control, _Job("control", run=self._save))

    def _submit_query(self, fn) -> Future:
        with self._lock:
            if not self.ready.is_set():
                self.counters.queries_failed += 1
                reason = f"model failed to load: {self.load_error}" if self.load_error else "model is still loading"
                return _failed(EngineNotReadyError(reason))
            self._check_open()
            if self._pending_queries >= self.max_pending_queries:
                self.counters.queries_failed += 1
                return _failed(EngineBusyError(
                    f"query queue full ({self.max_pending_queries} waiting); try again later"))
            self._pending_queries += 1
            future = self._enqueue(self._messages, _Job("query", run=fn))
        # A caller that gives up (cancels) frees its place at once, so dead questions never fill the queue.
        future.add_done_callback(self._withdraw_if_cancelled)
        return future

    def abandon(self, future: Future) -> bool:
        """The caller of a query stops waiting and tells its client the query failed. A query that has not
        started never runs; one that is running ends as it would, but is counted failed, never answered.
        Returns True if the engine counts it, False if it never ran (the caller counts its failure)."""
        if future.cancel():
            return False
        with self._lock:
            if hasattr(future, "counted_answered"):  # ended just now: counted already
                if future.counted_answered:
                    self.counters.queries_answered -= 1
                    self.counters.queries_failed += 1
            else:
                self._abandoned.add(future)
        return True

    def _count_query(self, future: Future, ok: bool) -> None:
        """Count a finished query once, before its caller can see the result (see `abandon`)."""
        with self._lock:
            answered = ok and future not in self._abandoned
            self._abandoned.discard(future)
            future.counted_answered = answered
            if answered:
                self.counters.queries_answered += 1
            else:
                self.counters.queries_failed += 1

    def _withdraw_if_cancelled(self, future: Future) -> None:
        if not future.cancelled():
            return
        with self._lock:
            for i, queued in enumerate(self._messages):
                if queued.future is future:
                    del self._messages[i]
                    self._pending_queries -= 1
                    return

    def _enqueue(self, queue: deque, job: _Job) -> Future:
        queue.append(job)
        self._lock.notify()
        return job.future

    def _check_open(self) -> None:
        if self._closed:
            raise EngineNotReadyError(self._closed_reason())

    def _closed_reason(self) -> str:
        return f"model failed to load: {self.load_error}" if self.load_error else "engine is closed"

    # --- blocking conveniences -----------------------------------------------------------------------
    def push_text(self, text: str, stamp: float | None = None, timeout: float | None = None, *,
                  pin: bool = False) -> int:
        return self.submit_text(text, stamp, pin=pin).result(timeout)

    def push_frame(self, rgb: np.ndarray, stamp: float | None = None, timeout: float | None = None) -> int:
        return self.submit_frame(rgb, stamp).result(timeout)

    def ask(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
            timeout: float | None = None) -> Answer:
        return self.submit_ask(question, max_new_tokens=max_new_tokens, keep_in_memory=keep_in_memory).result(timeout)

    def describe(self, prompt: str | None = None, *, max_new_tokens: int | None = None,
                 timeout: float | None = None) -> Answer:
        return self.submit_describe(prompt, max_new_tokens=max_new_tokens).result(timeout)

    def reset(self, timeout: float | None = None) -> None:
        self.submit_reset().result(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the model; raises EngineNotReadyError if loading failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.load_error is not None:
                raise EngineNotReadyError(f"model failed to load: {self.load_error}") from self.load_error
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    # --- state ---------------------------------------------------------------------------------------
    def set_policy_knob(self, name: str, value) -> None:
        """Change one of the policy's live settings (see `knob`); it applies from the next eviction. Before
        the model is loaded the configuration takes it and the policy is built with it. Raises ValueError
        for a setting the policy lacks or cannot change at run time, or a bad value: nothing changes then."""
        with self._lock:
            stream = self._stream
            if stream is not None:
                stream.set_policy_knob(name, value)
            else:
                # Checked the way the policy will take it, so a refused value never enters the configuration.
                make_policy(self.config.policy, capacity=self.config.capacity,
                            **{**self.config.policy_settings, name: value}).set_knob(name, value)
                self.config.policy_settings = {**self.config.policy_settings, name: value}

    def stats(self) -> StreamStats | None:
        """The stream's figures after the last finished job (None until the model is loaded)."""
        with self._lock:
            return self._stats

    @property
    def pending(self) -> dict:
        with self._lock:
            return {"texts": self._pending_texts, "queries": self._pending_queries, "frame": self._frame is not None}

    @property
    def checkpoint_period(self) -> float:
        """Seconds between saves of a changed memory; 0: only on submit_save and at close. May change at
        any time: a new period makes the next save due that long from now."""
        return self._checkpoint_period

    @checkpoint_period.setter
    def checkpoint_period(self, seconds: float) -> None:
        with self._lock:
            if seconds == getattr(self, "_checkpoint_period", None):
                return  # the same period again: the save due stays due
            self._checkpoint_period = seconds
            self._schedule_checkpoint()
            self._lock.notify()  # the worker may be asleep until the previous due time

    @property
    def time_origin(self) -> float | None:
        """The caller's time of stream time 0 (`KVStream.time_origin`: saved with the memory, restored with
        it); None until the model is loaded or the caller sets it."""
        return None if self._stream is None else self._stream.time_origin

    @time_origin.setter
    def time_origin(self, seconds: float | None) -> None:
        if self._stream is None:
            raise EngineNotReadyError("model is still loading")
        self._stream.time_origin = seconds

    @property
    def adapter(self) -> ModelAdapter | None:
        return None if self._stream is None else self._stream.adapter

    @property
    def closed(self) -> bool:
        """Closed: it takes no more work (see `close`)."""
        return self._closed

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop taking work, fail what is waiting, stop the current answer at its next token and a text being
        pushed at the end of its block (see KVStream), then wait up to `timeout` for the worker's last
        save. Whether the worker has ended (False: it is still inside the model)."""
        with self._lock:
            self._closed = True
            if self._stream is not None:
                self._stream.stop_requested = True
            waiting = list(self._control) + list(self._messages) + ([self._frame] if self._frame else [])
            self._control.clear()
            self._messages.clear()
            self._pending_texts = self._pending_queries = 0
            self._frame = None
            self._lock.notify_all()
        for job in waiting:
            _fail(job.future, EngineNotReadyError(self._closed_reason()))
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout)
        return not self._worker.is_alive() or threading.current_thread() is self._worker

    # --- worker --------------------------------------------------------------------------------------
    def _run(self, loader) -> None:
        use_torch_threads(self.torch_threads)
        try:
            adapter = loader()
            with self._lock:  # a policy setting changed during the load is in the configuration by now
                self._stream = KVStream(adapter, self.config)
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
                while not (self._closed or self._control or self._messages or self._frame):
                    if time.monotonic() >= self._next_checkpoint:
                        break
                    self._lock.wait(min(self._next_checkpoint - time.monotonic(), 3600.0))
                if self._closed:
                    break
                jobs = self._next_jobs() if (self._control or self._messages or self._frame) else []
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
                try:
                    outcome, ok = job.run(self._stream), True
                except Exception as exc:  # the caller gets the reason (a prompt that failed part-way in,
                    # out of memory say, leaves the blocks that went in: a message cut short)
                    outcome, ok = exc, False
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

    # --- memory file ---------------------------------------------------------------------------------
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
            self.memory_status = (f"memory restored from {info.path}: {info.fill} tokens held, "
                                  f"{info.tokens_seen} seen, "
                                  f"{info.bytes / 1e6:.1f} MB in {info.seconds:.2f} s")
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
        period = self.checkpoint_period
        self._next_checkpoint = time.monotonic() + period if self.memory_file and period > 0 else float("inf")

    def _run_texts(self, batch: list[_Job]) -> bool:
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
        chars = sum(len(text) for (text, _, _), _ in live)
        per_char = (time.monotonic() - start) / max(chars, 1)
        ema = self._seconds_per_char
        self._seconds_per_char = per_char if ema is None else 0.7 * ema + 0.3 * per_char
        self._snapshot_stats()
        for (_, future), n in zip(live, counts):
            future.set_result(n)
        return True

    def _snapshot_stats(self) -> None:
        """Take the figures `stats()` gives before any caller hears that a job ended, so that one who
        reads them next (a reset's caller publishing stats) never sees the memory as it was before."""
        with self._lock:
            self._stats = self._stream.stats()

    def _text_batch_chars(self, now: float) -> int:
        """The most characters of text one model call takes: a cache's worth, and while a camera is live (a
        frame offered within two frame periods) what the model takes in half a frame period, by its measured
        speed, so that a frame's turn comes every period however many texts wait."""
        limit = 4 * self.config.capacity
        period = self.frame_period
        if period > 0 and self._seconds_per_char and now - self._last_frame_offered <= 2 * period:
            limit = min(limit, int(0.5 * period / self._seconds_per_char))
        return max(limit, 1)

    def _frame_due(self, now: float) -> bool:
        return self._last_kind != "frame" and now - self._last_frame_taken >= self.frame_period

    def _next_jobs(self) -> list[_Job]:
        """The next job, or the batch of texts that go in together."""
        if self._control:
            return [self._control.popleft()]
        now = time.monotonic()
        if self._frame is not None and (not self._messages or self._frame_due(now)):
            job, self._frame = self._frame, None
            self._last_frame_taken, self._last_kind = now, "frame"
            return [job]
        if self._messages[0].kind == "query":
            self._pending_queries -= 1
            self._last_kind = "query"
            return [self._messages.popleft()]
        # Waiting texts go in together, up to about a cache's worth (4 characters a token), so that a long
        # backlog does not hold a question or a frame for many blocks of the model.
        batch, chars = [], 0
        limit = self._text_batch_chars(now)
        while self._messages and self._messages[0].kind == "text" and (not batch or chars < limit):
            chars += len(self._messages[0].text[0])
            batch.append(self._messages.popleft())
        self._pending_texts -= len(batch)
        self._last_kind = "text"
        return batch


@dataclass
class _Job:
    """Work for the model and the future its caller holds. A text job carries its message, (text, stamp,
    pin): texts go into the model in batches (`_run_texts`); every other job is a call on the stream."""

    kind: str  # "text", "query", "frame" or "control" (a reset, a save)
    run: Callable[[KVStream], object] | None = None
    text: tuple | None = None
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)


def _fail(future: Future, exc: Exception) -> None:
    """Fail a future that may have been cancelled by its caller meanwhile (a timed-out query)."""
    if future.set_running_or_notify_cancel():
        future.set_exception(exc)


def _failed(exc: Exception) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future
