"""What a stream's answer is, and one answer's own state while it is decoded.

`KVStream.ask` (engine/runtime/stream.py) tokenizes a question as a turn of the chat template, has the archive's best
blocks for it placed after the cache's (engine/archive/retriever.py) and decodes the answer greedily, in the cache's
headroom (then taken away again) or kept in the memory as a dialogue turn. `AnswerTurn` is what belongs to one
answer alone: whom to tell the answer so far, and the caller's cancel.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from .poses import Pose

# The most characters of a text quoted in an evidence entry.
QUOTE_CHARS = 200

# A question that asks when (English): "When did you see the cart?", "At what time did D1 turn red?", "On which day
# ...?". Its answer is a moment, said as the memory says it (StreamConfig.when_prompt).
ASKS_WHEN = re.compile(r"^\W*(?:when\b|(?:(?:at|on|in|by|from|since|until)\s+)?(?:what|which)\s+"
                       r"(?:time|date|day|week|month|year|hour)\b)", re.IGNORECASE)


def asks_when(question: str) -> bool:
    """Whether a question asks when something happened or will."""
    return ASKS_WHEN.match(question) is not None


# A question that asks how long ago (English): "How long ago did you see the cart?", "How many seconds ago ...?", "How
# long has it been since ...?". Its answer is the time between the moment and the question; "How many weeks passed
# between ...?" and "How long did you stay ...?" ask another span.
ASKS_HOW_LONG = re.compile(r"^\W*how\s+(?:long|many\s+(?:seconds|minutes|hours|days|weeks|months|years))\b"
                           r"(?=.*\b(?:ago|since)\b)", re.IGNORECASE)


def asks_how_long(question: str) -> bool:
    """Whether a question asks how long ago something happened."""
    return ASKS_HOW_LONG.match(question) is not None


def said_elapsed(seconds: float) -> str:
    """A span of time as an answer says it: seconds up to 10 minutes, minutes up to 2 hours, then hours, then days."""
    seconds = max(seconds, 0.0)
    if seconds < 600:
        return f"{seconds:.0f} seconds"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} hours"
    return f"{seconds / 86400:.0f} days"


@dataclass
class Evidence:
    """One input an answer rests on, or a moment a recall found."""

    stamp: float | None  # the input's stream time, where it had one
    kind: str  # "frame" or "text"
    source: str  # "cache": still held in the bounded cache; "archive": only in the archive
    pose: Pose | None  # where the robot was at the stamp, where known
    text: str  # the text's words (cut to QUOTE_CHARS); empty for a frame
    weight: float  # how much the question points to it (its retrieval score; higher: more)
    first_seq: int  # the stream index of its first token
    camera: str = ""  # the camera a frame came from, where the robot has several


# A time marker at the end of a quoted text: the note says the moment as the memory says it now.
_TRAILING_MARKER = re.compile(r"\s*\[[^\[\]]*\]\s*$")
# A date the words say of their own, as a text's relative dates are resolved (engine/date_words.py): "yesterday (7 May
# 2023)", "last month (April 2023)". What they tell of happened then, not when they were said.
_OWN_DATE = re.compile(r"\([^()]*\b\d{4}\)")


def time_note(question: str, evidence: list[Evidence], clock: Callable[[float], str], asked_at: float | None) -> str:
    """What follows the words of a question that asks when or how long ago (StreamConfig.time_note): its heaviest
    stamped evidence restated with its moment as a marker says it now, "(Memory: A blue barrel here. [08:04:38];
    when: 08:04:38)", or the time since it, "(Memory: A blue barrel here. [87 seconds ago])" (from `asked_at`). Asked
    when, the 0.5B default model wrote the time of another line than the heaviest evidence's, or a date for "When was
    the last time ...?"; it cannot subtract times for "how long ago"; said next to the question, it copies the moment
    (docs/archive.md, "When, said next to the question"). Words that say a date of their own ("yesterday (7 May
    2023)") are restated without the "when:", whose moment is when they were said. "" for other questions, or where
    no evidence has a stamp."""
    how_long = asks_how_long(question)
    if not (how_long or asks_when(question)):
        return ""
    heaviest = next((e for e in evidence if e.stamp is not None), None)
    if heaviest is None or (how_long and asked_at is None):
        return ""
    what = _TRAILING_MARKER.sub("", heaviest.text) or f"{heaviest.camera} camera frame".strip()
    if how_long:
        return f" (Memory: {what} [{said_elapsed(asked_at - heaviest.stamp)} ago])"
    moment = clock(heaviest.stamp)
    when = "" if _OWN_DATE.search(what) else f"; when: {moment}"
    return f" (Memory: {what} [{moment}]{when})"


DEFAULT_DESCRIPTION_PROMPT = "Describe briefly what the robot sees and what happened most recently."


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
    # The inputs the question pointed to most, heaviest first (engine/archive/evidence.py).
    evidence: list[Evidence] = field(default_factory=list)
    # Said to the model after the question's words: its heaviest evidence's moment (`time_note`); "" where none was.
    time_note: str = ""


class StreamStoppedError(RuntimeError):
    """The stream was asked to stop (shutdown) in the middle of an answer."""


class AnswerCancelledError(RuntimeError):
    """The caller cancelled the answer; the memory is as it was before the question."""


# Called after each generated token with the answer so far (text) and the number of tokens generated.
TokenCallback = Callable[[str, int], None]


@dataclass
class Question:
    """A question with `KVStream.ask`'s options, for answers decoded apart from their stream's own worker (several
    memories' answers in one batch: runtime/pool.py, runtime/model_bench.py)."""

    text: str
    max_new_tokens: int | None = None
    keep_in_memory: bool = False
    on_token: TokenCallback | None = None
    cancel: threading.Event | None = None
    asked_at: float | None = None  # the stream time it was asked at (None: the newest input's)

    def options(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, keep_in_memory=self.keep_in_memory, on_token=self.on_token,
                    cancel=self.cancel, asked_at=self.asked_at)


@dataclass
class AnswerTurn:
    """One answer's own state: whom to tell the answer so far (`on_token`), the caller's `cancel`, and whether the
    stream was asked to stop (`stopped`, read at each token)."""

    on_token: TokenCallback | None
    cancel: threading.Event | None
    stopped: Callable[[], bool]
    decode: Callable[[list[int]], str]  # the answer so far as text

    def check(self) -> None:
        """Raise where the stream was asked to stop or the caller cancelled the answer."""
        if self.stopped():
            raise StreamStoppedError("stopped while answering")
        if self.cancel is not None and self.cancel.is_set():
            raise AnswerCancelledError("cancelled")

    def report(self, tokens: list[int]) -> None:
        """Give the caller the answer so far."""
        if self.on_token is not None:
            self.on_token(self.decode(tokens), len(tokens))
