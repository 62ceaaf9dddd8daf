"""The engine's waiting work and the order the worker takes it in: `WorkQueue`.

Each time the worker is free it takes, in this order:

1. control (a reset or a save), at once;
2. the waiting camera frame, if it is due and no question waits: the previous job was not a frame and at
   least three quarters of `frame_period` have passed since the last frame was taken (`frame_period` 0:
   frames and other work alternate);
3. otherwise the oldest message: a question alone, or the texts waiting in a row before the next
   question, pushed together in one model call: all of them while a question waits; else up to about a
   cache's worth of characters, and while a camera is live one block of the model's until its speed is
   measured, then what the model takes, by its measured speed, in a quarter of a frame period or what a
   frame leaves of it;
4. otherwise the frame.

So a question sees every text submitted before it, and waits for the job in progress and one batch of those
texts; under a flood of texts a frame still goes in every `frame_period` seconds (a text call then lasts a
quarter of a period at most) or every other job, and under a camera faster than the model texts and
questions still get every other job. Frames are kept one deep: a frame that arrives while another waits
replaces it, so a camera faster than the model never builds a backlog.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .stream import KVStream


@dataclass
class Job:
    """Work for the model and the future its caller holds. A text job carries its message, (text, stamp,
    pin): texts go into the model in batches; every other job is a call on the stream."""

    kind: str  # "text", "query", "frame" or "control" (a reset, a save)
    run: Callable[[KVStream], object] | None = None
    text: tuple | None = None
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)


class WorkQueue:
    """Control jobs, messages (texts and questions in arrival order) and the newest frame, with the counts
    the bounds are checked against. Not thread-safe: the engine holds its lock around every call."""

    def __init__(self) -> None:
        self.control: deque[Job] = deque()  # resets and saves, first of all
        self.messages: deque[Job] = deque()  # texts and queries in arrival order
        self.frame: Job | None = None  # the newest frame only
        self.texts = 0  # texts waiting
        self.queries = 0  # questions waiting
        self.last_frame_taken = float("-inf")
        self.last_frame_offered = float("-inf")
        self.seconds_per_char: float | None = None  # the model's time per character of text, measured
        self.seconds_per_frame: float | None = None  # the model's time per frame, measured
        self.last_kind: str | None = None

    def __bool__(self) -> bool:
        return bool(self.control or self.messages or self.frame)

    def add(self, job: Job) -> Future:
        """Queue a text, question or control job (the caller checked the bounds)."""
        if job.kind == "control":
            self.control.append(job)
        else:
            self.messages.append(job)
            self.texts += job.kind == "text"
            self.queries += job.kind == "query"
        return job.future

    def offer_frame(self, job: Job) -> Job | None:
        """Make `job` the waiting frame; returns the frame it replaced, if any."""
        self.last_frame_offered = time.monotonic()
        replaced, self.frame = self.frame, job
        return replaced

    def withdraw(self, future: Future) -> bool:
        """Take a waiting question out (its caller gave up); False if it is not waiting."""
        for i, queued in enumerate(self.messages):
            if queued.future is future:
                del self.messages[i]
                self.queries -= 1
                return True
        return False

    def drain(self) -> list[Job]:
        """Everything waiting, taken out (the engine is closing)."""
        waiting = list(self.control) + list(self.messages) + ([self.frame] if self.frame else [])
        self.control.clear()
        self.messages.clear()
        self.texts = self.queries = 0
        self.frame = None
        return waiting

    def took_texts(self, chars: int, seconds: float) -> None:
        """The model took `chars` characters of text in `seconds`: its measured speed (a moving average)."""
        self.seconds_per_char = _moving_average(self.seconds_per_char, seconds / max(chars, 1))

    def took_frame(self, seconds: float) -> None:
        """The model took a frame in `seconds` (a moving average)."""
        self.seconds_per_frame = _moving_average(self.seconds_per_frame, seconds)

    def text_batch_chars(self, now: float, frame_period: float, capacity: int, block: int) -> int:
        """The most characters of text one model call takes: a cache's worth (4 characters a token), and while a
        camera is live (a frame offered within two frame periods) one `block`'s worth until the model's speed is
        measured (a first batch of a cache's worth held frames and a question for seconds under a flood), then
        what the model takes, by its measured speed, in a quarter of a frame period, or in what a frame leaves of
        a period where that is less (a tenth at least). A frame that comes while texts go in waits at most that: its
        turn comes every period however many texts wait, even when the frames reach the queue out of step with the
        worker's period."""
        limit = 4 * capacity
        if frame_period > 0 and now - self.last_frame_offered <= 2 * frame_period:
            if self.seconds_per_char is None:
                return max(4 * min(block, capacity), 1)
            left = frame_period - (self.seconds_per_frame or 0.0)
            seconds = max(min(left, 0.25 * frame_period), 0.1 * frame_period)
            limit = min(limit, int(seconds / self.seconds_per_char))
        return max(limit, 1)

    def next_jobs(self, frame_period: float, capacity: int, block: int) -> list[Job]:
        """The next job, or the batch of texts that go in together (see the module docstring)."""
        if self.control:
            return [self.control.popleft()]
        now = time.monotonic()
        # Due after three quarters of a period: frames that a rate gate upstream (the node's frame_rate) lets
        # through once a period reach the queue out of step with the worker, and a whole period here would
        # hold some of them for another text call, slowing frames below the rate.
        frame_due = self.last_kind != "frame" and now - self.last_frame_taken >= 0.75 * frame_period
        # A waiting question goes before the frame, and the texts ahead of it go in as one batch: it waits for
        # the job in progress and one batch, not for a backlog taken a quarter period at a time between frames.
        if self.frame is not None and (not self.messages or (frame_due and not self.queries)):
            job, self.frame = self.frame, None
            self.last_frame_taken, self.last_kind = now, "frame"
            return [job]
        if self.messages[0].kind == "query":
            self.queries -= 1
            self.last_kind = "query"
            return [self.messages.popleft()]
        # Waiting texts go in together, so that a long backlog does not hold a question or a frame for many
        # blocks of the model.
        batch, chars = [], 0
        limit = self.text_batch_chars(now, frame_period, capacity, block) if not self.queries else float("inf")
        while self.messages and self.messages[0].kind == "text" and (not batch or chars < limit):
            chars += len(self.messages[0].text[0])
            batch.append(self.messages.popleft())
        self.texts -= len(batch)
        self.last_kind = "text"
        return batch


def _moving_average(average: float | None, sample: float) -> float:
    return sample if average is None else 0.7 * average + 0.3 * sample
