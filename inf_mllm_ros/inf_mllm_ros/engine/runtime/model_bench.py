"""Where the engines on one model leave work to be done together: `ModelBench`.

Separate `StreamingEngine`s on one model (shared_model.py) have a worker each, and every job runs in the model's turns
(model_turns.py). A worker whose job is an input or a question, when another engine has work of that kind waiting (or
such work waits on the bench already), does not run it in its turn: it leaves the job's steps (`KVStream.text_steps`,
`frame_steps`, `answer_steps`) on the bench and asks for one more turn. The first of those turns to come runs the
bench's work of that kind together (together.py): the forwards staged at once through the model as batches, then the
answers opened decoded as one batch and closed; the others find theirs done. Questions go with questions and inputs
with inputs: a question never waits for another memory's input beyond the one in progress when it came. A job that
nothing waits beside runs in its turn, on its stream's own path, as on one memory. Each worker is blocked while its
work is on the bench, so its stream is touched by one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..answering import Answer, Question
from ..memory.batched_ingest import BatchedIngester
from ..memory.batched_step import BatchedDecoder
from .model_turns import ModelTurns
from .stream import KVStream, OpenAnswer, Steps
from .together import batch_decoder, batch_ingester, decode_together, forwards_together

# How long work left on the bench waits, before its turn is asked for, for the engines whose work waits in their queues
# to leave theirs beside it: their workers wake and take their turns within a millisecond or so on an idle model.
GATHER_S = 0.1


@dataclass
class LeftWork:
    """A job's steps on `stream` left on the bench (None: an answer opened already, its `outcome`) by the worker at
    `seat`; `question` where they open its answer. Once run (`done`): `outcome` (the steps' value, or the closed
    `Answer`, or what ended them) and `seconds`, the time its batch took."""

    stream: KVStream
    steps: Steps | None
    seat: int
    question: Question | None = None
    outcome: object = None
    seconds: float = 0.0
    done: bool = False

    @property
    def asks(self) -> bool:
        """Whether it is a question's (else an input's): each kind goes through the model with its own kind only."""
        return self.steps is None or self.question is not None


class ModelBench:
    """Where the engines on one model leave work to be done together. `turns`: the model's."""

    def __init__(self, turns: ModelTurns):
        self.turns = turns
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # work was left on the bench
        self._waiting: list[LeftWork] = []
        # Each seat's: whether its engine has a question waiting, and whether it has an input waiting.
        self._working: dict[int, tuple[Callable[[], bool], Callable[[], bool]]] = {}
        self._seats = 0
        self._decoder: BatchedDecoder | None = None
        self._ingester: BatchedIngester | None = None
        self.batch_sizes: Counter[int] = Counter()  # how many times answers were decoded together, by how many
        self.work_sizes: Counter[int] = Counter()  # how many times work was taken off the bench, by how many jobs

    def seat(self, has_question: Callable[[], bool], has_input: Callable[[], bool]) -> int:
        """An engine's place at the bench; `has_question` and `has_input` tell (from any thread, without waiting)
        whether a question, or a text or frame, of that engine waits for the model."""
        with self._lock:
            self._seats += 1
            self._working[self._seats] = (has_question, has_input)
            return self._seats

    def leave(self, seat: int) -> None:
        with self._lock:
            self._working.pop(seat, None)

    @property
    def shared(self) -> bool:
        """Whether more than one engine sits at the bench."""
        with self._lock:
            return len(self._working) > 1

    def others_waiting(self, seat: int, asks: bool) -> bool:
        """Whether another engine than `seat`'s has work of the kind (`asks`: a question; else an input) waiting, or
        such work waits on the bench: work of `seat` left now would have other work to go through the model with.
        Questions go with questions and inputs with inputs, so that no question waits for another memory's input
        beyond the one in progress."""
        with self._lock:
            if any(w.asks == asks for w in self._waiting):
                return True
            others = [works[0 if asks else 1] for other, works in self._working.items() if other != seat]
        return any(works() for works in others)

    def put(self, seat: int, stream: KVStream, steps: Steps, question: Question | None = None) -> LeftWork:
        """Leave a job's steps on `stream` on the bench (`question`: the question whose answer they open), in the turn
        its worker (at `seat`) took the job in, so that work taken in any later turn finds it waiting. `collect` it
        after that turn."""
        return self._put(LeftWork(stream, steps, seat, question))

    def put_opened(self, seat: int, stream: KVStream, answer: OpenAnswer) -> LeftWork:
        """Leave an answer opened in `stream` on the bench (its question went in alone), to be decoded with the
        others; as `put`."""
        return self._put(LeftWork(stream, None, seat, outcome=answer))

    def _put(self, left: LeftWork) -> LeftWork:
        with self._changed:
            self._waiting.append(left)
            self._changed.notify_all()
        return left

    def collect(self, left: LeftWork):
        """Work left on the bench, done beside the other work there. Called by its stream's worker outside any turn;
        it blocks until the work is done. Returns its outcome (a question's closed `Answer`); raises what ended it.
        Before asking for its turn it lets the engines whose work of its kind waits in their queues, and who have none
        on the bench yet, take their turns first (at most GATHER_S): their workers were woken by that work, and a turn
        asked for at once would come before theirs. It runs with the work of its kind only."""
        self._gather(left)
        with self.turns.turn():
            with self._lock:
                batch = [w for w in self._waiting if w.asks == left.asks]
                self._waiting = [w for w in self._waiting if w.asks != left.asks]
            if batch:
                self._run(batch)
        # Done in this turn or in an earlier one: turns are taken in order, and each batch within its turn.
        if isinstance(left.outcome, BaseException):
            raise left.outcome
        return left.outcome

    def _gather(self, left: LeftWork) -> None:
        deadline = time.monotonic() + GATHER_S
        with self._changed:
            while not left.done:
                on_bench = {w.seat for w in self._waiting if w.asks == left.asks}
                late = [works[0 if left.asks else 1] for seat, works in self._working.items()
                        if seat != left.seat and seat not in on_bench]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not any(works() for works in late):
                    return
                self._changed.wait(remaining)

    @property
    def batches(self) -> int:
        """Batches of two answers or more decoded."""
        return sum(count for size, count in self.batch_sizes.items() if size > 1)

    @property
    def forward_batches(self) -> int:
        """Passes through the model that took forwards of two streams or more."""
        return 0 if self._ingester is None else self._ingester.batches

    def _run(self, batch: list[LeftWork]) -> None:
        start = time.monotonic()
        if self._ingester is None:
            self._ingester, self._decoder = batch_ingester(batch[0].stream), batch_decoder(batch[0].stream)
        self.work_sizes[len(batch)] += 1
        try:
            outcomes = forwards_together(self._ingester, {i: (w.stream, w.steps) for i, w in enumerate(batch)
                                                          if w.steps is not None})
            for i, outcome in outcomes.items():
                batch[i].outcome = outcome
            opened = [left for left in batch if isinstance(left.outcome, OpenAnswer)]
            for left in batch:  # a kept answer that does not fit beside its memory goes in as it decodes, alone
                if left.question is not None and left.outcome is None:
                    left.outcome = _asked(left)
            if opened:
                self.batch_sizes[len(opened)] += 1
                answers = decode_together(self._decoder, [(left.stream, left.outcome) for left in opened])
                for left, answer in zip(opened, answers):
                    left.outcome = answer
        except BaseException as exc:  # an interrupt: each caller whose work did not end hears of it
            for left in batch:
                if left.outcome is None or isinstance(left.outcome, OpenAnswer):
                    left.outcome = exc
        seconds = time.monotonic() - start
        for left in batch:
            left.seconds, left.done = seconds, True


def _asked(left: LeftWork) -> Answer | BaseException:
    question = left.question
    try:
        return left.stream.ask(question.text, **question.options())
    except Exception as exc:
        return exc


__all__ = ["LeftWork", "ModelBench"]
