"""The question side of a stream: answers from the memory, and the archive's blocks retrieved for them.

`Answering` is part of `KVStream` (engine/stream.py), kept in a module of its own: a question is tokenized as a
turn of the chat template, the archive's best blocks for it are placed after the cache's (engine/archive.py),
and the answer is decoded greedily, in the cache's headroom (then taken away again) or kept in the memory as a
dialogue turn.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from .cache import shift_rotary
from .evidence import Evidence, ranked
from .retrieval_heads import retrieval_heads
from .retrieval_index import RetrievalIndex, middle_layers
from .text_rules import text_problem

if TYPE_CHECKING:
    from .adapters import ModelAdapter
    from .archive import KVArchive
    from .cache import BoundedKVCache
    from .decode_step import StaticDecoder
    from .stream_config import StreamConfig

DEFAULT_DESCRIPTION_PROMPT = "Describe briefly what the robot sees and what happened most recently."
# Scores the archive's blocks alongside each question, so that the blocks any question is drawn to give way
# to those the question points to (engine/archive.py).
REFERENCE_QUESTION = "What happened?"
# Where a block the cache holds scores within this many standard deviations (of every block's score) of the
# best archived one, the cache is taken to hold the answer, newer than the archive's, and nothing is
# retrieved: placed nearer the question, an older fact of the same form (a value told again since) would
# displace it (docs/archive.md).
CACHE_ANSWERS_MARGIN = 0.35
# A chat template's role name on a line of its own, as a decoded turn shows it.
ROLE_LINE = re.compile(r"\n(?:user|assistant|system)\n")


@dataclass
class Answer:
    """An answer and the state of the memory it was given from."""

    text: str
    tokens_generated: int
    latency: float  # seconds
    tokens_seen: int
    cache_fill: int
    newest_frame_stamp: float | None
    kept_in_memory: bool
    # The answer reached the end of the cache's headroom before max_new_tokens (an answer not kept in memory
    # is generated in the headroom; a kept one is not bounded so).
    cut_by_headroom: bool = False
    # Archived tokens placed before the question for this answer, and the stream times of their blocks.
    retrieved_tokens: int = 0
    retrieved_stamps: list = field(default_factory=list)
    # The inputs the question pointed to most, heaviest first (engine/evidence.py).
    evidence: list[Evidence] = field(default_factory=list)


def best_last(chosen: list) -> list:
    """Blocks chosen best first (a long message's pieces after its best one) in the order they are placed:
    each message's pieces together and in stream order, the best message last, nearest the question. The
    model answers from the nearest of several facts of the same form: placed in stream order instead, 3 of
    12 such facts were recalled where this order recalled 11 (docs/archive.md)."""
    messages: dict[int, list] = {}
    for block in chosen:
        messages.setdefault(block.message, []).append(block)
    return [b for pieces in reversed(messages.values()) for b in sorted(pieces, key=lambda b: b.first_seq)]


class StreamStoppedError(RuntimeError):
    """The stream was asked to stop (shutdown) in the middle of an answer."""


class AnswerCancelledError(RuntimeError):
    """The caller cancelled the answer; the memory is as it was before the question."""


# Called after each generated token with the answer so far (text) and the number of tokens generated.
TokenCallback = Callable[[str, int], None]


class Answering:
    """Questions to a stream and their answers: the part of `KVStream` that asks, retrieves and generates.

    It is a mixin of `KVStream` alone, and uses the stream's own state: `adapter` (tokenizing, the chat
    template, decoding), `config` (max_new_tokens, retrieve_tokens), `cache` (its fill, slots and headroom,
    truncated back after an answer not kept), `archive` (the blocks to retrieve from), `tokens_seen`,
    `newest_frame_stamp`, `stop_requested`, `static_decoder` (the fixed-shape step of an answer not kept, or
    None) and `_stop_ids`; and its pushing: `_ensure_started`, `_push` and
    `_forward`. Its own state is an answer's: `_on_token`, `_cancel` and `_retrieved`.
    """

    adapter: ModelAdapter
    config: StreamConfig
    cache: BoundedKVCache
    archive: KVArchive
    tokens_seen: int
    newest_frame_stamp: float | None
    stop_requested: bool
    static_decoder: StaticDecoder | None
    _stop_ids: set[int]

    _on_token: TokenCallback | None = None
    _cancel: threading.Event | None = None

    @functools.cached_property
    def _closing(self) -> Tensor | None:
        """The template's end of an assistant turn, which closes a kept answer (tokenized once, when needed)."""
        suffix = self.adapter.chat.assistant_suffix
        return self.adapter.tokenize(suffix) if suffix else None

    def ask(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
            on_token: TokenCallback | None = None, cancel: threading.Event | None = None) -> Answer:
        """Answer greedily from what is in memory. Without keep_in_memory the cache is left as it was.

        on_token gets the answer so far after each token. Setting `cancel` stops the answer at the next token
        with AnswerCancelledError and leaves the memory as it was, also with keep_in_memory (the question
        and answer are kept only once the answer is complete), unless the question is too long for the
        headroom and has to be pushed into the memory before the answer: it then stays, with the answer so
        far and its turn closed.
        """
        problem = text_problem(question, "question")
        if problem:
            raise ValueError(problem)
        return self._exchange(self.adapter.chat.question_parts(question), max_new_tokens, keep_in_memory,
                              on_token, cancel, retrieve=True)

    def describe(self, prompt: str | None = None, *, max_new_tokens: int | None = None) -> Answer:
        """A description of the scene so far; never stays in memory."""
        return self._exchange(self.adapter.chat.question_parts(prompt or DEFAULT_DESCRIPTION_PROMPT), max_new_tokens,
                              False)

    def _exchange(self, question_parts: tuple[str, str, str], max_new_tokens: int | None, keep: bool,
                  on_token: TokenCallback | None = None, cancel: threading.Event | None = None, *,
                  retrieve: bool = False) -> Answer:
        start = time.monotonic()
        self._ensure_started()
        max_new = max_new_tokens or self.config.max_new_tokens
        ids, content = self._question_ids(question_parts)
        self._on_token, self._cancel = on_token, cancel
        self._retrieved: list = []
        self._evidence: list[Evidence] = []
        try:
            tokens = self._answer_tokens(ids, max_new, keep, content if retrieve else None)
        finally:
            self._on_token = self._cancel = None
        text = self.adapter.decode([t for t in tokens if t not in self._stop_ids]).strip()
        # Only the headroom ends an answer before max_new without its stop token (a cancel or stop raises).
        cut = not keep and len(tokens) < max_new and bool(tokens) and tokens[-1] not in self._stop_ids
        return Answer(
            text=text,
            tokens_generated=len(tokens),
            latency=time.monotonic() - start,
            tokens_seen=self.tokens_seen,
            cache_fill=self.cache.fill,
            newest_frame_stamp=self.newest_frame_stamp,
            kept_in_memory=keep,
            cut_by_headroom=cut,
            retrieved_tokens=sum(b.length for b in self._retrieved),
            retrieved_stamps=[b.stamp for b in self._retrieved],
            evidence=self._evidence,
        )

    def _answer_tokens(self, ids: Tensor, max_new: int, keep: bool, retrieve: slice | None = None) -> list[int]:
        """The answer's tokens; `retrieve`: where the question's own words are, to retrieve from the archive with
        (None: the cache alone)."""
        # Room in the headroom for the question and the whole answer.
        fits = self.cache.slots - self.cache.fill - ids.numel() >= max_new
        closing = self._closing
        if keep and fits:
            # Answer as if not kept, then keep question and answer as one prompt: a cancelled answer
            # leaves the memory as it was. What was retrieved for it is not kept: it is in the archive already.
            tokens = self._answer_tokens(ids, max_new, keep=False, retrieve=retrieve)
            kept = [t for t in tokens if t not in self._stop_ids]
            prompt = torch.cat([ids, torch.tensor(kept, dtype=torch.long, device=ids.device)]
                               + ([closing.to(ids.device)] if closing is not None else []))
            self._push(self.adapter.text_prompt(prompt))
            return tokens
        if keep:
            logits = self._push(self.adapter.text_prompt(ids), last_logits=True)
            try:
                tokens = self._generate(logits, max_new, keep=True)
            except (StreamStoppedError, AnswerCancelledError):
                # The question and the answer so far are in the memory: end the turn, so that it stays whole.
                if closing is not None:
                    self._push(self.adapter.text_prompt(closing))
                raise
            tail = [tokens[-1]] if tokens and tokens[-1] not in self._stop_ids else []
            tail_ids = torch.tensor(tail, dtype=torch.long, device=ids.device)
            if closing is not None:
                tail_ids = torch.cat([tail_ids, closing])
            if tail_ids.numel():
                self._push(self.adapter.text_prompt(tail_ids))
        else:
            room = self.cache.slots - self.cache.fill - ids.numel()
            if room < 1:
                raise ValueError(
                    f"question of {ids.numel()} tokens does not fit in the cache headroom "
                    f"({self.cache.slots - self.cache.fill} free slots); ask a shorter question or keep it in memory"
                )
            max_new = min(max_new, room)
            snapshot = (self.cache.fill, self.cache.frontiers(), self.tokens_seen)
            try:
                if retrieve is not None:
                    self._retrieve(ids, retrieve, budget=min(self.config.retrieve_tokens, room - max_new))
                logits = self._forward(self.adapter.text_prompt(ids), self.cache.next_position, evict=False,
                                       pack=False, observe=False)
                tokens = self._generate(logits, max_new, keep=False)
            finally:
                self.cache.truncate(snapshot[0], snapshot[1])
                self.tokens_seen = snapshot[2]
        return tokens

    def _generate(self, logits: Tensor, max_new: int, *, keep: bool) -> list[int]:
        """Greedy decoding; the last token is returned but not pushed. An answer not kept in memory takes the
        stream's static step where it has one (engine/decode_step.py): the same tokens, read back in groups."""
        if not keep and self.static_decoder is not None:
            reported = 0

            def on_read(tokens: list[int]) -> None:
                nonlocal reported
                for n in range(reported + 1, len(tokens) + 1):
                    self._check_going_on()
                    self._report(tokens[:n])
                reported = len(tokens)

            self._check_going_on()
            return self.static_decoder.generate(logits, max_new, self._stop_ids, on_read)
        tokens: list[int] = []
        for step in range(max_new):
            self._check_going_on()
            token = int(logits[-1].argmax())
            tokens.append(token)
            self._report(tokens)
            if token in self._stop_ids or step == max_new - 1:
                break
            prompt = self.adapter.text_prompt(torch.tensor([token], dtype=torch.long))
            # A kept answer may outgrow the headroom: evict once the storage is about to fill up.
            evict = keep and self.cache.fill + 2 > self.cache.slots
            logits = self._forward(prompt, self.cache.next_position, evict=evict, pack=evict, observe=keep,
                                   record=keep)
        return tokens

    def _check_going_on(self) -> None:
        """Raise where the stream was asked to stop or the caller cancelled the answer."""
        if self.stop_requested:
            raise StreamStoppedError("stopped while answering")
        if self._cancel is not None and self._cancel.is_set():
            raise AnswerCancelledError("cancelled")

    def _report(self, tokens: list[int]) -> None:
        """Give the caller the answer so far."""
        if self._on_token is not None:
            self._on_token(self.adapter.decode([t for t in tokens if t not in self._stop_ids]).strip(), len(tokens))

    @functools.cached_property
    def _reference_question(self) -> tuple[Tensor, slice]:
        return self._question_ids(self.adapter.chat.question_parts(REFERENCE_QUESTION))

    def _question_ids(self, parts: tuple[str, str, str]) -> tuple[Tensor, slice]:
        """A question turn's ids, and where its own words are among them (all of it where the template's
        pieces do not tokenize apart)."""
        ids = self.adapter.tokenize_turn(parts)
        head, tail = (len(self.adapter.tokenize(p)) if p else 0 for p in (parts[0], parts[2]))
        return ids, slice(head, len(ids) - tail) if 0 < len(ids) - head - tail else slice(0, len(ids))

    def _content_queries(self, ids: Tensor, content: slice) -> tuple[Tensor, Tensor]:
        """The queries of every layer for the question's own words, asked of the cache as it is (the question
        is taken away again), and the positions they were rotated with."""
        fill, frontier, frontiers = self.cache.fill, self.cache.next_position, self.cache.frontiers()
        self.cache.captured_queries = {}
        try:
            self._forward(self.adapter.text_prompt(ids), frontier, evict=False, pack=False, observe=False)
            captured = self.cache.captured_queries
        finally:
            self.cache.captured_queries = None
            self.cache.truncate(fill, frontiers)
            self.tokens_seen -= len(ids)
        queries = torch.stack([captured[i][:, content] for i in range(len(self.cache.layers))])
        return queries, torch.arange(frontier, frontier + ids.numel())[content]  # text: as _forward placed them

    def _retrieve(self, ids: Tensor, content: slice, budget: int) -> None:
        """Place the archived blocks that the question's queries score best, up to `budget` tokens, after the
        cache's own, the best nearest the question (a long message's pieces together, in their order), each
        re-rotated to sit there; none where the cache holds a block the question points to about as much (its
        answer is the newer). The caller truncates the cache back afterwards."""
        chosen = self._choose_blocks(ids, content, budget)
        if chosen:
            self._place_blocks(best_last(chosen))

    def _choose_blocks(self, ids: Tensor, content: slice, budget: int) -> list:
        """The archived blocks to place for a question, best first, up to `budget` tokens; none where the
        cache holds an answer as good as theirs. Blocks that every layer-head still holds are not candidates;
        they are scored beside them. The scores give the answer's evidence too (`config.evidence` entries)."""
        archive, wanted = self.archive, self.config.evidence
        if not archive.enabled or not archive.blocks or (budget <= 0 and wanted <= 0):
            return []
        blocks = list(archive.blocks)
        held = self._held(blocks)
        candidates = [b for b, h in zip(blocks, held) if not h and b.length <= budget]
        in_cache = [b for b, h in zip(blocks, held) if h]
        if not candidates and (wanted <= 0 or not in_cache):
            return []
        question = self._content_queries(ids, content)
        scored = candidates + in_cache
        scores = self._retrieval_index(question[0]).scores(question, scored)
        if wanted > 0:
            self._evidence = ranked(scored, scores, [False] * len(candidates) + [True] * len(in_cache), self._quote,
                                    wanted)
        if not candidates:
            return []
        archived, held_scores = scores[: len(candidates)], scores[len(candidates) :]
        if held_scores.numel() and held_scores.max() >= archived.max() - CACHE_ANSWERS_MARGIN * scores.std():
            return []  # the cache holds an answer as good, and newer
        # Best first; a piece of a long message brings the rest of it, nearest pieces first, as far as the
        # budget goes (a fact cut between two blocks comes back whole).
        pieces: dict[int, list] = {}
        for block in candidates:
            pieces.setdefault(block.message, []).append(block)
        chosen, taken, used = [], set(), 0
        for i in torch.argsort(archived, descending=True, stable=True).tolist():
            block = candidates[i]
            if block.index in taken or used + block.length > budget:
                continue
            for piece in sorted(pieces[block.message], key=lambda b: abs(b.first_seq - block.first_seq)):
                if piece.index not in taken and used + piece.length <= budget:
                    chosen.append(piece)
                    taken.add(piece.index)
                    used += piece.length
            if budget - used < 1:
                break
        return chosen

    def recall(self, text: str, *, limit: int = 5, since: float | None = None, until: float | None = None,
               near: tuple[float, float, float] | None = None) -> list[Evidence]:
        """The moments that `text` points to most, best first, without an answer: the archive's blocks (held by
        the cache or not) scored as a question scores them, those stamped between `since` and `until` (stream
        time) and, with `near` (x, y, radius), those whose pose lies within the radius. ValueError for an
        unusable argument."""
        problem = text_problem(text, "recall text")
        if problem:
            raise ValueError(problem)
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if since is not None and until is not None and until < since:
            raise ValueError(f"the time window ends ({until}) before it begins ({since})")
        if near is not None and not near[2] > 0:
            raise ValueError(f"the radius must be > 0 m, got {near[2]}")
        blocks = [b for b in self.archive.blocks
                  if (since is None or (b.stamp is not None and b.stamp >= since))
                  and (until is None or (b.stamp is not None and b.stamp <= until))
                  and (near is None or (b.pose is not None and b.pose.distance_to(near[0], near[1]) <= near[2]))]
        if not blocks or not self.archive.enabled:
            return []
        ids, content = self._question_ids(self.adapter.chat.question_parts(text))
        if self.cache.slots - self.cache.fill - ids.numel() < 1:
            raise ValueError(f"recall text of {ids.numel()} tokens does not fit in the cache headroom")
        question = self._content_queries(ids, content)
        scores = self._retrieval_index(question[0]).scores(question, blocks)
        return ranked(blocks, scores, self._held(blocks), self._quote, limit)

    def _held(self, blocks: list) -> list[bool]:
        """Whether the cache still holds each archived block, whole, in every layer-head."""
        first = torch.tensor([b.first_seq for b in blocks], dtype=torch.long)
        end = torch.tensor([b.seq_end for b in blocks], dtype=torch.long)
        return self.cache.holds(first, end).tolist()

    def _quote(self, block) -> str:
        """A text block's words as the model read them, the whole message where a long one was cut into pieces,
        its time marker kept and the chat template's role names taken out."""
        pieces = sorted((b for b in self.archive.blocks if b.message == block.message), key=lambda b: b.first_seq)
        ids = [t for piece in pieces or [block] for t in self.archive.block_token_ids(piece) if t >= 0]
        return " ".join(ROLE_LINE.sub("\n", "\n" + self.adapter.decode(ids)).split())

    def retrieval_heads(self) -> Tensor | None:
        """The model's retrieval heads (engine/retrieval_heads.py), found on a stream of this kind at first use."""
        return retrieval_heads(self.adapter, lambda **settings: type(self)(self.adapter, type(self.config)(**settings)))

    def _retrieval_index(self, queries: Tensor) -> RetrievalIndex:
        """The archive's index, made at the memory's first retrieval: on the model's retrieval heads (every head of
        the middle half of the layers where they cannot be found), with the reference question asked of the
        memory as it is then."""
        if self.archive.index is None:
            heads = self.retrieval_heads()
            if heads is None:
                heads = middle_layers(*queries.shape[:2])
            self.archive.build_index(heads, self._content_queries(*self._reference_question), queries.device)
        return self.archive.index

    def _place_blocks(self, chosen: list) -> None:
        """Splice archived blocks after the cache's, in the order given, each re-rotated to sit there."""
        archive = self.archive
        parts, base = [], self.cache.next_position
        for block in chosen:
            keys, values, rel_start, rel_end = archive.block_tensors(block)
            parts.append((keys, values, rel_start + base, rel_end + base, torch.full((block.length,), base),
                          torch.arange(block.first_seq, block.seq_end), torch.full((block.length,), block.frame)))
            base += block.extent
        keys, values, start, end, shift, seq, frame = (torch.cat(t, dim=2 if i < 2 else 0)
                                                       for i, t in enumerate(zip(*parts)))
        layers, heads = keys.shape[:2]
        # Each block's keys sit as if it began at 0: one uniform rotation puts it at its place.
        keys = shift_rotary(keys.flatten(0, 1), shift[None].expand(layers * heads, -1), archive.inv_freq)
        self.cache.splice(keys.view(layers, heads, *keys.shape[1:]), values, start, end, seq, frame)
        self._retrieved = chosen
