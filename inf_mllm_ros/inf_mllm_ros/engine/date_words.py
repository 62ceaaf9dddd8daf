"""Relative dates in a text, followed by the date they mean on the day the text was said.

"I went to the clinic yesterday" said on 8 May 2023 reads to the model as "I went to the clinic yesterday (7 May
2023)". Weeks later the memory still knows which day that was: the text's own marker says the day it was said, but a
small model asked "when" copies the text's "yesterday" rather than work the day out from the marker. What is said:

- one day ("yesterday", "last night", "two days ago", "last Friday", "tomorrow", "next Tuesday"): the date, "7 May
  2023";
- a span ("last week", "this past weekend", "two weeks ago"): the span against the day said, "the week before 9 June
  2023";
- a month or a year ("last month", "next month", "three months ago", "last year", "ten years ago", "last summer"):
  "June 2023", "2022", "summer 2022".

English words only, as the answers' prompts are; a phrase already followed by a parenthesis is left as it is (a text
that was resolved before reads the same). The day is the text's stamp's day in the clock's time zone
(engine/models/chat.py, `MarkerClock.date_of`).
"""

from __future__ import annotations

import re
from datetime import date, timedelta

__all__ = ["said_day", "with_dates"]

_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
            "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20}
_NUMBER = r"(\d{1,2}|" + "|".join(_NUMBERS) + r")"
_WEEKDAYS = ("mon(?:day)?", "tue(?:s(?:day)?)?", "wed(?:nesday)?", "thu(?:r(?:s(?:day)?)?)?", "fri(?:day)?",
             "sat(?:urday)?", "sun(?:day)?")
_WEEKDAY = "(" + "|".join(_WEEKDAYS) + r")\.?"
_SEASON_ENDS = {"spring": 5, "summer": 8, "fall": 11, "autumn": 11}  # each season's last month
_PAST = r"(?:last|this past|the past)"


def said_day(day: date) -> str:
    """A day as markers and resolved dates say it: "7 May 2023"."""
    return f"{day.day} {day:%B %Y}"


def _number(word: str) -> int:
    return int(word) if word.isdigit() else _NUMBERS[word.lower()]


def _weekday(word: str) -> int:
    return next(i for i, pattern in enumerate(_WEEKDAYS) if re.fullmatch(pattern, word.lower().rstrip(".")))


def _month(day: date, months: int) -> str:
    """The month `months` after `day`'s (before, where negative): "June 2023"."""
    index = day.year * 12 + day.month - 1 + months
    return f"{date(index // 12, index % 12 + 1, 1):%B %Y}"


def _last_season(day: date, season: str) -> str:
    """The newest `season` over before `day`'s: "summer 2022" in August 2023 or in March 2023, "summer 2023" in
    October 2023."""
    year = day.year if day.month > _SEASON_ENDS[season] else day.year - 1
    return f"{season} {year}"


# Each phrase and what it means on the day `d`; the longer phrase first where one holds another.
_RULES = (
    (r"the day before yesterday", lambda m, d: said_day(d - timedelta(days=2))),
    (r"the day after tomorrow", lambda m, d: said_day(d + timedelta(days=2))),
    (r"yesterday|last night", lambda m, d: said_day(d - timedelta(days=1))),
    (r"tomorrow", lambda m, d: said_day(d + timedelta(days=1))),
    (rf"{_NUMBER} days? ago", lambda m, d: said_day(d - timedelta(days=_number(m[1])))),
    (rf"{_PAST} {_WEEKDAY}", lambda m, d: said_day(d - timedelta(days=(d.weekday() - _weekday(m[1])) % 7 or 7))),
    (rf"next {_WEEKDAY}", lambda m, d: said_day(d + timedelta(days=(_weekday(m[1]) - d.weekday()) % 7 or 7))),
    (rf"{_PAST} weekend|(?:a|one) weekend ago", lambda m, d: f"the weekend before {said_day(d)}"),
    (rf"{_NUMBER} weekends ago", lambda m, d: f"{m[1].lower()} weekends before {said_day(d)}"),
    (rf"{_PAST} week|(?:a|one) week ago", lambda m, d: f"the week before {said_day(d)}"),
    (rf"{_NUMBER} weeks ago", lambda m, d: f"{m[1].lower()} weeks before {said_day(d)}"),
    (r"next weekend", lambda m, d: f"the weekend after {said_day(d)}"),
    (r"next week", lambda m, d: f"the week after {said_day(d)}"),
    (r"last month|(?:a|one) month ago", lambda m, d: _month(d, -1)),
    (rf"{_NUMBER} months ago", lambda m, d: _month(d, -_number(m[1]))),
    (r"this month", lambda m, d: _month(d, 0)),
    (r"next month", lambda m, d: _month(d, 1)),
    (r"last year|(?:a|one) year ago", lambda m, d: str(d.year - 1)),
    (rf"{_NUMBER} years ago", lambda m, d: str(d.year - _number(m[1]))),
    (r"this year", lambda m, d: str(d.year)),
    (r"next year", lambda m, d: str(d.year + 1)),
    (r"last (spring|summer|fall|autumn)", lambda m, d: _last_season(d, m[1].lower())),
)
_PHRASES = [(re.compile(rf"\b{pattern}\b", re.IGNORECASE), meaning) for pattern, meaning in _RULES]


def with_dates(text: str, day: date) -> str:
    """`text` with each relative date it says followed by the date it means, `text` said on `day`."""
    found = []
    for pattern, meaning in _PHRASES:
        for m in pattern.finditer(text):
            if not any(m.start() < end and start < m.end() for start, end, _ in found):
                found.append((m.start(), m.end(), meaning(m, day)))
    out, at = [], 0
    for start, end, meant in sorted(found):
        if re.match(r"\s*\(", text[end:]):
            continue  # resolved already
        out += [text[at:end], f" ({meant})"]
        at = end
    return "".join(out + [text[at:]])
