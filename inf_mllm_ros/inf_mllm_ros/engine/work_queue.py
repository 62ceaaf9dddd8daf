"""The engine's waiting work and the order the worker takes it in: `WorkQueue`.

Each time the worker is free it takes, in this order:

1. control (a reset or a save), at once;
2. the waiting camera frame, unless the previous job was a frame or a question waits;
3. otherwise the oldest message: a question alone, or the texts waiting in a row before the next question,
   pushed together in one model call: all of them while a question waits; else, while a camera is live, what the
   model takes at its measured pace in what a frame leaves of `frame_period` (a quarter of it at least), and
   always at least one block's worth of tokens (a call has a cost of its own beside its length: fewer would
   only slow the model down); else up to about a cache's worth of characters;
4. otherwise the frame.

Which frames come is decided once, before the queue (the node's `frame_rate` gate); here a waiting frame waits for
one other job at most, and `frame_period` only bounds how long that job may be. The texts that may wait are bounded
in number and in the model's time (`text_room`, `max_text_delay`), so a question sees every text taken before it
and waits for the job in progress and one batch of them. Frames are kept one deep: a frame that arrives while
another waits replaces it, so a camera faster than the model never builds a backlog.
"""

from __future__ import annotations

import math
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
        self.text_chars = 0  # their characters
        self.queries = 0  # questions waiting
        self.last_frame_offered = float("-inf")
        self.seconds_per_block: float | None = None  # the model's time per block of text, measured
        self.chars_per_token = 4.0  # of the texts taken, measured (a short message with its turn's markers: about 2)
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
            self.text_chars += len(job.text[0]) if job.kind == "text" else 0
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
        self.texts = self.text_chars = self.queries = 0
        self.frame = None
        return waiting

    def took_texts(self, chars: int, tokens: int, seconds: float, block: int) -> None:
        """The model took `chars` characters of text, `tokens` tokens, in `seconds`: its measured pace (moving
        averages), by the block, as a call has a cost of its own beside its length (docs/node.md, "Order of work")."""
        self.seconds_per_block = _moving_average(self.seconds_per_block, seconds / max(math.ceil(tokens / block), 1))
        if tokens:
            self.chars_per_token = _moving_average(self.chars_per_token, chars / tokens)

    def block_chars(self, block: int) -> int:
        """Characters of text in one block of tokens, as measured: no call is made shorter."""
        return max(int(block * self.chars_per_token), 1)

    def took_frame(self, seconds: float) -> None:
        """The model took a frame in `seconds` (a moving average)."""
        self.seconds_per_frame = _moving_average(self.seconds_per_frame, seconds)

    def text_call_chars(self, capacity: int, block: int, frame_period: float) -> float:
        """The most characters of text one model call takes (see the module docstring, 3)."""
        if self.queries:
            return float("inf")
        limit = 4 * capacity
        per_block = self.block_chars(min(block, capacity))
        camera_live = frame_period > 0 and time.monotonic() - self.last_frame_offered <= 2 * frame_period
        if camera_live and self.seconds_per_block is not None:
            seconds = max(frame_period - (self.seconds_per_frame or 0.0), 0.25 * frame_period)
            limit = min(limit, int(seconds / self.seconds_per_block) * per_block)
        return max(limit, per_block)

    def text_room(self, chars: int, max_texts: int, max_delay: float, block: int) -> str | None:
        """Why a text of `chars` characters cannot wait now, or None: `max_texts` wait already, or with it the waiting
        texts would take the model longer than `max_delay` seconds at its measured pace (0, or not yet measured: no
        time bound). One block's worth of text may always wait (`block_chars`)."""
        if self.texts >= max_texts:
            return f"{max_texts} waiting"
        if max_delay <= 0 or self.seconds_per_block is None:
            return None
        blocks = math.ceil((self.text_chars + chars) / self.block_chars(block))
        if blocks > 1 and blocks * self.seconds_per_block > max_delay:
            waiting_s = math.ceil(self.text_chars / self.block_chars(block)) * self.seconds_per_block
            return f"{self.texts} waiting, {waiting_s:.1f} s of the model's time"
        return None

    def next_jobs(self, capacity: int, block: int, frame_period: float = 0.0) -> list[Job]:
        """The next job, or the batch of texts that go in together (see the module docstring)."""
        if self.control:
            return [self.control.popleft()]
        # A waiting question goes before the frame, and the texts ahead of it go in as one batch first.
        if self.frame is not None and (not self.messages or (self.last_kind != "frame" and not self.queries)):
            job, self.frame = self.frame, None
            self.last_kind = "frame"
            return [job]
        if self.messages[0].kind == "query":
            self.queries -= 1
            self.last_kind = "query"
            return [self.messages.popleft()]
        batch, chars = [], 0
        limit = self.text_call_chars(capacity, block, frame_period)
        while self.messages and self.messages[0].kind == "text" and (not batch or chars < limit):
            chars += len(self.messages[0].text[0])
            batch.append(self.messages.popleft())
        self.texts -= len(batch)
        self.text_chars -= chars
        self.last_kind = "text"
        return batch


def _moving_average(average: float | None, sample: float) -> float:
    return sample if average is None else 0.7 * average + 0.3 * sample
