"""The answers of memories on one model decoded together: `decode_together`, and `AnswerBench` for engines.

An answer is opened in its stream (`KVStream.open_answer`: the question, with what it retrieves, in the cache's
headroom, and its last logits), decoded, and closed (`KVStream.close_answer`: the cache back as it was, the exchange
kept where asked). Answers opened in several streams over one model decode as one batch
(engine/memory/batched_step.py): a decode step costs about as much for a few rows as for one.

`AnswerBench` brings the answers of separate `StreamingEngine`s on one model (shared_model.py) together. Their
workers take every job in the model's turns (model_turns.py). A worker opens its question's answer in the question's
turn; where another engine's question waits by then (one asked while this one went in counts), or an opened answer
waits on the bench, it leaves the answer on the bench and asks for one more turn; the first of those turns to come
decodes and closes every answer left on the bench, and the others find theirs done. An answer that nothing waits
beside is decoded in its turn, on its stream's own step, as on one memory. Each worker is blocked while its answer is
on the bench, so its stream is touched by one thread at a time.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..answering import Answer
from ..memory.batched_step import BatchedDecoder, DecodeMember
from ..memory.decode_step import SYNC_EVERY
from .model_turns import ModelTurns
from .stream import KVStream, OpenAnswer


def batch_decoder(stream: KVStream) -> BatchedDecoder:
    # On a CPU a read of the tokens costs nothing, and a member read late keeps the whole batch stepping for it.
    return BatchedDecoder(stream.adapter, sync_every=1 if stream.adapter.device.type == "cpu" else SYNC_EVERY)


def decode_together(decoder: BatchedDecoder, opened: list[tuple[KVStream, OpenAnswer]]) -> list[Answer | BaseException]:
    """Each opened answer decoded and closed: those over caches of one shape as one batch (memories of different cache
    sizes on one model decode in a batch a size), one alone on its stream's own step. Returns, in order, its `Answer` or
    the exception that ended it (a cancel, a stop, its batch's failure, its cache then as it was): one answer's end
    ends no other. Only an interrupt (a BaseException that is no Exception) is raised, every answer not closed by then
    abandoned."""
    outcomes: list[Answer | BaseException | None] = [None] * len(opened)
    settled = [False] * len(opened)  # closed or abandoned: its stream's cache its own again
    by_shape: dict[int, list[int]] = {}
    for index, (stream, _) in enumerate(opened):
        by_shape.setdefault(stream.cache.slots, []).append(index)
    try:
        for indices in by_shape.values():
            if len(indices) == 1:
                settled[indices[0]] = True  # answer_alone abandons it itself on an interrupt
                outcomes[indices[0]] = answer_alone(*opened[indices[0]])
                continue
            members = [DecodeMember(stream.cache, answer.logits, answer.max_new, stream.adapter.stop_token_ids,
                                    stream.progress(answer.turn)) for stream, answer in (opened[i] for i in indices)]
            try:
                decoder.generate(members)
            except Exception as exc:  # each of the batch's answers hears why
                for index in indices:
                    settled[index] = True
                    opened[index][0].abandon_answer(opened[index][1])
                    outcomes[index] = exc
                continue
            for index, member in zip(indices, members):
                stream, answer = opened[index]
                settled[index] = True
                if member.error is not None:
                    stream.abandon_answer(answer)
                    outcomes[index] = member.error
                else:
                    outcomes[index] = _closed(stream, answer, member.tokens)
    except BaseException:
        for (stream, answer), done in zip(opened, settled):
            if not done:
                stream.abandon_answer(answer)
        raise
    return outcomes


def answer_alone(stream: KVStream, answer: OpenAnswer) -> Answer | BaseException:
    """An opened answer decoded on its stream's own step and closed, as `KVStream.ask` would have it; or the exception
    that ended it (its cache then as it was)."""
    try:
        tokens = stream.decode_answer(answer)
    except Exception as exc:
        stream.abandon_answer(answer)
        return exc
    except BaseException:
        stream.abandon_answer(answer)
        raise
    return _closed(stream, answer, tokens)


def _closed(stream: KVStream, answer: OpenAnswer, tokens: list[int]) -> Answer | BaseException:
    try:
        return stream.close_answer(answer, tokens)
    except Exception as exc:
        return exc


@dataclass
class LeftAnswer:
    """An answer opened in `stream` and left on the bench; `outcome` once decoded and closed (or ended)."""

    stream: KVStream
    answer: OpenAnswer
    outcome: Answer | BaseException | None = None


class AnswerBench:
    """Where the engines on one model leave opened answers to be decoded together. `turns`: the model's."""

    def __init__(self, turns: ModelTurns):
        self.turns = turns
        self._lock = threading.Lock()
        self._waiting: list[LeftAnswer] = []
        self._asking: dict[int, Callable[[], bool]] = {}  # each seat's: whether its engine has a question waiting
        self._seats = 0
        self._decoder: BatchedDecoder | None = None
        self.batch_sizes: Counter[int] = Counter()  # how many times answers were taken off the bench, by how many

    def seat(self, has_question: Callable[[], bool]) -> int:
        """An engine's place at the bench; `has_question` tells (from any thread, without waiting) whether a question
        of that engine waits for the model."""
        with self._lock:
            self._seats += 1
            self._asking[self._seats] = has_question
            return self._seats

    def leave(self, seat: int) -> None:
        with self._lock:
            self._asking.pop(seat, None)

    @property
    def shared(self) -> bool:
        """Whether more than one engine sits at the bench."""
        with self._lock:
            return len(self._asking) > 1

    def others_waiting(self, seat: int) -> bool:
        """Whether another engine than `seat`'s has a question waiting, or an opened answer waits on the bench: an
        answer of `seat` opened now would have another to decode beside."""
        with self._lock:
            if self._waiting:
                return True
            others = [asks for other, asks in self._asking.items() if other != seat]
        return any(asks() for asks in others)

    def leave_answer(self, stream: KVStream, answer: OpenAnswer) -> LeftAnswer:
        """Leave an answer opened in `stream` on the bench; in the turn that opened it, so that a question opened in any
        later turn finds it waiting. `collect` it after that turn."""
        waiting = LeftAnswer(stream, answer)
        with self._lock:
            self._waiting.append(waiting)
        return waiting

    def collect(self, waiting: LeftAnswer) -> Answer:
        """An answer left on the bench, decoded beside the others there and closed. Called by its stream's worker
        outside any turn; it blocks until the answer is done. Raises what ended the answer."""
        with self.turns.turn():
            with self._lock:
                batch, self._waiting = self._waiting, []
            if batch:
                self._decode(batch)
        # Decoded in this turn or in an earlier one: turns are taken in order, and each batch within its turn.
        outcome = waiting.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @property
    def batches(self) -> int:
        """Batches of two answers or more decoded."""
        return sum(count for size, count in self.batch_sizes.items() if size > 1)

    def _decode(self, batch: list[LeftAnswer]) -> None:
        if self._decoder is None:
            self._decoder = batch_decoder(batch[0].stream)
        self.batch_sizes[len(batch)] += 1
        try:
            outcomes = decode_together(self._decoder, [(w.stream, w.answer) for w in batch])
        except BaseException as exc:  # an interrupt: each of the batch's callers hears of it
            outcomes = [exc] * len(batch)
        for waiting, outcome in zip(batch, outcomes):
            waiting.outcome = outcome


__all__ = ["AnswerBench", "LeftAnswer", "answer_alone", "batch_decoder", "decode_together"]
