"""Who said what: a question asked of one speaker whose evidence that speaker never said is answered as not
mentioned.

Texts often carry their speaker ("Nate: I dyed my hair purple", "R2: pallet 93 is at dock 4", "Operator: go to
dock 3"). A question that names one of the memory's speakers ("What colour did Joanna dye her hair?") asks what that
speaker said or did; where the inputs it points to most were all said by another, the memory holds it of someone
else, and a small model answers with the other's words as if they were the asked one's. A message of the asked
speaker that only asks ("Did you make it?") tells nothing of them; the reply to a message that asks is often the
second heaviest entry, after the asking one (engine/archive/lexical.py). Measured on LoCoMo's tuning conversations 26
and 41 (docs/benchmarks.md): of the questions whose right answer is that it was never said, 55 of 88 have neither of
their two heaviest entries a statement of the asked speaker; of the others, 19 of 283.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..answering import Evidence

# A speaker as a text names it before its words: one to three capitalised words (or a robot's name, "R2") and a
# colon at its start, after its time marker where it has one.
SPEAKER = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?([A-Z][\w'.-]*(?: [A-Z][\w'.-]*){0,2}):\s")
# The heaviest evidence entries one of which must be a statement of the asked speaker (tuned on LoCoMo's
# conversations 26 and 41: 1 caught more of the never-said questions but took 59 of 283 others; 3 took 7 but
# caught half as many).
ATTRIBUTION_DEPTH = 2
# Notes in brackets at a text's end: its time marker, a shared photo's caption.
TRAILING_NOTES = re.compile(r"(?:\s*\[[^\]]*\])+\s*$")


def speaker(text: str) -> str | None:
    """The speaker a text names before its words ("Nate: ..."), or None."""
    match = SPEAKER.match(text)
    return match.group(1) if match else None


def only_asks(text: str) -> bool:
    """Whether a text ends with a question (its bracketed notes aside): it asks, and tells nothing of its speaker."""
    return TRAILING_NOTES.sub("", text).rstrip().endswith("?")


def asked_speaker(question: str, speakers: Iterable[str]) -> str | None:
    """The one speaker of `speakers` the question names (as a word, "Joanna's" too); None where it names none or
    several (a question about two speakers may rest on either's words)."""
    named = {s for s in speakers if re.search(r"(?<![\w-])" + re.escape(s) + r"(?![\w-])", question)}
    return named.pop() if len(named) == 1 else None


def unattributed(question: str, evidence: Sequence[Evidence], speakers: Iterable[str],
                 depth: int = ATTRIBUTION_DEPTH) -> str:
    """The speaker the question asks of where none of the `depth` heaviest evidence entries is their statement (said
    by them, not only asking), else "": no speaker asked of, no evidence, a frame among them (a camera has no
    speaker), or one of them is."""
    asked = asked_speaker(question, speakers)
    heaviest = evidence[:depth]
    if asked is None or not heaviest or any(e.kind != "text" for e in heaviest):
        return ""
    told = any(speaker(e.text) == asked and not only_asks(e.text) for e in heaviest)
    return "" if told else asked


def not_mentioned(asked: str) -> str:
    """The answer to a question whose evidence its speaker never said."""
    return f"Not mentioned: nothing in memory says that of {asked}."


__all__ = ["ATTRIBUTION_DEPTH", "asked_speaker", "not_mentioned", "only_asks", "speaker", "unattributed"]
