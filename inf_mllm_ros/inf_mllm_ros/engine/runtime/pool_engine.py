"""A pool's streams behind one worker thread, served round by round so that no stream starves another.

Each stream's work waits in a `WorkQueue` of its own (work_queue.py: the rules one stream has; questions first, a
frame one deep per camera, texts in calls bounded by the model's measured pace and `max_text_delay` while a question
waits). The worker serves the streams in rounds: in each round every stream with work gives up its next job; the
questions among them go through the model first, together (`StreamPool.ask_together`: their answers decoded as one
batch), then the other streams' input jobs, one per stream, the texts together and then the frames together (their
blocks batched where they fit one pass: `StreamPool.push_texts_together`). A stream flooded with texts thus takes one
text call a round, and another stream's question waits at most for the job in progress when it came and its own
answer in the batch.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np

from ..poses import Pose
from .pool import Question, StreamPool
from .work_queue import Job, WorkQueue


class PoolEngine:
    """The streams of `pool` fed from any thread; one worker thread runs the model. `frame_period` and
    `max_text_delay` as for one stream (engine/runtime/work_queue.py)."""

    def __init__(self, pool: StreamPool, *, max_text_delay: float = 0.25, frame_period: float = 0.0):
        self.pool, self.max_text_delay, self.frame_period = pool, max_text_delay, frame_period
        self.queues = {name: WorkQueue() for name in pool}
        self.lock = threading.Condition()
        self.closed = False
        self.rounds = 0  # rounds served
        self.thread = threading.Thread(target=self._run, name="inf_mllm_pool", daemon=True)
        self.thread.start()

    # --- callers ---------------------------------------------------------------------------------------
    def submit_text(self, name: str, text: str, stamp: float | None = None, *, pin: bool = False,
                    pose: Pose | None = None) -> Future:
        """A text for stream `name`; the future gets its token count."""
        return self._add(name, Job("text", text=(text, stamp, pin, pose)))

    def submit_frame(self, name: str, rgb: np.ndarray, stamp: float | None = None, *, pose: Pose | None = None,
                     camera: str = "") -> Future:
        """A frame for stream `name` (it replaces a frame of its camera still waiting, whose future is cancelled)."""
        job = Job("frame", frame=(rgb, stamp, pose, camera))
        with self.lock:
            self._check_open(name)
            replaced = self.queues[name].offer_frame(job, camera)
            self.lock.notify_all()
        if replaced is not None:
            replaced.future.cancel()
        return job.future

    def submit_ask(self, name: str, question: Question | str) -> Future:
        """A question for stream `name`; the future gets its `Answer` (or the exception that ended it)."""
        question = Question(question) if isinstance(question, str) else question
        return self._add(name, Job("query", question=question))

    def close(self, timeout: float | None = None) -> None:
        """Stop after the round in progress; every job still waiting is cancelled."""
        with self.lock:
            self.closed = True
            waiting = [job for queue in self.queues.values() for job in queue.drain()]
            self.lock.notify_all()
        for job in waiting:
            job.future.cancel()
        self.thread.join(timeout)

    def _check_open(self, name: str) -> None:
        if self.closed:
            raise RuntimeError("engine is closed")
        if name not in self.queues:
            raise KeyError(f"no stream {name!r} in the pool (streams: {', '.join(self.queues)})")

    def _add(self, name: str, job: Job) -> Future:
        with self.lock:
            self._check_open(name)
            self.queues[name].add(job)
            self.lock.notify_all()
        return job.future

    # --- the worker ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.closed and not any(self.queues.values()):
                    self.lock.wait()
                if self.closed:
                    return
                # Another stream's question may come during a text call and wait for it: calls bounded as for one.
                taken = {name: queue.next_jobs(self.pool[name].config.capacity, self.pool[name].config.chunk_size,
                                               self.frame_period, self.max_text_delay, len(self.pool) > 1)
                         for name, queue in self.queues.items() if queue}
            questions = {name: jobs[0] for name, jobs in taken.items() if jobs[0].kind == "query"}
            self._answer(questions)
            self._take({name: jobs for name, jobs in taken.items() if jobs[0].kind == "text"})
            self._take({name: jobs for name, jobs in taken.items() if jobs[0].kind == "frame"})
            self.rounds += 1

    def _answer(self, jobs: dict[str, Job]) -> None:
        live = {name: job for name, job in jobs.items() if job.future.set_running_or_notify_cancel()}
        if not live:
            return
        try:
            answers = self.pool.ask_together({name: job.question for name, job in live.items()})
        except Exception as exc:  # the batch itself failed: every caller hears why
            answers = {name: exc for name in live}
        for name, job in live.items():
            outcome = answers[name]
            (job.future.set_exception if isinstance(outcome, BaseException) else job.future.set_result)(outcome)

    def _take(self, taken: dict[str, list[Job]]) -> None:
        """Each stream's input job of the round (all texts, or all frames), their blocks batched where they fit
        (`StreamPool.push_texts_together`, `push_frames_together`); each future gets its token count."""
        live = {name: [job for job in jobs if job.future.set_running_or_notify_cancel()]
                for name, jobs in taken.items()}
        live = {name: jobs for name, jobs in live.items() if jobs}
        if not live:
            return
        texts = next(iter(live.values()))[0].kind == "text"
        start = time.monotonic()
        try:
            if texts:
                outcomes = self.pool.push_texts_together({name: [job.text for job in jobs]
                                                          for name, jobs in live.items()})
            else:
                outcomes = self.pool.push_frames_together({name: jobs[0].frame for name, jobs in live.items()})
        except Exception as exc:  # the round itself failed: every caller hears why
            outcomes = {name: exc for name in live}
        seconds = time.monotonic() - start
        for name, jobs in live.items():
            outcome = outcomes[name]
            if isinstance(outcome, BaseException):
                for job in jobs:
                    job.future.set_exception(outcome)
                continue
            counts = outcome if texts else [outcome]
            if texts:  # the pace of this stream's calls: the round's time, which is what its next call waits for
                with self.lock:
                    self.queues[name].took_texts(sum(len(job.text[0]) for job in jobs), sum(counts), seconds,
                                                 self.pool[name].config.chunk_size)
            for job, n in zip(jobs, counts):
                job.future.set_result(n)


__all__ = ["PoolEngine"]
