"""A thread-safe front for one `KVStream`: one worker runs the model, callers get futures.

Order of work: see work_queue.py. A question sees every text taken before it and waits for the job in progress
and one batch of them; a waiting frame waits for one other job at most; frames are kept one deep (a frame that
arrives while another waits replaces it and the older one counts as dropped). Texts and questions have bounded
queues; when one is full the call is refused at once with a reason. A question waits for at most
`max_text_delay` of the model's time of the texts ahead of it, then overtakes the rest. Texts waiting in a row go
into the model together (`KVStream.push_texts`: each text still its own user turn with its own time marker,
counted one by one in `texts_ingested`, its future resolved with its own token count).

Memory file. With `memory_file` set, the worker restores the memory from it once the model is loaded
(a file that cannot be used is renamed aside with the reason in `memory_status`, and the stream starts
fresh), saves it every `checkpoint_period` seconds when it has changed, on `submit_save`, and last of
all when the engine closes (an answer stops at its next token, a text message at the end of its block:
see KVStream). Saving runs on the worker between jobs, so a file never holds half a block.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable

import numpy as np

from ..models.adapters import ModelAdapter
from ..api import (
    DEFAULT_MAX_PENDING_QUERIES,
    DEFAULT_MAX_PENDING_TEXTS,
    EngineBusyError,
    EngineNotReadyError,
    FrameDroppedError,
)
from ..models.chat import check_stamp
from ..models.loading import DEFAULT_MODEL, load_model
from ..persistence.memory_file import MemoryFileInfo
from ..poses import Pose
from .live_settings import LiveSettings
from ..answering import Answer, Question
from ..stream_config import StreamConfig
from .stream import StreamStats
from ..text_rules import TextRefused, checked_text
from .checkpoints import Checkpointer
from .model_bench import ModelBench
from .model_turns import ModelTurns
from .work_queue import Job
from .worker import EngineCounters, EngineWorker, WorkBoard


class StreamingEngine:
    """Runs a model over a stream on a worker thread.

    model: a model folder or an embedded model ("onevision-qwen2.5-0.5b", the default, or the small
        "smolvlm-smollm2": real text answers, untrained vision; "smollm2" or "qwen2.5-0.5b": text only; see
        loading.py); or pass `adapter` already loaded, or `load`, which gives it (called on the worker). Engines
        over one adapter (a memory each, the weights loaded once: shared_model.py) share its `turns`
        (model_turns.py), a job in the model at a time, in the order asked for, or its `bench` (model_bench.py:
        those turns, and their inputs and questions that wait at once through the model together).
    The model loads on the worker; `ready` is set when it is usable, `load_error` says why not.
    """

    def __init__(
        self,
        model: str | None = DEFAULT_MODEL,
        config: StreamConfig | None = None,
        *,
        adapter: ModelAdapter | None = None,
        load: Callable[[], ModelAdapter] | None = None,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        max_pending_texts: int = DEFAULT_MAX_PENDING_TEXTS,
        max_pending_queries: int = DEFAULT_MAX_PENDING_QUERIES,
        on_ingested: Callable[[str], None] | None = None,
        frame_period: float = 0.0,
        max_text_delay: float = 0.0,
        memory_file: str | None = None,
        checkpoint_period: float = 0.0,
        torch_threads: int = 0,
        turns: ModelTurns | None = None,
        bench: ModelBench | None = None,
    ):
        self.config = config or StreamConfig()
        self.max_pending_texts = max_pending_texts
        self.max_pending_queries = max_pending_queries
        # What may change while it runs, as one immutable snapshot (see update_settings); the worker applies a
        # new one between jobs.
        self._board = WorkBoard(LiveSettings.of(self.config, frame_period=frame_period, max_text_delay=max_text_delay,
                                                checkpoint_period=checkpoint_period))
        self.checkpoints = Checkpointer(memory_file)

        def loader() -> ModelAdapter:  # on the worker
            if load is not None:
                return load()
            if adapter is not None:
                return adapter
            return load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)

        self.worker = EngineWorker(self._board, loader, self.config, self.checkpoints, on_ingested=on_ingested,
                                   on_load_failed=lambda: self.close(timeout=0), torch_threads=torch_threads,
                                   turns=turns, bench=bench)
        self.worker.start()

    # --- what callers read ----------------------------------------------------------------------------
    @property
    def counters(self) -> EngineCounters:
        return self._board.counters

    @property
    def ready(self) -> threading.Event:
        """Set when the model is loaded and usable."""
        return self._board.ready

    @property
    def load_error(self) -> Exception | None:
        """Why the model could not be loaded (None while it loads or once it did)."""
        return self._board.load_error

    @property
    def memory_file(self) -> str | None:
        return self.checkpoints.memory_file

    @property
    def memory_status(self) -> str:
        """What happened to the memory file at load (restored, refused, missing)."""
        return self.checkpoints.status

    @property
    def last_saved(self) -> MemoryFileInfo | None:
        return self.checkpoints.last_saved

    @property
    def save_error(self) -> str | None:
        """Why the last save failed; None once one succeeds."""
        return self.checkpoints.save_error

    # --- submitting ----------------------------------------------------------------------------------
    def submit_text(self, text: str, stamp: float | None = None, *, pin: bool = False,
                    pose: Pose | None = None) -> Future:
        """Queue a message for the memory (`pin`: keep it ahead of what attention chooses; `pose`: where the robot
        was at `stamp`; see `KVStream.push_text`). The future gives its token count."""
        # Refused at the door: queued texts go into the model together, and one bad text would fail them all.
        try:
            text = checked_text(text, "text", self._board.settings.max_text_chars)
        except TextRefused as exc:
            return _failed(exc)
        try:
            check_stamp(stamp, "text")
        except ValueError as exc:
            return _failed(exc)
        with self._board.lock:
            self._check_open()
            full = self._board.work.text_room(self.max_pending_texts)
            if full:
                self.counters.texts_refused += 1
                return _failed(EngineBusyError(f"text queue full ({full}); message refused"))
            return self._enqueue(Job("text", text=(text, stamp, pin, pose)))

    def submit_frame(self, rgb: np.ndarray, stamp: float | None = None, *, pose: Pose | None = None,
                     camera: str = "") -> Future:
        """Queue a frame of `camera` (`KVStream.push_frame`); it replaces that camera's frame still waiting."""
        job = Job("frame", run=lambda s: s.push_frame(rgb, stamp, pose=pose, camera=camera),
                  frame=(rgb, stamp, pose, camera))
        with self._board.lock:
            self._check_open()
            replaced = self._board.work.offer_frame(job, camera)
            if replaced is not None:
                self.counters.frames_dropped += 1
                _fail(replaced.future, FrameDroppedError("a newer frame replaced this one"))
            self._board.lock.notify()
        return job.future

    def submit_ask(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
                   on_token=None, cancel: threading.Event | None = None, asked_at: float | None = None) -> Future:
        """Queue a question; `on_token`, `cancel` and `asked_at` as in KVStream.ask (on_token runs on the worker
        thread)."""
        try:
            question = checked_text(question, "question", self._board.settings.max_text_chars)
        except TextRefused as exc:
            with self._board.lock:
                self.counters.queries_failed += 1
            return _failed(exc)
        asked = Question(question, max_new_tokens, keep_in_memory, on_token, cancel, asked_at)
        # The question rides on the job as well: on a shared model it may go in beside others' (model_bench.py).
        return self._submit_query(lambda s: s.ask(asked.text, **asked.options()), question=asked)

    def submit_describe(self, prompt: str | None = None, *, max_new_tokens: int | None = None) -> Future:
        return self._submit_query(lambda s: s.describe(prompt, max_new_tokens=max_new_tokens))

    def submit_recall(self, text: str, *, limit: int = 5, since: float | None = None, until: float | None = None,
                      near: tuple[float, float, float] | None = None, camera: str = "") -> Future:
        """Queue a recall (`KVStream.recall`): the moments `text` points to most, as evidence, without an answer."""
        try:
            text = checked_text(text, "recall text", self._board.settings.max_text_chars)
        except TextRefused as exc:
            return _failed(exc)
        return self._submit_query(lambda s: s.recall(text, limit=limit, since=since, until=until, near=near,
                                                     camera=camera))

    def submit_reset(self) -> Future:
        with self._board.lock:
            self._check_open()
            return self._enqueue(Job("control", run=lambda s: s.reset()))

    def submit_save(self) -> Future:
        """Save the memory to `memory_file` now (after the job in progress); the future gives MemoryFileInfo."""
        if self.memory_file is None:
            return _failed(ValueError("no memory_file is set; nothing to save to"))
        with self._board.lock:
            if not self.ready.is_set():
                reason = self._board.closed_reason() if self._board.closed else "model is still loading"
                return _failed(EngineNotReadyError(reason))
            self._check_open()
            period = self._board.settings.checkpoint_period
            return self._enqueue(Job("control", run=lambda s: self.checkpoints.save(s, period)))

    def _submit_query(self, fn, question: Question | None = None) -> Future:
        with self._board.lock:
            if not self.ready.is_set():
                self.counters.queries_failed += 1
                reason = f"model failed to load: {self.load_error}" if self.load_error else "model is still loading"
                return _failed(EngineNotReadyError(reason))
            self._check_open()
            if self._board.work.queries >= self.max_pending_queries:
                self.counters.queries_failed += 1
                return _failed(EngineBusyError(
                    f"query queue full ({self.max_pending_queries} waiting); try again later"))
            future = self._enqueue(Job("query", run=fn, question=question))
        # A caller that gives up (cancels) frees its place at once, so dead questions never fill the queue.
        future.add_done_callback(self._withdraw_if_cancelled)
        return future

    def abandon(self, future: Future) -> bool:
        """The caller of a query stops waiting and tells its client the query failed. A query that has not
        started never runs; one that is running ends as it would, but is counted failed, never answered.
        Returns True if the engine counts it, False if it never ran (the caller counts its failure)."""
        if future.cancel():
            return False
        with self._board.lock:
            if future in self._board.counted:  # ended just now: counted already
                if self._board.counted[future]:
                    self.counters.queries_answered -= 1
                    self.counters.queries_failed += 1
            else:
                self._board.abandoned.add(future)
        return True

    def _withdraw_if_cancelled(self, future: Future) -> None:
        if not future.cancelled():
            return
        with self._board.lock:
            self._board.work.withdraw(future)

    def _enqueue(self, job: Job) -> Future:
        self._board.work.add(job)
        self._board.lock.notify()
        return job.future

    def _check_open(self) -> None:
        if self._board.closed:
            raise EngineNotReadyError(self._board.closed_reason())

    # --- blocking conveniences -----------------------------------------------------------------------
    def push_text(self, text: str, stamp: float | None = None, timeout: float | None = None, *,
                  pin: bool = False, pose: Pose | None = None) -> int:
        return self.submit_text(text, stamp, pin=pin, pose=pose).result(timeout)

    def push_frame(self, rgb: np.ndarray, stamp: float | None = None, timeout: float | None = None, *,
                   pose: Pose | None = None) -> int:
        return self.submit_frame(rgb, stamp, pose=pose).result(timeout)

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
    @property
    def settings(self) -> LiveSettings:
        """The live settings as last changed (the worker applies them before its next job)."""
        return self._board.settings

    def update_settings(self, **changes) -> LiveSettings:
        """Change live settings (fields of `LiveSettings`; `policy_settings`: the policy's knobs that change) in
        one step: checked whole, then handed to the worker, which applies them between two jobs, so that no
        job sees half of a change. A new checkpoint period makes the next save due that long from now.
        Raises ValueError for an unknown setting or a bad value: nothing changes then. Returns the new
        snapshot."""
        with self._board.lock:
            new = self._board.settings.changed(self.config, **changes)
            period_changed = new.checkpoint_period != self._board.settings.checkpoint_period
            self._board.settings = new
            if period_changed:
                self.checkpoints.schedule(new.checkpoint_period)
            self._board.lock.notify()  # the worker may be asleep until the previous due time
        return new

    def stats(self) -> StreamStats | None:
        """The stream's figures after the last finished job (None until the model is loaded)."""
        with self._board.lock:
            return self.worker.stats

    @property
    def pending(self) -> dict:
        with self._board.lock:
            work = self._board.work
            return {"texts": work.texts, "queries": work.queries, "frame": work.frame_waiting}

    @property
    def time_origin(self) -> float | None:
        """The caller's time of stream time 0 (`KVStream.time_origin`: saved with the memory, restored with
        it); None until the model is loaded or the caller sets it."""
        return None if self.worker.stream is None else self.worker.stream.time_origin

    @time_origin.setter
    def time_origin(self, seconds: float | None) -> None:
        if self.worker.stream is None:
            raise EngineNotReadyError("model is still loading")
        self.worker.stream.time_origin = seconds

    @property
    def preparation(self) -> dict[str, float]:
        """What loading prepared so that no question waits for it (retrieval heads, the first answer's parts), and
        the seconds each took; empty until the model is loaded."""
        return dict(self.worker.preparation)

    @property
    def pose_frame(self) -> str:
        """The frame of the poses kept with inputs (`KVStream.pose_frame`: saved with the memory); "" until the
        model is loaded or the caller sets it."""
        return "" if self.worker.stream is None else self.worker.stream.pose_frame

    @pose_frame.setter
    def pose_frame(self, frame_id: str) -> None:
        if self.worker.stream is None:
            raise EngineNotReadyError("model is still loading")
        self.worker.stream.pose_frame = frame_id

    @property
    def adapter(self) -> ModelAdapter | None:
        return None if self.worker.stream is None else self.worker.stream.adapter

    @property
    def closed(self) -> bool:
        """Closed: it takes no more work (see `close`)."""
        return self._board.closed

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop taking work, fail what is waiting, stop the current answer at its next token and a text being
        pushed at the end of its block (see KVStream), then wait up to `timeout` for the worker's last
        save. Whether the worker has ended (False: it is still inside the model)."""
        with self._board.lock:
            self._board.closed = True
            self.worker.request_stop()
            waiting = self._board.work.drain()
            self._board.lock.notify_all()
        for job in waiting:
            _fail(job.future, EngineNotReadyError(self._board.closed_reason()))
        thread = self.worker.thread
        if threading.current_thread() is not thread:
            thread.join(timeout)
        return not thread.is_alive() or threading.current_thread() is thread


def _fail(future: Future, exc: Exception) -> None:
    """Fail a future that may have been cancelled by its caller meanwhile (a timed-out query)."""
    if future.set_running_or_notify_cancel():
        future.set_exception(exc)


def _failed(exc: Exception) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future
