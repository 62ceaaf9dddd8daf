"""The engine's worker thread: it loads the model, then takes jobs in the work queue's order (work_queue.py),
applies a new snapshot of the live settings between two jobs, pushes texts in batches and keeps the figures
`stats()` gives, and saves the memory when a checkpoint is due.

`WorkBoard` is what the engine's callers (engine.py) and the worker share, under one lock; `EngineWorker` owns
the thread, the stream and the figures taken after each job.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..answering import StreamStoppedError
from ..models.loading import use_torch_threads
from .model_bench import LeftWork, ModelBench
from .model_turns import ModelTurns
from .stream import KVStream, OpenAnswer, StreamStats
from .together import answer_alone
from ..stream_config import StreamConfig
from .work_queue import WorkQueue

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .checkpoints import Checkpointer
    from .live_settings import LiveSettings
    from .work_queue import Job


@dataclass
class EngineCounters:
    """What the engine counts as it runs: refusals, drops, answers, failed saves, the longest text wait."""

    frames_dropped: int = 0
    texts_refused: int = 0
    queries_answered: int = 0
    queries_failed: int = 0
    checkpoints_failed: int = 0
    longest_text_wait_s: float = 0.0  # from a text's submission to the start of the model call that takes it


@dataclass
class WorkBoard:
    """What the engine's callers and its worker share, read and written under `lock` (the worker waits on it):
    the work waiting, the live settings as last changed, whether the engine is closed, the figures counted, and
    whether the model is ready (or why it failed to load)."""

    settings: LiveSettings
    lock: threading.Condition = field(default_factory=threading.Condition)
    work: WorkQueue = field(default_factory=WorkQueue)
    counters: EngineCounters = field(default_factory=EngineCounters)
    ready: threading.Event = field(default_factory=threading.Event)
    closed: bool = False
    load_error: Exception | None = None
    abandoned: set[Future] = field(default_factory=set)  # running queries whose callers were told they failed
    # Each finished query's future: whether it was counted answered (held no longer than its caller holds it).
    counted: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def closed_reason(self) -> str:
        return f"model failed to load: {self.load_error}" if self.load_error else "engine is closed"

    def count_query(self, future: Future, ok: bool) -> None:
        """Count a finished query once, before its caller can see the result (see `StreamingEngine.abandon`)."""
        with self.lock:
            answered = ok and future not in self.abandoned
            self.abandoned.discard(future)
            self.counted[future] = answered
            if answered:
                self.counters.queries_answered += 1
            else:
                self.counters.queries_failed += 1


class EngineWorker:
    """The thread that runs the model for one engine.

    board: shared with the engine's callers. loader: gives the model adapter (called on the thread). config: the
    stream's settings as made (the live ones come from the board). checkpoints: the memory file. on_ingested: told
    "text" or "frame" after an input went in. on_load_failed: called once if the model cannot be loaded (the engine
    closes). torch_threads: torch's threads on this thread (0: torch's default). turns: the model's, where other
    engines share it (model_turns.py): each job runs in a turn of its own. bench: where other engines share the
    model, the place their inputs and questions go through it together (model_bench.py; its turns are the model's).
    """

    def __init__(self, board: WorkBoard, loader: Callable, config: StreamConfig, checkpoints: Checkpointer, *,
                 on_ingested: Callable[[str], None] | None = None, on_load_failed: Callable[[], None],
                 torch_threads: int = 0, turns: ModelTurns | None = None, bench: ModelBench | None = None):
        self.board, self.config, self.checkpoints = board, config, checkpoints
        if bench is not None:
            turns = bench.turns
        self.turns = turns if turns is not None else ModelTurns()  # shared with the other engines on the model
        self.bench = bench
        # Whether a question, and whether an input, of this engine waits: read by the other engines' workers, without
        # the board's lock (a hint for batching, never a decision about this engine's work).
        self.seat = None if bench is None else bench.seat(lambda: board.work.queries > 0,
                                                          lambda: board.work.texts > 0 or board.work.frame_waiting)
        self.on_ingested, self.on_load_failed, self.torch_threads = on_ingested, on_load_failed, torch_threads
        self.stream: KVStream | None = None
        self.stats: StreamStats | None = None  # the stream's figures after the last finished job (under the lock)
        self._applied: LiveSettings | None = None  # the live settings the stream has
        # Seconds spent while loading on what the first answer would otherwise wait for, by part (see `_run`).
        self.preparation: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, args=(loader,), name="inf_mllm_engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def request_stop(self) -> None:
        """Stop the stream's current job at its next token or block (`KVStream.request_stop`); from any thread."""
        if self.stream is not None:
            self.stream.request_stop()

    def _run(self, loader) -> None:
        try:
            self._serve(loader)
        finally:  # the other engines' answers no longer wait for this one's questions, whatever ended it
            if self.bench is not None:
                self.bench.leave(self.seat)

    def _serve(self, loader) -> None:
        board = self.board
        use_torch_threads(self.torch_threads)
        try:
            adapter = loader()
            with self.turns.turn():  # what follows runs the model
                with board.lock:  # with the settings changed while it loaded
                    self._applied = board.settings
                    self.stream = KVStream(adapter, self._applied.stream_config(self.config))
                if self.stream.archive.enabled:
                    start = time.monotonic()
                    self.stream.retrieval_heads()  # found (or read) while loading, so that no question waits for them
                    self.preparation["retrieval_heads"] = time.monotonic() - start
                if self.checkpoints.memory_file is not None:
                    self.checkpoints.restore(self.stream, self._applied.checkpoint_period)
                self._prepare_first_answer()
            # The stream that found the retrieval heads is garbage in a reference cycle: freed now, not at some
            # later collection, so that the resident memory after loading is the memory's own.
            gc.collect()
            self._snapshot_stats()
            if self.checkpoints.memory_file is not None:  # the first checkpoint a period after the memory is ready
                self.checkpoints.schedule(self._applied.checkpoint_period)
            board.ready.set()
        except Exception as exc:  # reported through load_error and every later query
            board.load_error = exc
            self.on_load_failed()
            return
        while True:
            with board.lock:
                while not (board.closed or board.work):
                    if self.checkpoints.due:
                        break
                    board.lock.wait(min(self.checkpoints.next_due - time.monotonic(), 3600.0))
                if board.closed:
                    break
            # The jobs are taken once the model is this worker's: what came while another stream had it is in them.
            left = None
            with self.turns.turn():
                with board.lock:
                    if board.closed:
                        break
                    settings = board.settings
                    # On a shared model another memory's question may come during a text call and wait for it.
                    shared = self.bench is not None and self.bench.shared
                    jobs = (board.work.next_jobs(self.config.capacity, self.config.chunk_size, settings.frame_period,
                                                 settings.max_text_delay, shared) if board.work else [])
                try:
                    left = self._take(jobs, settings)
                except Exception as exc:  # the worker's own bookkeeping, not a job, failed: it must not end it
                    self._recovered(jobs, exc)
            if left is not None:  # done beside other engines' work, in a turn of the bench's
                try:
                    self._collect(*left)
                except Exception as exc:
                    self._recovered(left[0], exc)
        if self.checkpoints.memory_file is not None:
            with self.turns.turn():
                self.checkpoint(wait=True)  # the last save, after the job that close() stopped or let finish

    def _prepare_first_answer(self) -> None:
        """After the model and the memory are loaded: what the first answer would build on first use (the static
        steps compiled, the answering path's first calls), built and discarded with the memory left as it was
        (`KVStream.prepare_first_answer`), so that the first question waits no longer than any other. Its parts'
        seconds go into `preparation` and the log; a failure costs only that wait."""
        start = time.monotonic()
        try:
            parts = self.stream.prepare_first_answer()
        except StreamStoppedError:  # closed while loading: no answer will follow
            return
        except Exception:  # the first answer then builds what it needs itself
            log.exception("preparing the first answer failed; the first answer builds what it needs itself")
            return
        self.preparation.update({f"first_answer_{name}": seconds for name, seconds in parts.items()})
        self.preparation["first_answer"] = time.monotonic() - start
        log.info("prepared before the first answer: " + ", ".join(f"{name} {seconds:.2f} s"
                                                                   for name, seconds in self.preparation.items()))

    @staticmethod
    def _recovered(jobs: list[Job], exc: Exception) -> None:
        log.exception("the engine's worker recovered from an error between jobs")
        for job in jobs:  # every caller still waiting hears why
            future = job.future
            if not future.done() and (future.running() or future.set_running_or_notify_cancel()):
                future.set_exception(exc)

    def _take(self, jobs: list[Job], settings: LiveSettings) -> tuple[list[Job], LeftWork] | None:
        """Apply new live settings, then run the jobs taken (or a due checkpoint, when none). Returns the jobs and their
        work where that was left on the bench, to be collected after this turn."""
        if settings is not self._applied:
            self._apply(settings)
        if not jobs:  # a checkpoint is due and nothing waits
            self.checkpoint()
            return None
        kind = jobs[0].kind
        bench = self.bench
        asks = jobs[0].question is not None
        if bench is not None and bench.shared and (kind in ("text", "frame") or asks):
            if bench.others_waiting(self.seat, asks):
                return self._leave_on_bench(jobs)
            if jobs[0].question is not None:
                return self._open_for_bench(jobs[0])
        ok = self._run_texts(jobs) if kind == "text" else self._run_job(jobs[0])
        # Only an input that went in changed the memory (a description of an unchanged one is skipped).
        if ok and self.on_ingested is not None and kind in ("text", "frame"):
            self.on_ingested(kind)
        if self.checkpoints.due:
            self.checkpoint()
        return None

    def _leave_on_bench(self, jobs: list[Job]) -> tuple[list[Job], LeftWork] | None:
        """An input or a question left on the bench as its steps (`KVStream.text_steps`, `frame_steps`,
        `answer_steps`), to go through the model with the other engines' work."""
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not live:
            return None
        stream, first = self.stream, live[0]
        if first.kind == "text":
            self._count_text_wait(live)
            return live, self.bench.put(self.seat, stream, stream.text_steps([job.text for job in live]))
        if first.kind == "frame":
            rgb, stamp, pose, camera = first.frame
            return live, self.bench.put(self.seat, stream, stream.frame_steps(rgb, stamp, pose=pose, camera=camera))
        question = first.question
        steps = stream.answer_steps(question.text, **question.options())
        return live, self.bench.put(self.seat, stream, steps, question)

    def _open_for_bench(self, job: Job) -> tuple[list[Job], LeftWork] | None:
        """A question with nothing waiting beside it, opened in its turn (`KVStream.open_answer`). Its answer is left
        on the bench where another engine's work came meanwhile, else answered here, as `ask` would (so too where it
        cannot be decoded apart, a kept answer too long for the headroom, or fails to open)."""
        if not job.future.set_running_or_notify_cancel():
            return None
        question, stream = job.question, self.stream
        try:
            answer = stream.open_answer(question.text, **question.options())
            if answer is None:
                answer = stream.ask(question.text, **question.options())
        except Exception as exc:
            self._finish(job, exc, False)
            return None
        if isinstance(answer, OpenAnswer):
            if self.bench.others_waiting(self.seat, True):
                return [job], self.bench.put_opened(self.seat, stream, answer)
            answer = answer_alone(stream, answer)
        self._finish(job, answer, not isinstance(answer, BaseException))
        if self.checkpoints.due:  # answered here; one left open is saved after it is closed
            self.checkpoint()
        return None

    def _collect(self, jobs: list[Job], left: LeftWork) -> None:
        """Work left on the bench, done beside other engines' (in a turn of the bench's); its callers hear how it
        went, as from a job run in its own turn."""
        try:
            outcome, ok = self.bench.collect(left), True
        except BaseException as exc:  # whatever ended the work is its callers', not the end of this worker
            outcome, ok = exc, False
        kind = jobs[0].kind
        if kind == "text":
            if ok:  # the batch's time: what a question of this memory waited for beside this call
                self._took_texts(jobs, outcome, left.seconds)
            self._finish_texts(jobs, outcome, ok)
        else:
            self._finish(jobs[0], outcome, ok)
        if ok and self.on_ingested is not None and kind in ("text", "frame"):
            self.on_ingested(kind)
        if self.checkpoints.due:  # the memory as the work left it
            with self.turns.turn():
                self.checkpoint()

    def _finish(self, job: Job, outcome, ok: bool) -> None:
        """A job's outcome to its caller, the stream's figures taken first and a query counted."""
        self._snapshot_stats()
        if job.kind == "query":
            self.board.count_query(job.future, ok)
        (job.future.set_result if ok else job.future.set_exception)(outcome)

    def checkpoint(self, *, wait: bool = False) -> None:
        """Save the memory if it changed: copied on this thread, between jobs, and written on the writer's (here
        too with `wait`)."""
        if not self.checkpoints.checkpoint(self.stream, self.board.settings.checkpoint_period, wait=wait):
            with self.board.lock:
                self.board.counters.checkpoints_failed += 1

    def _apply(self, settings: LiveSettings) -> None:
        """Give the stream a new snapshot of the live settings (between jobs)."""
        stream, before = self.stream, self._applied
        for name, value in settings.policy_settings.items():
            if before.policy_settings.get(name) != value:
                stream.set_policy_knob(name, value)
        stream.reconfigure(**settings.stream_part)
        self._applied = settings

    def _run_job(self, job: Job) -> bool:
        """A frame, a question or a control job; its future gets the outcome. False if it did not run or failed."""
        if not job.future.set_running_or_notify_cancel():
            return False
        try:
            outcome, ok = job.run(self.stream), True
        except Exception as exc:  # the caller gets the reason (a prompt that failed part-way in, out of memory
            # say, leaves the blocks that went in: a message cut short)
            outcome, ok = exc, False
        self._finish(job, outcome, ok)
        return ok

    def _run_texts(self, batch: list[Job]) -> bool:
        """Push a batch of texts in one model call; each future gets its own token count. False if none
        went in."""
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if not live:
            return False
        self._count_text_wait(live)
        start = time.monotonic()
        try:
            counts, ok = self.stream.push_texts([job.text for job in live]), True
        except Exception as exc:  # every caller gets the reason (see _run_job on a prompt failed part-way in)
            counts, ok = exc, False
        if ok:
            self._took_texts(live, counts, time.monotonic() - start)
        self._finish_texts(live, counts, ok)
        return ok

    def _count_text_wait(self, live: list[Job]) -> None:
        counters = self.board.counters
        waited = time.monotonic() - min(job.submitted for job in live)
        counters.longest_text_wait_s = max(counters.longest_text_wait_s, waited)

    def _took_texts(self, live: list[Job], counts: list[int], seconds: float) -> None:
        with self.board.lock:  # the model's pace, which bounds the next calls
            self.board.work.took_texts(sum(len(job.text[0]) for job in live), sum(counts), seconds,
                                       self.config.chunk_size)

    def _finish_texts(self, live: list[Job], outcome, ok: bool) -> None:
        """Each text's token count (or what failed them all) to its caller, the stream's figures taken first."""
        self._snapshot_stats()
        for i, job in enumerate(live):
            if ok:
                job.future.set_result(outcome[i])
            else:
                job.future.set_exception(outcome)

    def _snapshot_stats(self) -> None:
        """Take the figures `stats()` gives before any caller hears that a job ended, so that one who
        reads them next (a reset's caller publishing stats) never sees the memory as it was before."""
        with self.board.lock:
            self.stats = self.stream.stats()
