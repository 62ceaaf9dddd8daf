"""The archive's side of a question: which archived blocks to place before it, where, and what it rests on.

A question's own words are asked of the memory for their queries (a `QueryProbe`: the stream, which runs them
over the cache and takes them away again); the archive's index scores every archived block with them on the
model's retrieval heads, less the reference question's scores (engine/archive/retrieval_index.py). The best blocks the
cache no longer holds are placed after the cache's own, re-rotated to sit there, the best nearest the question,
and nearer still the messages that name what the question names (engine/archive/naming.py), the newest of those alike
last, with copies of the blocks the cache holds that name it as much and are newer or score as high: the model
answers from the nearest of several facts of the same form, so the asked fact goes nearer than its siblings; a
message told again since with what the question asks changed (a value, in the same words) is left out, as the
model gives the old value too when both are there, and so is a message that only names the subject again (a
mention) where another holds its value, as the model answers with the mention's words. The same scores give an
answer's evidence (engine/archive/evidence.py) and a recall's moments. Design and measurements: docs/archive.md.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generator, NamedTuple, Protocol

import torch
from torch import Tensor

from .attribution import speaker, unattributed
from ..answering import asks_when
from .evidence import ORDER_AMONG, Evidence, asked_order, in_asked_order, ranked, without_order
from .existence import NOT_SEEN_LIKENESS, asks_if_seen, thing_held, thing_terms, thing_words
from .lexical import asks, bm25, false_friends, stem, terms
from .naming import TIME_MARKER, naming_shares, restated, said_words, text_words
from .retrieval_index import RetrievalIndex, middle_layers
from .sentences import SentenceEncoder, similarities
from ..ops.rotary import shift_rotary

if TYPE_CHECKING:
    from ..models.adapters import ModelAdapter
    from .archive import ArchivedBlock, KVArchive
    from ..memory.cache import BoundedKVCache
    from ..models.chat import MarkerClock

# Scores the archive's blocks alongside each question, so that the blocks any question is drawn to give way
# to those the question points to (engine/archive/archive.py).
REFERENCE_QUESTION = "What happened?"
# A block the cache holds that scores within this many standard deviations (of every block's score) of the best
# archived one may hold the answer, newer than the archive's: a copy of it is placed after the retrieved blocks,
# nearest the question, as the model answers from the nearest of several facts of the same form; retrieval
# still goes ahead, as the block may only name the subject (docs/archive.md).
CACHE_ANSWERS_MARGIN = 0.35
# A block names the question where it holds this share of the question's words, weighted by rarity
# (engine/archive/naming.py), and within NAMING_TOLERANCE of the block that names it most.
NAMES_QUESTION = 0.5
NAMING_TOLERANCE = 0.3
# Shares this close are taken as equal when the messages nearest the question are ordered: then the newest is
# nearest (a value told again in the same words names the question exactly as much as the old one).
NAMING_STEP = 0.05
# A message that names the question as much as a newer one (within NAMING_STEP) and says what it says but for at
# most this many words each (engine/archive/naming.py, `restated`: a value of one or two words) was told again since
# with something changed: it is left out, as the small model answers a value told twice with the older one too, even
# where the newer is placed nearer the question (docs/archive.md).
RESTATED_WORDS = 2
# Of the messages that name the question, a word beyond the question's own that at most this many of them hold is
# news (a value, told once and maybe told again); one with no news only names the subject again: where another
# holds news, it is not placed (placed, the small model answered with the mention, word for word).
NEWS_MESSAGES = 2
# The best candidates by score: the question's words that their messages hold are those that count in what a message
# names (about two budgets' worth).
NAMING_BEST = 16
# Each block's score gains this many standard deviations (of every block's score) times its message's share of the
# question's words, over the words any message holds (engine/archive/naming.py): attention finds a statement's form, the
# words its subject ("the helmet" among a dozen reports "Patrol robot R1 saw a ... at ..."). What is retrieved, an
# answer's evidence and a recall's moments are all ranked on the sum (docs/archive.md).
WORD_MATCH_WEIGHT = 1.0
# Each block's score gains at most this many standard deviations (of every block's score) for its message's BM25
# score for the question's words (engine/archive/lexical.py), in proportion to the best message's: the words a question
# shares with its answer, weighed as a search engine weighs them (tuned on LoCoMo's conversations 26 and 41).
LEXICAL_WEIGHT = 3.0
# Each block's score gains at most this many standard deviations (of every block's score) for its message's
# similarity in meaning to the question (engine/archive/sentences.py), in proportion to the most similar message's
# above the least similar's: a question in other words than its answer.
SEMANTIC_WEIGHT = 8.0
# That share is raised to this power: the messages nearly as alike as the best fall further behind it.
MEANING_POWER = 1.0
# A question with a word that no message holds (a thing named in other words than the memory's: "the pylons" for
# "some yellow cones") weighs meaning by these instead: words cannot find its answer, and the messages nearly as
# alike as the best (another thing of the same kind, "a first aid kit" for "the tool kit") fall far behind it. Where
# every word is held somewhere (most of LoCoMo's questions), the encoder's best is often a turn on the same topic
# and the words find the answer better. Chosen on tuning data (the route's seeds 200015-200020: the asked sighting
# first for 272 of 335 questions against 247 at 8 and 1; LoCoMo 26 and 41: hit@5 209 of 283 against 213; 16 and 4
# gave 276 and 207; docs/archive.md).
UNSAID_SEMANTIC_WEIGHT = 12.0
UNSAID_MEANING_POWER = 2.0
# Asked for the newest or the oldest moment, the entries whose messages are at least this alike in meaning to the
# heaviest's (the encoder's cosine) tell of the same thing: "Passing the orange cart again" and "Looks like an orange
# push cart left standing" (sightings of one thing: 0.66 or more on the tuning route bags; of two things: 0.6 or more
# for 1 %). Without the encoder, those about as heavy as the heaviest (engine/archive/evidence.py).
SAME_THING_LIKENESS = 0.6
# The message after one that asks something scores at least this share of that message's score (above the lowest
# block's): the reply holds what the question about it asks, while the asking message matches it best.
REPLY_SHARE = 0.9
# The days' turns whose keys and values are kept for placing again (a few hundred KB each for the 0.5B model).
DAY_TURNS_KEPT = 64
# A chat template's role name on a line of its own, as a decoded turn shows it.
ROLE_LINE = re.compile(r"\n(?:user|assistant|system)\n")


def as_read(decoded: str) -> str:
    """A message's decoded tokens as its words: the chat template's role names taken out, spaces made single."""
    return " ".join(ROLE_LINE.sub("\n", "\n" + decoded).split())


class QueryProbe(Protocol):
    """What the retriever asks of the memory it serves (`KVStream`)."""

    def question_ids(self, parts: tuple[str, str, str]) -> tuple[Tensor, slice]:
        """A question turn's ids, and where its own words are among them."""

    def content_queries(self, ids: Tensor, content: slice) -> tuple[Tensor, Tensor]:
        """Every layer's queries of the question's own words, asked of the cache as it is, and their positions."""

    def content_query_steps(self, ids: Tensor, content: slice) -> Generator:
        """`content_queries` as a step: its forward staged and yielded for the memory's caller to run."""

    def run_steps(self, steps: Generator):
        """Run steps (`content_query_steps`, and those made of them) on the memory alone; their value."""

    @property
    def marker_clock(self) -> MarkerClock:
        """How the memory's markers say a time, and the day of its newest input (`previous`)."""

    def turn_tokens(self, text: str) -> int:
        """How many tokens `text` takes as a user turn."""

    def place_turn(self, text: str) -> None:
        """Put `text` as a user turn after the cache's own, for one answer (taken away with the placed blocks)."""


class MessageText(NamedTuple):
    """What the retriever reads of an archived message, once: its words (engine/archive/naming.py), what it says (its
    words, time markers aside), its search terms with their counts (engine/archive/lexical.py), whether it asks, and
    the speaker it names before its words (engine/archive/attribution.py), and its words as read, time markers aside
    (what the sentence encoder reads)."""

    words: frozenset[str]
    said: frozenset[str]
    terms: Counter
    asks: bool
    speaker: str | None
    read: str


@dataclass
class Retrieval:
    """What one question got from the archive: the blocks placed before it (in placing order), its evidence, the
    speaker it asks of where none of its heaviest evidence is theirs (engine/archive/attribution.py; "" otherwise),
    whether it asks if a thing was seen that nothing in memory names or is like (engine/archive/existence.py), and the
    time note said after its words (engine/answering.py `time_note`; "" where none was)."""

    placed: list = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)
    unattributed: str = ""
    unseen: bool = False
    time_note: str = ""


def best_last(chosen: list) -> list:
    """Blocks chosen best first (a long message's pieces after its best one) in the order they are placed:
    each message's pieces together and in stream order, the best message last, nearest the question: the
    model answers from the nearest of several facts of the same form (measured: docs/archive.md)."""
    messages: dict[int, list] = {}
    for block in chosen:
        messages.setdefault(block.message, []).append(block)
    return [b for pieces in reversed(messages.values()) for b in sorted(pieces, key=lambda b: b.first_seq)]


class Retriever:
    """Retrieval from one stream's archive into its cache.

    archive, cache, adapter: the stream's. probe: asks the memory for a text's queries. find_heads: the model's
    retrieval heads (engine/archive/retrieval_heads.py; None where they cannot be found), asked at the first retrieval.
    load_encoder: the sentence encoder that weighs what a question means (None: words and attention only), asked
    while the model loads (`KVStream.prepare_first_answer`) and at each retrieval.
    """

    def __init__(self, archive: KVArchive, cache: BoundedKVCache, adapter: ModelAdapter, probe: QueryProbe,
                 find_heads: Callable[[], Tensor | None],
                 load_encoder: Callable[[], SentenceEncoder | None] = lambda: None):
        self.archive, self.cache, self.adapter, self.probe, self.find_heads = archive, cache, adapter, probe, find_heads
        self.load_encoder = load_encoder
        self._texts: dict[tuple[int, int], MessageText] = {}  # by (message, pieces)
        self._vectors: dict[str, Tensor] = {}  # the encoder's vector of a message's words as read, while archived
        self._day_turns: dict[str, tuple] = {}  # a day's turn: keys as if at position 0, values, positions, indices

    @functools.cached_property
    def reference_question(self) -> tuple[Tensor, slice]:
        return self.probe.question_ids(self.adapter.chat.question_parts(REFERENCE_QUESTION))

    def retrieve(self, ids: Tensor, content: slice, budget: int, evidence: int, spare: int = 0,
                 inputs_from: int = 0) -> Retrieval:
        """`retrieve_steps`, its forward run by the memory alone."""
        return self.probe.run_steps(self.retrieve_steps(ids, content, budget, evidence, spare, inputs_from))

    def retrieve_steps(self, ids: Tensor, content: slice, budget: int, evidence: int, spare: int = 0,
                       inputs_from: int = 0) -> Generator:
        """Place the archived blocks that the question (`ids`, its own words at `content`) scores best, up to
        `budget` tokens, after the cache's own (the caller truncates the cache back afterwards); and its `evidence`
        best inputs, held by the cache or not (those from stream index `inputs_from` on: the system turn before
        them is no input). `spare`: tokens beyond the budget for the days said after blocks retrieved out of their
        day (`_place`)."""
        archive = self.archive
        if not archive.enabled or not archive.blocks or (budget <= 0 and evidence <= 0):
            return Retrieval()
        blocks = list(archive.blocks)
        held = self.held(blocks)
        candidates = [b for b, h in zip(blocks, held) if not h and b.length <= budget]
        in_cache = [b for b, h in zip(blocks, held) if h]
        if not candidates and (evidence <= 0 or not in_cache):
            return Retrieval()
        question = yield from self.probe.content_query_steps(ids, content)  # a step: with other memories' at once
        scored = candidates + in_cache
        texts = self.message_texts(scored)
        text = self.question_text(ids, content)
        words = text_words(without_order(text))
        scores = self.matched(self.index(question[0]).scores(question, scored), scored, text, texts)
        out = Retrieval(unseen=self.unseen(text, scored, texts))
        if evidence > 0:
            held_now = [False] * len(candidates) + [True] * len(in_cache)
            inputs = [i for i, b in enumerate(scored) if b.first_seq >= inputs_from]
            best = ranked([scored[i] for i in inputs], scores[inputs], [held_now[i] for i in inputs], self.quote,
                          max(evidence, ORDER_AMONG))
            out.evidence = in_asked_order(best, asked_order(text), evidence, self.same_thing(best, scored, texts))
            out.unattributed = unattributed(text, best, {t.speaker for t in texts.values() if t.speaker})
        if candidates and budget > 0:
            best = [candidates[i] for i in torch.argsort(scores[: len(candidates)], descending=True)[:NAMING_BEST]]
            names = self.naming(words, texts, best)
            said = {m: t.said for m, t in texts.items()}
            out.placed = self._arrange(candidates, in_cache, scores, names, said, words, budget, asks_when(text))
            if out.placed:
                self._place(out.placed, spare)
        return out

    def _arrange(self, candidates: list, in_cache: list, scores: Tensor, names: dict[int, float],
                 said: dict[int, frozenset], words: frozenset[str], budget: int, when: bool = False) -> list:
        """The blocks to place, in placing order, up to `budget` tokens (`scores`: every block's, candidates first,
        then `in_cache`'s; `names`: each message's share of what the question names; `said`: what each says;
        `words`: the question's; `when`: whether it asks when). A message told again since with what the question
        asks changed is left out, and one that only names the subject again where another holds news
        (`telling_nothing`), and for a question that asks when, one that names only part of what another names of
        it (`naming_less`). The candidates are
        chosen on their scores, one of each thing said again, and placed best nearest the question; nearer still
        the chosen messages that name what the question names most, and copies of the blocks the cache holds that
        name it as much and are newer, or that score about as well as the best candidate (a value told again since,
        a light that changed): these by how much they name it, the most nearest, and of those that name it alike
        the newest nearest."""
        count = len(candidates)
        top = max(names.get(b.message, 0.0) for b in candidates)

        def names_most(block) -> bool:
            return top >= NAMES_QUESTION and names.get(block.message, 0.0) >= top - NAMING_TOLERANCE

        newest = max((b.first_seq for b in candidates if names_most(b)), default=-1)
        bar = scores[:count].max() - CACHE_ANSWERS_MARGIN * scores.std()
        copies, used = [], 0
        for i in sorted(range(len(in_cache)), key=lambda i: -in_cache[i].first_seq):  # newest first
            block = in_cache[i]
            if scores[count + i] >= bar or (names_most(block) and block.first_seq > newest):
                if used + block.length > budget // 2:
                    break
                copies.append(block)
                used += block.length
        chosen = self._choose(candidates, scores[:count], said, budget - used)
        if not chosen:
            return []
        silent = self.telling_nothing([b for b in candidates + in_cache if names_most(b)], said, words)
        # A message without news tells no value again (a short mention, "the code of the red locker came up
        # again", differs from its fact in two words as a new value does).
        outdated = self.restated_since([b for b in chosen + in_cache if names_most(b) and b.message not in silent],
                                       names, said, words)
        left_out = outdated | silent
        if when:
            left_out |= self.naming_less([b for b in chosen + copies if names_most(b)], said, words)
        chosen = [b for b in chosen if b.message not in left_out]
        copies = [b for b in copies if b.message not in left_out]
        return (best_last([b for b in chosen if not names_most(b)])
                + sorted([b for b in chosen if names_most(b)] + copies,
                         key=lambda b: (round(names.get(b.message, 0.0) / NAMING_STEP), b.first_seq)))

    @staticmethod
    def telling_nothing(blocks: list, said: dict[int, frozenset], question: frozenset[str]) -> set[int]:
        """The messages of `blocks` (those that name the question) without news: each of their words beyond the
        question's (`question`) is said by more than NEWS_MESSAGES of them (`said`: what each says). Empty unless
        another holds news. Such a message names the subject again ("the tag on pallet 93 came up in the morning
        meeting"), not its value."""
        messages = {b.message: said.get(b.message, frozenset()) - question for b in blocks}
        held = Counter(w for words in messages.values() for w in words)
        telling = {m for m, words in messages.items() if any(held[w] <= NEWS_MESSAGES for w in words)}
        return set(messages) - telling if telling else set()

    @staticmethod
    def naming_less(blocks: list, said: dict[int, frozenset], question: frozenset[str]) -> set[int]:
        """The messages of `blocks` whose words of the question (`question`; `said`: what each says) are fewer than,
        and all among, another's: "Door D1 light is green" beside "Door D1 light turned red" for "At what time did
        the light of door D1 turn red?". Asked when, the small model copies the time beside the first message that
        names the subject, not the one that names the moment asked (docs/archive.md)."""
        named = {b.message: said.get(b.message, frozenset()) & question for b in blocks}
        return {m for m, words in named.items() if any(words < other for other in named.values())}

    @staticmethod
    def restated_since(blocks: list, names: dict[int, float], said: dict[int, frozenset],
                       question: frozenset[str]) -> set[int]:
        """The messages of `blocks` that a newer one among them tells again with what the question asks changed,
        naming the question as much (`names`: each message's share of what the question (its `question` words)
        names; `said`: what each says)."""
        newest_first = sorted({b.message: b.first_seq for b in blocks}.items(), key=lambda m: -m[1])
        outdated = set()
        for i, (older, _) in enumerate(newest_first):
            for newer, _ in newest_first[:i]:
                alike = round(names.get(older, 0.0) / NAMING_STEP) == round(names.get(newer, 0.0) / NAMING_STEP)
                if alike and restated(said.get(older, frozenset()), said.get(newer, frozenset()), question,
                                      RESTATED_WORDS):
                    outdated.add(older)
                    break
        return outdated

    def message_texts(self, blocks: list[ArchivedBlock]) -> dict[int, MessageText]:
        """What each message holds (`MessageText`), its pieces among `blocks` taken together; read once per
        message."""
        pieces: dict[int, list[ArchivedBlock]] = {}
        for block in blocks:
            pieces.setdefault(block.message, []).append(block)
        texts = {}
        for message, parts in pieces.items():
            key = (message, len(parts))  # fewer pieces once its oldest left the archive
            if key not in self._texts:
                ids = [t for b in sorted(parts, key=lambda b: b.first_seq) for t in self.archive.block_token_ids(b)
                       if t >= 0]
                text = self.adapter.decode(ids) if ids else ""
                read = as_read(text)
                self._texts[key] = MessageText(text_words(text), said_words(text), terms(text), asks(text),
                                               speaker(read), " ".join(TIME_MARKER.sub(" ", read).split()))
            texts[message] = self._texts[key]
        self._texts = {key: t for key, t in self._texts.items() if key[0] in pieces}
        reads = {t.read for t in self._texts.values()}
        self._vectors = {read: v for read, v in self._vectors.items() if read in reads}
        return texts

    def question_text(self, ids: Tensor, content: slice) -> str:
        """A question's own text (its ids at `content`)."""
        return self.adapter.decode(ids[content].tolist())

    @staticmethod
    def naming(words: frozenset[str], texts: dict[int, MessageText],
               best: list[ArchivedBlock] | None = None) -> dict[int, float]:
        """Each message's share of what the question (its `words`) names, over the words the messages of `best`
        (None: of all) share with the question (engine/archive/naming.py; `texts`: message_texts)."""
        messages = list(texts)
        best_messages = set(messages) if best is None else {b.message for b in best}
        shares = naming_shares(words, [texts[m].words for m in messages],
                               [i for i, m in enumerate(messages) if m in best_messages])
        return dict(zip(messages, shares))

    def matched(self, scores: Tensor, blocks: list[ArchivedBlock], question: str,
                texts: dict[int, MessageText]) -> Tensor:
        """`scores` (the index's, of `blocks`) with the words added: each block's message's share of the
        question's words (WORD_MATCH_WEIGHT), its BM25 score for them (LEXICAL_WEIGHT, in proportion to the best
        message's) and its likeness in meaning (SEMANTIC_WEIGHT), the words that ask for the newest or the oldest
        moment aside; then the message after one that asks lifted to REPLY_SHARE of the asking one's score."""
        if len(blocks) < 2:
            return scores
        question = without_order(question)
        spread = scores.std()
        messages = list(texts)
        held = set().union(*(texts[m].terms for m in messages))
        friends = false_friends(question, held)  # matched by words, a name's held half finds another thing
        shares = self.naming(frozenset(w for w in text_words(question) if stem(w) not in friends), texts)
        asked = Counter({t: n for t, n in terms(question).items() if t not in friends})
        lexical = dict(zip(messages, bm25(asked, [texts[m].terms for m in messages])))
        best = max(lexical.values(), default=0.0)
        unsaid = any(word not in held for word in terms(question))
        weight, power = (UNSAID_SEMANTIC_WEIGHT, UNSAID_MEANING_POWER) if unsaid else (SEMANTIC_WEIGHT, MEANING_POWER)
        meaning = self.meaning(question, texts, power)
        added = [WORD_MATCH_WEIGHT * shares.get(b.message, 0.0)
                 + (LEXICAL_WEIGHT * lexical.get(b.message, 0.0) / best if best > 0 else 0.0)
                 + weight * meaning.get(b.message, 0.0) for b in blocks]
        scores = scores + spread * torch.tensor(added, dtype=scores.dtype, device=scores.device)
        return self.replies_lifted(scores, blocks, texts)

    def likeness(self, question: str, texts: dict[int, MessageText]) -> Tensor | None:
        """Each message's cosine to the question, the encoder's (in the order of `texts`); None without an encoder.
        A message is read once (its vector kept while it is archived)."""
        encoder = self.load_encoder()
        if encoder is None:
            return None
        new = sorted({t.read for t in texts.values()} - self._vectors.keys())
        if new:
            self._vectors.update(zip(new, encoder.embed(new)))
        return similarities(encoder.embed([" ".join(question.split())])[0],
                            torch.stack([self._vectors[t.read] for t in texts.values()]))

    def meaning(self, question: str, texts: dict[int, MessageText], power: float = 1.0) -> dict[int, float]:
        """Each message's similarity in meaning to the question (the encoder's), from 0 for the least similar to 1
        for the most, raised to `power`; empty without an encoder (or with SEMANTIC_WEIGHT 0). A message is read
        once (its vector kept while it is archived)."""
        alike = self.likeness(question, texts) if SEMANTIC_WEIGHT > 0 and len(texts) > 1 else None
        if alike is None:
            return {}
        messages = list(texts)
        low, high = float(alike.min()), float(alike.max())
        if high - low <= 1e-6:
            return {}
        return dict(zip(messages, (((alike - low) / (high - low)) ** power).tolist()))

    def unseen(self, question: str, blocks: list[ArchivedBlock], texts: dict[int, MessageText]) -> bool:
        """Whether the question asks if a thing was seen that no text of `blocks` names (none of the question's words
        but its form's held by any, nor but a name's held half beside a word none holds: `thing_held`) or is like
        in meaning (every cosine to the words that name the thing below NOT_SEEN_LIKENESS); False where it names no
        thing, where the blocks hold a frame (what a camera saw has no words) or the encoder cannot judge."""
        thing = thing_terms(question)
        if not asks_if_seen(question) or not thing or not texts or any(b.frame for b in blocks):
            return False
        if thing_held(question, set().union(*(t.terms for t in texts.values()))):
            return False
        alike = self.likeness(thing_words(question), texts)
        return alike is not None and float(alike.max()) < NOT_SEEN_LIKENESS

    def same_thing(self, entries: list[Evidence], blocks: list[ArchivedBlock],
                   texts: dict[int, MessageText]) -> list[bool] | None:
        """For each entry (ranked evidence of `blocks`), whether its message tells of the same thing as the
        heaviest's, by the encoder's likeness of the two (SAME_THING_LIKENESS); None where the encoder has not read
        the heaviest (none, or a frame)."""
        message = {b.first_seq: b.message for b in blocks}  # each entry is one of `blocks`, its message in `texts`
        reads = [texts[message[e.first_seq]].read for e in entries]
        vectors = [self._vectors.get(read) if read else None for read in reads]
        if not vectors or vectors[0] is None:
            return None
        return [v is not None and float(v @ vectors[0]) >= SAME_THING_LIKENESS for v in vectors]

    def replies_lifted(self, scores: Tensor, blocks: list[ArchivedBlock], texts: dict[int, MessageText]) -> Tensor:
        """`scores` (of `blocks`) with each message that follows one that asks (in the stream's order, over the
        whole archive) scored at least REPLY_SHARE of the asking message's best block, both above the lowest."""
        if REPLY_SHARE <= 0:
            return scores
        before, previous = {}, None
        for block in self.archive.blocks:
            if block.message != previous:
                before.setdefault(block.message, previous)
                previous = block.message
        best: dict[int, float] = {}
        for block, score in zip(blocks, scores.tolist()):
            best[block.message] = max(best.get(block.message, score), score)
        floor = float(scores.min())
        lifted = scores.clone()
        for i, block in enumerate(blocks):
            asker = before.get(block.message)
            if asker in best and texts[asker].asks:
                lifted[i] = max(float(lifted[i]), floor + REPLY_SHARE * (best[asker] - floor))
        return lifted

    def _choose(self, candidates: list, archived: Tensor, said: dict[int, frozenset], budget: int) -> list:
        """The candidates to place, best first, up to `budget` tokens; of messages that say the same (a subject
        named again in the same words, time aside), the best-scored only: copies would crowd out what differs."""
        # Best first; a piece of a long message brings the rest of it, nearest pieces first, as far as the
        # budget goes (a fact cut between two blocks comes back whole).
        pieces: dict[int, list] = {}
        for block in candidates:
            pieces.setdefault(block.message, []).append(block)
        chosen, taken, used, messages = [], set(), 0, set()
        sayings: set[frozenset] = set()
        for i in torch.argsort(archived, descending=True, stable=True).tolist():
            block = candidates[i]
            if block.index in taken or used + block.length > budget:
                continue
            saying = said.get(block.message, frozenset())
            if block.message not in messages and saying and saying in sayings:
                continue
            messages.add(block.message)
            sayings.add(saying)
            for piece in sorted(pieces[block.message], key=lambda b: abs(b.first_seq - block.first_seq)):
                if piece.index not in taken and used + piece.length <= budget:
                    chosen.append(piece)
                    taken.add(piece.index)
                    used += piece.length
            if budget - used < 1:
                break
        return chosen

    def recall(self, ids: Tensor, content: slice, limit: int, since: float | None = None, until: float | None = None,
               near: tuple[float, float, float] | None = None, camera: str = "",
               inputs_from: int = 0) -> list[Evidence]:
        """The moments a text (`ids`, its words at `content`) points to most, best first: the archive's blocks (held
        by the cache or not) of the inputs from stream index `inputs_from` on, stamped between `since` and `until`
        (stream time), with `near` (x, y, radius) whose pose lies within the radius, and with `camera` that camera's
        frames only."""
        blocks = [b for b in self.archive.blocks
                  if b.first_seq >= inputs_from
                  and (since is None or (b.stamp is not None and b.stamp >= since))
                  and (until is None or (b.stamp is not None and b.stamp <= until))
                  and (near is None or (b.pose is not None and b.pose.distance_to(near[0], near[1]) <= near[2]))
                  and (not camera or (b.frame and b.camera == camera))]
        if not blocks or not self.archive.enabled:
            return []
        question = self.probe.content_queries(ids, content)
        texts = self.message_texts(list(self.archive.blocks))  # rarity over the whole memory
        text = self.question_text(ids, content)
        scores = self.matched(self.index(question[0]).scores(question, blocks), blocks, text, texts)
        best = ranked(blocks, scores, self.held(blocks), self.quote, max(limit, ORDER_AMONG))
        return in_asked_order(best, asked_order(text), limit, self.same_thing(best, blocks, texts))

    def held(self, blocks: list[ArchivedBlock]) -> list[bool]:
        """Whether the cache still holds each archived block, whole, in every layer-head."""
        first = torch.tensor([b.first_seq for b in blocks], dtype=torch.long)
        end = torch.tensor([b.seq_end for b in blocks], dtype=torch.long)
        return self.cache.holds(first, end).tolist()

    def quote(self, block: ArchivedBlock) -> str:
        """A text block's words as the model read them, the whole message where a long one was cut into pieces,
        its time marker kept and the chat template's role names taken out."""
        pieces = sorted((b for b in self.archive.blocks if b.message == block.message), key=lambda b: b.first_seq)
        ids = [t for piece in pieces or [block] for t in self.archive.block_token_ids(piece) if t >= 0]
        return as_read(self.adapter.decode(ids))

    def index(self, queries: Tensor) -> RetrievalIndex:
        """The archive's index, made at the memory's first retrieval: on the model's retrieval heads (every head of
        the middle half of the layers where they cannot be found), with the reference question asked of the
        memory as it is then."""
        if self.archive.index is None:
            heads = self.find_heads()
            if heads is None:
                heads = middle_layers(*queries.shape[:2])
            self.archive.build_index(heads, self.probe.content_queries(*self.reference_question), queries.device)
        return self.archive.index

    def _place(self, chosen: list, spare: int = 0) -> None:
        """Splice archived blocks after the cache's, in the order given, each re-rotated to sit there. Where some are
        of another day than the newest input's, each run of blocks of one day is followed by that day as a user turn
        of its own ("[8 May 2023]"), while `spare` tokens hold them: a block's marker said its day only where the
        input before it was of another day, so placed elsewhere it would read as the day around it. After the
        blocks, as a marker follows its text: a small model asked when reads the time that follows a mention
        (docs/method.md, "Time markers")."""
        clock = self.probe.marker_clock
        days = [None if b.stamp is None else clock.day(b.stamp) for b in chosen]
        today = clock.day(clock.previous) if clock.previous is not None else None
        if today is None or all(day in (None, today) for day in days):
            self._splice(chosen)
            return
        runs: list[tuple[str | None, list]] = []
        for block, day in zip(chosen, days):
            if runs and (day is None or day == runs[-1][0]):
                runs[-1][1].append(block)
            else:
                runs.append((day, [block]))
        for day, blocks in runs:
            self._splice(blocks)
            if day is not None:
                spare -= self.place_day(f"[{day}]", spare)

    def place_day(self, turn: str, spare: int) -> int:
        """Put a day's turn after the cache's own where it fits in `spare` tokens; the tokens it took. Its keys and
        values come from a forward the first time (then kept, as if at position 0) and are placed as an archived
        block is after that: a forward of a few tokens costs as much as a whole answer's retrieval."""
        kept = self._day_turns.get(turn)
        if kept is None:
            cost = self.probe.turn_tokens(turn)
            if cost > spare:
                return 0
            first = self.cache.fill
            self.probe.place_turn(turn)
            keys, values, start, seq = self.cache.tail(first)
            layers, heads = keys.shape[:2]
            rel = start - start[0]
            at_zero = shift_rotary(keys.flatten(0, 1), -start[0].expand(layers * heads, len(start)).to(keys.device),
                                   self.archive.inv_freq).view_as(keys)
            self._day_turns[turn] = (at_zero.clone(), values.clone(), rel, seq)
            while len(self._day_turns) > DAY_TURNS_KEPT:
                del self._day_turns[next(iter(self._day_turns))]
            return cost
        keys, values, rel, seq = kept
        if len(rel) > spare:
            return 0
        start = rel + self.cache.next_position
        layers, heads = keys.shape[:2]
        shift = torch.full((layers * heads, len(rel)), self.cache.next_position, device=keys.device)
        placed = shift_rotary(keys.flatten(0, 1), shift, self.archive.inv_freq).view_as(keys)
        self.cache.splice(placed, values, start, start + 1, seq, torch.zeros(len(rel), dtype=torch.bool))
        return len(rel)

    def _splice(self, chosen: list) -> None:
        """Splice archived blocks after the cache's, in the order given, each re-rotated to sit there."""
        if not chosen:
            return
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
