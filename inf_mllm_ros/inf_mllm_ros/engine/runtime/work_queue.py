"""The engine's waiting work and the order the worker takes it in: `WorkQueue`.

Each time the worker is free it takes, in this order:

1. control (a reset or a save), at once;
2. a waiting camera frame (the camera that has waited longest first), unless the previous job was a frame and texts
   wait, or a question waits;
3. otherwise the oldest message: a question alone, or the texts waiting in a row before the next question,
   pushed together in one model call: while a question waits, those ahead of it up to `max_text_delay` of the
   model's time at its measured pace (all of them with no bound), and then the question goes ahead of the rest;
   else, while a camera is live, what the model takes at its measured pace in `FRAME_PERIOD_SHARE` of the time
   until the next frame is due (`frame_period` after the last one of a camera came, the soonest of the cameras
   live); else up to about a cache's worth of
   characters. A call is one block until the pace is measured (bounded in tokens from the first call), and never
   less than one block's worth of tokens (a call has a cost of its own beside its length: fewer would only slow
   the model down). On a model shared by several memories every call is bounded as while a question waits: another
   memory's question, which may come at any moment, waits for the call in progress (`shared_model`:
   engine/runtime/model_bench.py);
4. otherwise the frame.

Which frames come is decided once, before the queue (the node's `frame_rate` gate); here a waiting frame waits for
one other job at most, and `frame_period` only bounds how long that job may be. Texts wait in number only
(`max_texts` in `text_room`): a question waits for the job in progress and one batch of the texts ahead of it, and
sees every text taken before it unless the model is more than `max_text_delay` behind them; those it overtook go
in right after its answer, with their own stamps, so a slow model delays texts but loses none below the bound.
Frames are kept one deep per camera: a frame that arrives while another of its camera waits replaces it, so a
camera faster than the model never builds a backlog, and one camera never takes another's place.
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


# The share of the time until the next frame is due that a text call aims at while a camera is live: a call's time
# varies by a tenth around the measured pace. A call that runs past the frame's time delays it, and a frame and a
# call that together took longer than the period (measured in one process under the flood of testing/flood.py: by
# 0.07 to 0.1 s a cycle) fell further behind each period, until a frame was replaced while it waited.
FRAME_PERIOD_SHARE = 0.9
# Characters a token until a text call measures them: the first call's length in tokens is only this guess, so it
# is taken as measured from then on rather than averaged with it (a short message with its turn's markers: about 2).
ASSUMED_CHARS_PER_TOKEN = 4.0


@dataclass
class Job:
    """Work for the model and the future its caller holds. A text job carries its message, (text, stamp,
    pin): texts go into the model in batches; every other job is a call on the stream."""

    kind: str  # "text", "query", "frame" or "control" (a reset, a save)
    run: Callable[[KVStream], object] | None = None
    text: tuple | None = None
    # A frame as (rgb, stamp, pose, camera), where it may go in batched with others' (pool_engine.py, model_bench.py).
    frame: tuple | None = None
    # A question with its options, where its answer may be decoded in a batch: a pool's (pool_engine.py) or a shared
    # model's (model_bench.py).
    question: object | None = None
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)


class WorkQueue:
    """Control jobs, messages (texts and questions in arrival order) and each camera's newest frame, with the
    counts the bounds are checked against. Not thread-safe: the engine holds its lock around every call."""

    def __init__(self) -> None:
        self.control: deque[Job] = deque()  # resets and saves, first of all
        self.messages: deque[Job] = deque()  # texts and queries in arrival order
        self.frames: dict[str, Job] = {}  # each camera's newest frame, the one that has waited longest first
        self.texts = 0  # texts waiting
        self.text_chars = 0  # their characters
        self.queries = 0  # questions waiting
        self.frame_offered: dict[str, float] = {}  # when each camera's last frame came (time.monotonic)
        self.seconds_per_block: float | None = None  # the model's time per block of text, measured
        # Of the texts taken, measured; None before the first call (ASSUMED_CHARS_PER_TOKEN).
        self.chars_per_token: float | None = None
        self.last_kind: str | None = None

    def __bool__(self) -> bool:
        return bool(self.control or self.messages or self.frames)

    @property
    def frame_waiting(self) -> bool:
        return bool(self.frames)

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

    def offer_frame(self, job: Job, camera: str = "") -> Job | None:
        """Make `job` the waiting frame of `camera`; returns the frame of that camera it replaced, if any (it keeps
        its camera's place in the order)."""
        self.frame_offered[camera] = time.monotonic()
        replaced = self.frames.get(camera)
        self.frames[camera] = job
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
        waiting = list(self.control) + list(self.messages) + list(self.frames.values())
        self.control.clear()
        self.messages.clear()
        self.texts = self.text_chars = self.queries = 0
        self.frames.clear()
        return waiting

    def took_texts(self, chars: int, tokens: int, seconds: float, block: int) -> None:
        """The model took `chars` characters of text, `tokens` tokens, in `seconds`: its measured pace (moving
        averages), by the block, as a call has a cost of its own beside its length (docs/node.md, "Order of work")."""
        self.seconds_per_block = _moving_average(self.seconds_per_block, seconds / max(math.ceil(tokens / block), 1))
        if tokens:
            self.chars_per_token = _moving_average(self.chars_per_token, chars / tokens)

    def block_chars(self, block: int) -> int:
        """Characters of text in one block of tokens, as measured: no call is made shorter."""
        return max(int(block * (self.chars_per_token or ASSUMED_CHARS_PER_TOKEN)), 1)

    def text_call_chars(self, capacity: int, block: int, frame_period: float, max_delay: float = 0.0,
                        shared_model: bool = False) -> float:
        """The most characters of text one model call takes (see the module docstring, 3). `shared_model`: other
        memories use the model (engine/runtime/model_bench.py); a question of theirs, which may come at any moment,
        waits for this call as one of this memory's own would."""
        per_block = self.block_chars(min(block, capacity))
        if self.queries and max_delay <= 0:
            return float("inf")
        asking = bool(self.queries) or (shared_model and max_delay > 0)
        now = time.monotonic()
        live = [offered for offered in self.frame_offered.values() if now - offered <= 2 * frame_period]
        camera_live = frame_period > 0 and bool(live)
        if self.seconds_per_block is None:  # the pace not measured yet: bounded in tokens from the first call
            return per_block if asking or camera_live else max(4 * capacity, per_block)
        if asking:
            return max(int(max_delay / self.seconds_per_block), 1) * per_block
        limit = 4 * capacity
        if camera_live:
            # Until the next frame is due (one comes each period), by the clock: a call that ran long leaves the
            # next one less, so the frames keep their period rather than drift behind it.
            seconds = FRAME_PERIOD_SHARE * (min(live) + frame_period - now)
            limit = min(limit, int(seconds / self.seconds_per_block) * per_block)
        return max(limit, per_block)

    def text_room(self, max_texts: int) -> str | None:
        """Why one more text cannot wait now (`max_texts` wait already), or None."""
        return f"{max_texts} waiting" if self.texts >= max_texts else None

    def next_jobs(self, capacity: int, block: int, frame_period: float = 0.0, max_delay: float = 0.0,
                  shared_model: bool = False) -> list[Job]:
        """The next job, or the batch of texts that go in together (see the module docstring; `shared_model`: as
        for `text_call_chars`)."""
        if self.control:
            return [self.control.popleft()]
        # A waiting question goes before the frame, and the texts ahead of it go in as one batch first.
        if self.frames and (not self.messages or (self.last_kind != "frame" and not self.queries)):
            job = self.frames.pop(next(iter(self.frames)))
            self.last_kind = "frame"
            return [job]
        if self.messages[0].kind == "query":
            self.queries -= 1
            self.last_kind = "query"
            return [self.messages.popleft()]
        batch, chars = [], 0
        limit = self.text_call_chars(capacity, block, frame_period, max_delay, shared_model)
        # Texts up to the limit, not past it: a call one text over its blocks is measured as one block more, which
        # makes the pace look faster and the next call longer.
        while self.messages and self.messages[0].kind == "text" and (
                not batch or chars + len(self.messages[0].text[0]) <= limit):
            chars += len(self.messages[0].text[0])
            batch.append(self.messages.popleft())
        self.texts -= len(batch)
        self.text_chars -= chars
        self.last_kind = "text"
        if self.queries and self.messages[0].kind == "text":
            self._question_first()
        return batch

    def _question_first(self) -> None:
        """The first waiting question overtakes the texts ahead of it (they go in right after its answer)."""
        for i, queued in enumerate(self.messages):
            if queued.kind == "query":
                del self.messages[i]
                self.messages.appendleft(queued)
                return


def _moving_average(average: float | None, sample: float) -> float:
    return sample if average is None else 0.7 * average + 0.3 * sample
