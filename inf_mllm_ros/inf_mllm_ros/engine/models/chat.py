"""Turn a model's chat template into the pieces of an endless conversation.

A stream is a system turn followed by user turns (text messages, camera frames), questions and
answers. We never hold the whole history, so each turn's text is the difference between rendering a
short history with and without it. That works for any template that renders a history as a prefix of
a longer one (ChatML, Llama, Idefics3, Qwen2-VL, LLaVA); models without a template get a plain format.
Vision-language templates often take only a list of content parts ({"type": "text", ...}); those are
probed with that form.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, replace
from datetime import date, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..date_words import said_day

_MARK = "\u2063MARK\u2063"


@dataclass(frozen=True)
class ChatFormat:
    """The model's chat template cut into the pieces around a turn's content (system, user, assistant)."""

    system_prefix: str  # before the system prompt
    system_suffix: str  # after it, before the first user turn
    user_prefix: str
    user_suffix: str
    assistant_prefix: str  # the generation prompt after a question
    assistant_suffix: str  # closes an answer

    @classmethod
    def plain(cls) -> "ChatFormat":
        return cls("", "\n", "", "\n", "Answer:", "\n")

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatFormat":
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain()
        for parts in (False, True):
            try:
                return cls._derive(tokenizer, parts)
            except Exception:  # a template that refuses our probing histories in this form
                continue
        return cls.plain()

    @classmethod
    def _derive(cls, tokenizer, parts: bool = False) -> "ChatFormat":
        def render(messages, generation=False):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

        def msg(role, text):
            return {"role": role, "content": [{"type": "text", "text": text}] if parts else text}

        sys_only = render([msg("system", _MARK)])
        system_prefix, system_suffix = _split(sys_only)
        one = [msg("system", "S"), msg("user", "U")]
        two = one + [msg("user", _MARK)]
        user_prefix, user_suffix = _split(_delta(render(one), render(two)))
        ask = one + [msg("user", "Q")]
        assistant_prefix = _delta(render(ask), render(ask, generation=True))
        answered = ask + [msg("assistant", _MARK)]
        tail = _delta(render(ask, generation=True), render(answered))
        assistant_suffix = _split(tail)[1]
        return cls(system_prefix, system_suffix, user_prefix, user_suffix, assistant_prefix, assistant_suffix)

    # Each turn as (template before, content, template after), so that the content can be tokenized as plain
    # characters while the template keeps its control tokens (ModelAdapter.tokenize_turn); and as one string.
    def system(self, text: str) -> str:
        return "".join(self.system_parts(text))

    def user(self, text: str) -> str:
        return "".join(self.user_parts(text))

    def question(self, text: str) -> str:
        return "".join(self.question_parts(text))

    def system_parts(self, text: str) -> tuple[str, str, str]:
        return self.system_prefix, text, self.system_suffix

    def user_parts(self, text: str) -> tuple[str, str, str]:
        return self.user_prefix, text, self.user_suffix

    def question_parts(self, text: str) -> tuple[str, str, str]:
        return self.user_prefix, text, self.user_suffix + self.assistant_prefix


def check_stamp(stamp, what: str) -> None:
    """The one rule for an input's stamp: None, or a finite number of seconds; ValueError otherwise."""
    if stamp is not None and not (isinstance(stamp, numbers.Real) and not isinstance(stamp, bool)
                                  and math.isfinite(stamp)):
        raise ValueError(f"{what} stamp must be a finite number of seconds or None, got {stamp!r}")


CLOCKS = ("stream", "wall")


@dataclass(frozen=True)
class MarkerClock:
    """How an input's time reads to the model. "stream": time since the memory's first input, as h:mm:ss.s, after
    "day N," from its second day on (its first, day 0, goes unsaid); "wall": the time of day of its stamp in
    `time_zone`, as hh:mm:ss, after its date ("8 May 2023") (`origin`: the stamp, in seconds since the epoch, of
    stream time 0; without it, stream time).

    The day is said where it differs from the previous input's (`previous`: that input's stamp; None: the memory's
    first input): a memory that runs for days says which day each input came on, and a day of inputs pays for its
    date once. A run of blocks retrieved out of their day is followed by their day (engine/archive/retriever.py)."""

    kind: str = "stream"
    time_zone: str = "UTC"
    origin: float | None = None
    previous: float | None = None

    def __post_init__(self):
        if self.kind not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.kind!r}")
        zone_info(self.time_zone)

    def __call__(self, stamp: float) -> str:
        day, said = self.day(stamp), self.time_of_day(stamp)
        if self.previous is not None:
            before = self.day(self.previous)
        else:  # the memory's first input: the wall clock says its date, the stream clock leaves day 0 unsaid
            before = None if self._wall else self.day(0.0)
        if day == before:
            return said
        return f"{day} {said}" if self._wall else f"{day}, {said}"

    def after(self, stamp: float | None) -> "MarkerClock":
        """This clock for the input after one stamped `stamp` (None: unstamped, the day in force stays)."""
        return self if stamp is None else replace(self, previous=float(stamp))

    def day(self, stamp: float) -> str:
        """The day of a stamp as a marker says it: "8 May 2023" (wall), "day 2" (stream: days since its start; the
        first, day 0, goes unsaid until another day has been)."""
        if self._wall:
            return said_day(self._moment(stamp).date())
        return f"day {int(max(stamp, 0.0) // 86400)}"

    def date_of(self, stamp: float) -> date | None:
        """The calendar day of a stamp in the time zone, on the wall clock; None on the stream clock, which has
        none."""
        return self._moment(stamp).date() if self._wall else None

    def time_of_day(self, stamp: float) -> str:
        if self._wall:
            return self._moment(stamp).strftime("%H:%M:%S")
        minutes, seconds = divmod(max(stamp, 0.0) % 86400, 60.0)
        hours, minutes = divmod(int(minutes), 60)
        return f"{hours}:{minutes:02d}:{seconds:04.1f}"

    @property
    def _wall(self) -> bool:
        return self.kind == "wall" and self.origin is not None

    def _moment(self, stamp: float) -> datetime:
        return datetime.fromtimestamp(self.origin + stamp, zone_info(self.time_zone))


@functools.lru_cache(maxsize=None)
def zone_info(name: str) -> ZoneInfo:
    """The IANA time zone `name`; ValueError for one that is not known here."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"time zone {name!r} is not known (an IANA name such as 'UTC' or 'Europe/Berlin')") from exc


STREAM_CLOCK = MarkerClock()


def stamped(text: str, stamp: float | None, clock: MarkerClock = STREAM_CLOCK, camera: str = "") -> str:
    """Text as the model sees it: followed by the time it came at, when it has one (see check_stamp). After the
    text, not before: a small model asked when something happened reads the time that follows its mention
    (docs/method.md, "Time markers"). A frame of a named camera says which in its marker: "[rear 08:00:31]"."""
    said = [camera] if camera else []
    if stamp is not None:
        said.append(clock(float(stamp)))
    return f"{text} [{' '.join(said)}]" if said else text


def _split(text: str) -> tuple[str, str]:
    if text.count(_MARK) != 1:
        raise ValueError("template dropped or repeated the probe text")
    before, after = text.split(_MARK)
    return before, after


def _delta(shorter: str, longer: str) -> str:
    if not longer.startswith(shorter):
        raise ValueError("template does not render histories as prefixes of each other")
    return longer[len(shorter) :]
