"""Several memories on one loaded model: a stream per robot (or camera), their answers decoded in one batch.

Each `KVStream` of the pool owns its bounded cache, archive, clock and policy state, as a stream alone does; they
share the `ModelAdapter` (one copy of the weights, and the model's retrieval heads, found once per model). Their
caches are of one shape (the same capacity and headroom), which is what lets answers that are asked at the same
time decode as one batch (engine/memory/batched_step.py): the questions go into their own streams' headrooms one by
one, their tokens come together, one model step for all, and each stream is then taken back to where it was (and
keeps the exchange where asked). Inputs go into each stream as they would alone; each stream's memory and answers are
those it would have alone (tests: test_streams.py).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..answering import Answer, Question
from ..models.adapters import ModelAdapter
from ..stream_config import StreamConfig
from .answer_bench import batch_decoder, decode_together
from .stream import KVStream, OpenAnswer


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
        self.decoder = batch_decoder(next(iter(self.streams.values())))
        self.decode_seconds = 0.0  # time spent decoding answers (a batch, or one alone on its stream's step)

    def __getitem__(self, name: str) -> KVStream:
        return self.streams[name]

    def __iter__(self):
        return iter(self.streams)

    def __len__(self) -> int:
        return len(self.streams)

    def ask_together(self, questions: dict[str, Question | str]) -> dict[str, Answer | BaseException]:
        """Each stream's question answered, the answers decoded as one batch (answer_bench.py). Returns, by stream,
        its `Answer`, or the exception that ended it (a bad question, a cancel, a stop): one stream's failure ends no
        other's. An answer kept in memory that does not fit in its headroom is answered alone, first."""
        results: dict[str, Answer | BaseException] = {}
        opened: dict[str, OpenAnswer] = {}
        for name, question in questions.items():
            stream = self.streams[name]
            q = Question(question) if isinstance(question, str) else question
            try:
                answer = stream.open_answer(q.text, **q.options())
                if answer is None:
                    results[name] = stream.ask(q.text, **q.options())
                    continue
            except Exception as exc:
                results[name] = exc
                continue
            try:
                answer.turn.check()
            except Exception as exc:
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
