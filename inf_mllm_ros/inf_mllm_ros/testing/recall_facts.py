"""Facts to tell a stream and ask back long after, and the text to bury them in: a seeded generator whose tuning
seeds and report seeds are apart, so that defaults chosen on one set are reported on data they never saw.

A fact has a subject, a value of one of several kinds (a code, a person's name, a place, a colour, a count), the
message that tells it (in one of several phrasings), the question that asks it and the ways its subject is named
again without its value (mentions). Filler comes in several genres: technical documentation (Python's own
`pydoc_data.topics`), a robot's operations log and a crew's small talk (both generated); the tuning set's filler is
the novel beside the repository (benchmarks/common.py). Facts of one kind share their form, so a stream of
several is a test of telling siblings apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

KINDS = ("code", "person", "place", "colour", "count")
MENTIONS = ("checked", "log", "asked", "meeting")
GENRES = ("docs", "operations", "chat")
# Seeds of the report set start here; the tuning set's are below it. No default is chosen on a report seed.
REPORT_SEED_BASE = 100_000

ROOMS = ["the server room", "the loading bay", "the paint shop", "the north stairwell", "the cold store",
         "the tool crib", "the break room", "the battery room", "the clean room", "the mail room",
         "the control room", "the boiler room", "the print shop", "the first aid room", "the wash bay",
         "the parts cage", "the east dock", "the charging hall"]
ITEMS = ["the spare battery pack", "the torque wrench", "the pallet jack", "the thermal camera", "the first aid kit",
         "the label printer", "the spare lidar", "the floor scrubber", "the ladder", "the drill press key"]
FIRST = ["Ingrid", "Tomasz", "Amara", "Kenji", "Lucia", "Bilal", "Siobhan", "Mateo", "Priya", "Oskar", "Yara",
         "Dmitri", "Chioma", "Henrik", "Noor", "Rafael"]
LAST = ["Okafor", "Lindqvist", "Haddad", "Moreau", "Tanaka", "Ferreira", "Novak", "Brennan", "Castillo", "Adeyemi",
        "Kowalski", "Sato", "Varga", "Quinn"]
COLOURS = ["orange", "purple", "teal", "maroon", "yellow", "silver", "crimson", "olive"]
THINGS = ["fire extinguishers", "helmets", "spare wheels", "storage bins", "safety vests", "hand scanners"]


@dataclass(frozen=True)
class Fact:
    """A fact to tell and ask: `value` in the answer counts as recalled (case aside)."""

    kind: str
    subject: str
    value: str
    message: str
    question: str
    mentions: tuple[str, ...]  # the subject named again without its value, one per style
    phrasing: str  # the message with "{v}" where the value goes (told_again)

    def recalled(self, answer: str) -> bool:
        return self.value.lower() in answer.lower()


def _value(kind: str, rng: random.Random, room: str) -> tuple[str, str]:
    """A value of `kind`: (as the message says it, as an answer must hold it)."""
    if kind == "code":
        value = str(rng.randint(1000, 9999))
    elif kind == "person":
        value = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    elif kind == "place":
        place = rng.choice([r for r in ROOMS if r != room])
        return place, place.removeprefix("the ")
    elif kind == "colour":
        value = rng.choice(COLOURS)
    elif kind == "count":
        value = str(rng.randint(13, 97))
    else:
        raise ValueError(f"unknown kind of fact {kind!r}; choose one of {KINDS}")
    return value, value


def _fact(kind: str, rng: random.Random, index: int) -> Fact:
    """The `index`-th fact of a kind (its subject distinct from the others of that kind in the stream)."""
    room = ROOMS[index % len(ROOMS)]
    item = f"{ITEMS[index % len(ITEMS)]} {chr(65 + index % 26)}{rng.randint(2, 9)}"
    pallet = f"pallet {rng.randint(10, 99)}"
    things = THINGS[index % len(THINGS)]
    subject, question, phrasings = {
        "code": (f"the door code of {room}", f"What is the door code of {room}?",
                 ["For the record, the door code of {r} is {v}.", "The door code of {r} was set to {v}.",
                  "Note: {r} now opens with door code {v}."]),
        "person": (f"the person on call for {room}", f"Who is on call for {room}?",
                   ["The person on call for {r} today is {v}.", "{v} is on call for {r} this shift.",
                    "If anything breaks in {r}, call {v}: on call today."]),
        "place": (item, f"Where is {item}?",
                  ["{I} is stored in {v}.", "Someone moved {i} to {v}.", "You will find {i} in {v} from now on."]),
        "colour": (f"the tag on {pallet}", f"What colour is the tag on {pallet}?",
                   ["The tag on {p} is {v}.", "{P} carries a {v} tag.", "Mark it down: {p} got a {v} tag."]),
        "count": (f"the {things} in {room}", f"How many {things} are in {room}?",
                  ["There are {v} {t} in {r}.", "Inventory: {r} holds {v} {t}.", "We counted {v} {t} in {r} today."]),
    }.get(kind) or (None, None, None)
    if subject is None:
        raise ValueError(f"unknown kind of fact {kind!r}; choose one of {KINDS}")
    phrasing = rng.choice(phrasings).format(r=room, i=item, I=item[0].upper() + item[1:], p=pallet,
                                            P=pallet.capitalize(), t=things, v="{v}")
    phrasing = phrasing[0].upper() + phrasing[1:] if not phrasing.startswith("{v}") else phrasing
    said, value = _value(kind, rng, room)
    mentions = (f"A technician checked {subject} again.", f"Log entry: checked on {subject}, nothing changed.",
                f"Someone asked about {subject} earlier.", f"{subject[0].upper() + subject[1:]} came up in the "
                                                           "morning meeting.")
    return Fact(kind, subject, value, phrasing.format(v=said), question, mentions, phrasing)


def told_again(fact: Fact, seed: int) -> Fact:
    """The same subject with a new value of its kind, told in the same words: a value that changed since."""
    rng = random.Random(f"again-{seed}-{fact.subject}")
    while True:
        said, value = _value(fact.kind, rng, "")
        if value.lower() != fact.value.lower():
            return replace(fact, value=value, message=fact.phrasing.format(v=said))


def facts(seed: int, n: int, kinds: tuple[str, ...] = KINDS) -> list[Fact]:
    """n facts of the given kinds in turn, drawn with `seed` (report seeds: REPORT_SEED_BASE and above)."""
    rng = random.Random(f"facts-{seed}")
    offset = rng.randrange(len(ROOMS))
    told: list[Fact] = []
    for i in range(n):
        fact = _fact(kinds[i % len(kinds)], rng, offset + i // len(kinds) + i)
        while any(f.subject == fact.subject for f in told):  # a pallet's number drawn twice
            fact = _fact(kinds[i % len(kinds)], rng, offset + i // len(kinds) + i)
        told.append(fact)
    return told


def _paragraphs(text: str, chars: int) -> list[str]:
    out, cur, size = [], [], 0
    for word in text.split():
        cur.append(word)
        size += len(word) + 1
        if size >= chars:
            out.append(" ".join(cur))
            cur, size = [], 0
    return out


def _operations(rng: random.Random, n: int) -> list[str]:
    """A robot's operations log: status lines with numbers and places, none of them a fact's form."""
    lines = ["Conveyor {a} runs at {b} boxes per minute.", "Battery of robot R{a} at {b} percent, heading to charge.",
             "Route {a} cleared after a {b}-second stop.", "Shelf {a} in aisle {c} restocked with {b} cartons.",
             "Temperature in hall {a} reads {b} degrees.", "Forklift F{a} finished task {b} at bay {c}."]
    return [" ".join(rng.choice(lines).format(a=rng.randint(1, 40), b=rng.randint(10, 400), c=rng.randint(1, 12))
                     for _ in range(4)) for _ in range(n)]


def _chat(rng: random.Random, n: int) -> list[str]:
    """A crew's small talk: who said what about lunch, the weather and the shift, no fact's form."""
    said = ["{a}: did anyone see the match last night?", "{a}: the coffee machine on level {k} is fixed.",
            "{a}: rain again tomorrow, bring a jacket.", "{a}: I swapped my shift with {b} for Friday.",
            "{a}: lunch is at {k} past twelve today.", "{a}: {b} says the new boots are too stiff.",
            "{a}: the radio keeps playing the same {k} songs.", "{a}: my bike has a flat tyre, again."]
    return [" ".join(rng.choice(said).format(a=rng.choice(FIRST), b=rng.choice(FIRST), k=rng.randint(2, 40))
                     for _ in range(4)) for _ in range(n)]


def filler(genre: str, seed: int, chars: int = 260) -> list[str]:
    """Paragraphs of about `chars` characters of one genre, starting at a place drawn with `seed`."""
    rng = random.Random(f"filler-{genre}-{seed}")
    if genre == "docs":
        from pydoc_data.topics import topics

        paragraphs = _paragraphs("\n".join(topics[k] for k in sorted(topics)), chars)
    elif genre == "operations":
        return _operations(rng, 4000)
    elif genre == "chat":
        return _chat(rng, 4000)
    else:
        raise ValueError(f"unknown genre {genre!r}; choose one of {GENRES}")
    start = rng.randrange(max(len(paragraphs) - 400, 1))
    return paragraphs[start:] + paragraphs[:start]  # a long stream wraps around rather than ending
