"""Several streams' work on one model done together: their forwards batched, then their answers decoded as one batch.

Two kinds of work of several streams over one model go through it together:

- forwards (`forwards_together`): each stream's work is a generator of steps (`KVStream.text_steps`, `frame_steps`,
  `answer_steps`): each forward it needs is staged on its cache and yielded; the forwards staged at once that fit one
  pass (blocks of one size class, over caches of one shape) go through the model as one batch
  (engine/memory/batched_ingest.py), any other alone, and each stream's steps go on with its logits;
- answers (`decode_together`): an answer is opened in its stream (`KVStream.open_answer`, or `answer_steps` driven
  together: the question, with what it retrieves, in the cache's headroom, and its last logits), decoded, and closed
  (`KVStream.close_answer`: the cache back as it was, the exchange kept where asked). Answers opened in several streams
  over one model decode as one batch (engine/memory/batched_step.py): a decode step costs about as much for a few rows
  as for one.

A `StreamPool` (pool.py) does both for its streams; the engines on one model (shared_model.py) through their
`ModelBench` (model_bench.py). Each stream's memory and answers are those it would have alone (tests:
test_streams.py).
"""

from __future__ import annotations

from typing import Hashable

from torch import Tensor

from ..answering import Answer
from ..memory.batched_ingest import BATCH_BLOCK, BatchedIngester, IngestMember
from ..memory.batched_step import BatchedDecoder, DecodeMember
from ..memory.decode_step import SYNC_EVERY
from ..memory.ingest_step import block_sizes
from .stream import KVStream, OpenAnswer, StagedForward, Steps


def batch_ingester(stream: KVStream) -> BatchedIngester:
    """The batched forwards for streams of `stream`'s kind: blocks up to its chunk size, and questions up to
    BATCH_BLOCK tokens whatever the chunk size."""
    chunk = max(stream.config.chunk_size, BATCH_BLOCK)
    return BatchedIngester(stream.adapter, block_sizes(chunk, stream.adapter.device))


def forwards_together(ingester: BatchedIngester,
                      work: dict[Hashable, tuple[KVStream, Steps]]) -> dict[Hashable, object]:
    """Drive each stream's steps (by any key: a name, a job) a forward at a time: the forwards staged at once that
    share a batch key (`BatchedIngester.batch_key`) go through the model as one batch, any other alone on its
    stream's own path. Returns, by key, its steps' value or the exception that ended them: one stream's failure ends
    no other's. Only an interrupt (a BaseException that is no Exception) is raised, every stream's steps closed."""
    steps = {key: s for key, (_, s) in work.items()}
    streams = {key: stream for key, (stream, _) in work.items()}
    results: dict[Hashable, object] = {}
    staged: dict[Hashable, StagedForward] = {}

    def advance(name: Hashable, logits: Tensor | None = None) -> None:
        try:
            staged[name] = steps[name].send(logits)
        except StopIteration as done:
            results[name] = done.value
        except Exception as exc:
            results[name] = exc

    def failed(name: Hashable, exc: Exception) -> None:
        del staged[name]
        steps[name].close()  # what is staged is taken back, and what its steps undo on a failure undone
        results[name] = exc

    try:
        for name in steps:
            advance(name)
        while staged:
            groups: dict[tuple, list[Hashable]] = {}
            for name, forward in staged.items():
                key = ingester.batch_key(streams[name].cache, forward.plan)
                groups.setdefault(("alone", name) if key is None else key, []).append(name)
            outputs: dict[Hashable, Tensor | None] = {}
            for names in groups.values():
                if len(names) == 1:
                    try:
                        outputs[names[0]] = streams[names[0]].run_staged(staged[names[0]])
                    except Exception as exc:
                        failed(names[0], exc)
                    continue
                members = [IngestMember(streams[name].cache, staged[name].embeds, staged[name].position_ids,
                                        staged[name].plan, staged[name].logits) for name in names]
                try:
                    ingester.run(members)
                except Exception as exc:  # each of the batch's streams hears why
                    for name in names:
                        failed(name, exc)
                    continue
                outputs.update((name, member.logits) for name, member in zip(names, members))
            staged.clear()
            for name, logits in outputs.items():
                advance(name, logits)
    except BaseException:
        for name in staged:
            steps[name].close()
        raise
    return {name: results[name] for name in steps}


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


__all__ = ["answer_alone", "batch_decoder", "batch_ingester", "decode_together", "forwards_together"]
