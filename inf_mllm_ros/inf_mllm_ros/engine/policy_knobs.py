"""The eviction policies' settings (knobs) by policy name, and the registry of policies, without torch.

The shipped policies' knobs are declared here, once, as the fields of a small dataclass named for the policy;
the policy (its own file in policies/) takes them as its own dataclass fields with `takes_knobs`. So the
node's parameter table (settings.py) and the launch file read every shipped policy's knobs without importing
torch. A policy added in a file of its own declares its knobs there (`knob`) and joins `policy_knobs` when it
registers.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import ClassVar


def knob(default, doc: str, *, low: float | None = None, high: float | None = None, step: int = 1,
         live: bool = False):
    """A policy setting: a dataclass field whose metadata says what it means, its range (numbers only) and
    whether it may change while the stream runs (`live`). The node turns each knob into a parameter of the
    same name."""
    return field(default=default, metadata={"doc": doc, "low": low, "high": high, "step": step, "live": live})


# Knobs that several policies share, defined once so that they mean the same everywhere.
def _sink_size():
    return knob(4, "The stream's first tokens (attention sinks), always kept.", low=0, high=1024)


def _recent_size():
    return knob(0, "Newest tokens always kept; 0: a quarter of cache_size.", low=0, high=1 << 20)


@dataclass
class FullKnobs:
    """The full cache: no settings."""

    name: ClassVar[str] = "full"


@dataclass
class WindowKnobs:
    """The sliding window: no settings (its size is the cache's)."""

    name: ClassVar[str] = "window"


@dataclass
class StreamingLLMKnobs:
    """StreamingLLM: how many sinks."""

    name: ClassVar[str] = "streaming_llm"
    sink_size: int = _sink_size()


@dataclass
class H2OKnobs:
    """H2O: the recent window."""

    name: ClassVar[str] = "h2o"
    recent_size: int = _recent_size()


@dataclass
class InfMLLMKnobs:
    """Inf-MLLM (inf_mllm.py says what each setting does to the score)."""

    name: ClassVar[str] = "inf_mllm"
    recent_size: int = _recent_size()
    sink_size: int = _sink_size()
    attention_bias: float = knob(
        1.0, "Bias of the eviction score toward newer tokens: a token twice as old keeps its slot against a "
        "younger one only if it has drawn 2^attention_bias times more attention; 0: early winners hold the "
        "memory.", low=0.0, high=100.0, live=True)
    score_memory: bool = knob(
        True, "Score a token by the decayed sum of the attention it has drawn since it arrived (attention that "
        "keeps coming adds up, and fades by memory_decay per eviction once it stops); false: by the newest "
        "block's attention alone.")
    memory_decay: float = knob(
        0.9, "With score_memory: the share of a token's remembered attention kept at each eviction (one per block "
        "of up to chunk_size tokens). 0.9 remembers about ten blocks; closer to 1, longer (1: never forgets, and "
        "only the age term moves the cache).", low=0.0, high=1.0, live=True)
    score_pool: int = knob(
        13, "A kept token keeps the tokens around it, in a centred window of this many slots (odd); "
        "1: single tokens.", low=1, high=255, step=2)
    text_share: float = knob(
        0.5, "Share of the candidate slots kept for the text tokens that have drawn the most attention (their "
        "age aside) whenever there is that much text, so a flood of camera frames cannot push the text out of "
        "memory; 0: text and frames compete on score alone.", low=0.0, high=1.0, live=True)
    pin_share: float = knob(
        0.5, "Share of the slots beside the sinks that pinned messages may hold whatever their score (those in the "
        "recent window count in it), the newest pins first; older pins compete on score. 0: pins are ignored.",
        low=0.0, high=1.0, live=True)

# The shipped policies' knobs by policy name.
SHIPPED_KNOBS: dict[str, dict[str, Field]] = {
    kind.name: {f.name: f for f in fields(kind)}
    for kind in (FullKnobs, WindowKnobs, StreamingLLMKnobs, H2OKnobs, InfMLLMKnobs)
}
# The policies (EvictionPolicy classes, engine/memory/policies/) by name, as their modules register them (`register`).
POLICIES: dict[str, type] = {}


def policy_knobs() -> dict[str, dict[str, Field]]:
    """Every policy's knobs by policy name: the shipped ones, and those of any policy registered since."""
    return {**SHIPPED_KNOBS, **{name: cls.knobs() for name, cls in POLICIES.items()}}


def takes_knobs(cls: type) -> type:
    """Give a policy class (before `@dataclass` makes it one) the knobs of its name as fields of its own."""
    annotations = cls.__dict__.get("__annotations__", {})
    cls.__annotations__ = annotations
    for name, f in SHIPPED_KNOBS[cls.name].items():
        annotations[name] = f.type
        setattr(cls, name, field(default=f.default, metadata=f.metadata))
    return cls


def knob_defaults(policy: str) -> dict:
    """The shipped settings of a policy."""
    return {n: f.default for n, f in policy_knobs()[policy].items()}
