"""Several memories on one loaded model: a stream per robot (or camera), their answers decoded in one batch.

Each `KVStream` of the pool owns its bounded cache, archive, clock and policy state, as a stream alone does; they
share the `ModelAdapter` (one copy of the weights, and the model's retrieval heads, found once per model). Their
caches are of one shape (the same capacity and headroom), which is what lets answers that are asked at the same
time decode as one batch (engine/memory/batched_step.py): the questions go into their own streams' headrooms one by
one, their tokens come together, one model step for all, and each stream is then taken back to where it was (and
keeps the exchange where asked). Inputs given at once (`push_texts_together`, `push_frames_together`) go in block by
block, the blocks of the streams that have one, and fit one batch, in one pass (engine/memory/batched_ingest.py); each
stream's memory and answers are those it would have alone (tests: test_streams.py).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..answering import Answer, Question
from ..models.adapters import ModelAdapter
from ..stream_config import StreamConfig
from .together import batch_decoder, batch_ingester, decode_together, forwards_together
from .stream import KVStream, OpenAnswer, Steps


class StreamPool:
    """Named streams over one model. `configs`: each stream's `StreamConfig` by name (or a list of names, each with
    `config`); ValueError where their caches would not be of one shape."""

    def __init__(self, adapter: ModelAdapter, configs: dict[str, StreamConfig] | list[str],
                 config: StreamConfig | None = None):
        if not isinstance(configs, dict):
            configs = {name: replace(config) if config is not None else StreamConfig() for name in configs}
        if not configs:
            raise ValueError("a pool needs at least one stream")
        self.adapter = adapter
        self.streams = {name: KVStream(adapter, cfg) for name, cfg in configs.items()}
        shapes = {name: (s.cache.slots, s.cache.capacity) for name, s in self.streams.items()}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"a pool's caches must be of one shape (capacity, headroom), got {shapes}")
        first = next(iter(self.streams.values()))
        self.decoder = batch_decoder(first)
        self.ingester = batch_ingester(first)
        self.decode_seconds = 0.0  # time spent decoding answers (a batch, or one alone on its stream's step)

    def __getitem__(self, name: str) -> KVStream:
        return self.streams[name]

    def __iter__(self):
        return iter(self.streams)

    def __len__(self) -> int:
        return len(self.streams)

    def push_texts_together(self, texts: dict[str, list[tuple]]) -> dict[str, list[int] | BaseException]:
        """Each stream's messages (items as `KVStream.push_texts` takes them) pushed, their blocks batched where they
        fit one pass. Returns, by stream, each message's token count, or the exception that ended its push (a bad
        text, a stop): one stream's failure ends no other's."""
        return self._together({name: self.streams[name].text_steps(items) for name, items in texts.items()})

    def push_frames_together(self, frames: dict[str, tuple]) -> dict[str, int | BaseException]:
        """Each stream's camera frame, (rgb, stamp), (rgb, stamp, pose) or (rgb, stamp, pose, camera) as
        `KVStream.push_frame` takes them, pushed, the frames' blocks batched where they fit one pass. Returns, by
        stream, its token count or the exception that ended its push."""
        steps: dict[str, Steps] = {}
        for name, (rgb, stamp, *rest) in frames.items():
            pose, camera = rest[0] if rest else None, rest[1] if len(rest) > 1 else ""
            steps[name] = self.streams[name].frame_steps(rgb, stamp, pose=pose, camera=camera)
        return self._together(steps)

    def _together(self, steps: dict[str, Steps]) -> dict[str, object]:
        return forwards_together(self.ingester, {name: (self.streams[name], s) for name, s in steps.items()})

    def ask_together(self, questions: dict[str, Question | str]) -> dict[str, Answer | BaseException]:
        """Each stream's question answered: the questions' forwards (their queries for retrieval, then the questions
        placed) batched as inputs are, the answers decoded as one batch (together.py). Returns, by stream, its
        `Answer`, or the exception that ended it (a bad question, a cancel, a stop): one stream's failure ends no
        other's. An answer kept in memory that does not fit in its headroom is answered alone, before the batch."""
        asked = {name: Question(question) if isinstance(question, str) else question
                 for name, question in questions.items()}
        results: dict[str, Answer | BaseException] = {}
        opened: dict[str, OpenAnswer] = {}
        steps = {name: self.streams[name].answer_steps(q.text, **q.options()) for name, q in asked.items()}
        for name, answer in self._together(steps).items():
            stream, q = self.streams[name], asked[name]
            if isinstance(answer, BaseException):
                results[name] = answer
                continue
            try:
                if answer is None:
                    results[name] = stream.ask(q.text, **q.options())
                    continue
                answer.turn.check()
            except Exception as exc:
                if answer is not None:
                    stream.abandon_answer(answer)
                results[name] = exc
                continue
            opened[name] = answer
        if opened:
            start = time.monotonic()
            try:
                outcomes = decode_together(self.decoder, [(self.streams[name], answer)
                                                          for name, answer in opened.items()])
            finally:
                self.decode_seconds += time.monotonic() - start
            results.update(zip(opened, outcomes))
        return {name: results[name] for name in questions}


__all__ = ["Question", "StreamPool"]
