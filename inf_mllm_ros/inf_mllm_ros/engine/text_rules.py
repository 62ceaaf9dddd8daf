"""What counts as text: one rule for every place that takes a text message or a question.

A text made only of U+FFFD replacement characters (bytes that were not UTF-8, as the ROS layer decodes
them) says nothing either, and is refused with that reason; a few among real characters are taken.

A text is blank, and refused as empty, when it has no character that shows: only whitespace,
control and format characters (zero-width space, joiners, word joiner, byte order mark, soft
hyphen, bidirectional marks...) and the other code points Unicode marks as ignorable by default
(variation selectors, Hangul fillers, tags). ``str.strip`` alone keeps a text of zero-width
characters, which tokenizes into tokens that say nothing.

Whitespace around a text says nothing and is taken off, wherever the text comes from (a topic, a service, a
questions file, a caller of the engine). A text longer than `max_text_chars` (the node's parameter, the engine's
`StreamConfig.max_text_chars`) is refused.

One rule, `checked_text`, for every place: a text is checked once, where it first comes in (the node's topic or
service, the bag tools, the engine's or the stream's own caller), with the same bound; it then travels as a
`CheckedText`, which the engine and the stream take as it is.
"""

from __future__ import annotations

import unicodedata
from typing import NoReturn

__all__ = ["CheckedText", "TextRefused", "checked_text", "is_blank", "is_undecodable", "text_problem"]

# What a decoder puts where bytes were not valid UTF-8 (the ROS layer does so for a string message).
REPLACEMENT = "\ufffd"

# Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt) that are not already
# control or format characters: invisible wherever they appear.
_IGNORABLE = (
    (0x034F, 0x034F),  # combining grapheme joiner
    (0x115F, 0x1160),  # Hangul choseong and jungseong fillers
    (0x17B4, 0x17B5),  # Khmer inherent vowels
    (0x180B, 0x180F),  # Mongolian free variation selectors and vowel separator
    (0x3164, 0x3164),  # Hangul filler
    (0xFE00, 0xFE0F),  # variation selectors
    (0xFFA0, 0xFFA0),  # halfwidth Hangul filler
    (0xFFF0, 0xFFF8),  # unassigned specials
    (0xE0000, 0xE0FFF),  # tags and variation selectors supplement
)
# General categories that never show: control, format, separators (space, line, paragraph).
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})


def _invisible(char: str) -> bool:
    if char.isspace() or unicodedata.category(char) in _INVISIBLE_CATEGORIES:
        return True
    code = ord(char)
    return any(low <= code <= high for low, high in _IGNORABLE)


def is_blank(text: object) -> bool:
    """True when ``text`` is not a string, or has no visible character (see the module's rule)."""
    if not isinstance(text, str):
        return True
    # Most texts show in their first characters: this returns at the first visible one.
    return all(_invisible(char) for char in text)


def is_undecodable(text: object) -> bool:
    """True when every visible character of ``text`` is U+FFFD: bytes that were not UTF-8, nothing to read."""
    return (isinstance(text, str) and REPLACEMENT in text
            and all(char == REPLACEMENT or _invisible(char) for char in text))


def text_problem(text: object, what: str = "text") -> str | None:
    """Why a text or a question says nothing the model could read (blank, or only invalid UTF-8), or None."""
    if is_blank(text):
        return f"empty {what}"
    if is_undecodable(text):
        return f"{what} refused: only replacement characters (U+FFFD), its bytes were not valid UTF-8"
    return None


# What a refused text message's reason adds, by its kind: what its sender can do.
TEXT_ADVICE = {"text_too_long": "; split it into shorter messages", "text_empty": " refused (no visible character)"}


class TextRefused(ValueError):
    """A text or a question refused, with its reason and its kind: `<what>_too_long`, `<what>_empty` or
    `<what>_undecodable` (`what`'s first word: text, question, recall)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


class CheckedText(str):
    """A text that passed `checked_text`."""

    __slots__ = ()


def checked_text(text: object, what: str = "text", max_chars: int | None = None) -> CheckedText:
    """`text` once checked (a `CheckedText` is returned as it is), without the whitespace around it: not longer
    than `max_chars` (None: no bound), not blank, not only invalid UTF-8. Raises TextRefused with the reason
    otherwise."""
    if isinstance(text, CheckedText):
        return text
    kind = what.split()[0]
    # The length first: the blank check reads up to the first visible character, which may be the last.
    if isinstance(text, str) and max_chars is not None and len(text) > max_chars and len(text.strip()) > max_chars:
        refused(f"{kind}_too_long", f"{what} of {len(text.strip())} characters refused: longer than "
                                    f"max_text_chars ({max_chars})")
    problem = text_problem(text, what)
    if problem:
        refused(f"{kind}_empty" if is_blank(text) else f"{kind}_undecodable", problem)
    return CheckedText(text.strip())


def refused(kind: str, reason: str) -> NoReturn:
    """Raise TextRefused with the reason and, for a text message, what its sender can do."""
    raise TextRefused(kind, reason + TEXT_ADVICE.get(kind, ""))
