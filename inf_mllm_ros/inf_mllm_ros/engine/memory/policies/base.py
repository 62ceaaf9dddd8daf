"""What every eviction policy shares: the view of one layer's slots, the settings (knobs), the base class,
the registry of policies by name, and the selection helpers that several policies use.

A policy file (full.py, window.py, ...) holds one `EvictionPolicy` subclass, decorated with `@register`;
importing it makes the policy selectable by name, and the node makes a parameter of each of its knobs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import Field, dataclass, field, fields
from typing import ClassVar

import torch
from torch import Tensor

from ...value_rules import as_declared, setting_problem
from ...policy_knobs import POLICIES, SHIPPED_KNOBS, knob_defaults


@dataclass
class SlotView:
    """What a policy may look at for one layer: the first `fill` slots, oldest first."""

    fill: int
    num_heads: int
    seq: Tensor  # [heads, fill] int64: index of each token in the stream
    window_attention: Tensor  # [heads, fill] f32: attention received from the queries since the last eviction
    window_queries: int  # how many queries those are: the newest slots', each seeing every slot before it
    stream_end: int  # one past the stream index of the newest slot (the stream's clock)
    new: int = 0  # slots appended since the last eviction: the retrieval window's own tokens, newest last
    # [heads, fill] bool: the slot holds a camera frame's token (else text); None: none does
    frame: Tensor | None = None
    pinned: Tensor | None = None  # [heads, fill] bool: the caller asked to keep the slot's token; None: none is
    stats: dict[str, Tensor] = field(default_factory=dict)  # the policy's `slot_stats`, [heads, fill], in place


@dataclass
class EvictionPolicy(ABC):
    """Chooses the slots to keep. Subclasses are dataclasses whose fields are their settings (the knobs of their
    name in engine/policy_knobs.py, taken with `@takes_knobs`); they set `name`, implement `select` and join
    `POLICIES` with `@register`."""

    name: ClassVar[str]
    # Whether the cache must compute retrieval-window attention scores for this policy.
    needs_attention: ClassVar[bool] = False
    # Whether the cache is bounded at all (the full cache never evicts).
    evicts: ClassVar[bool] = True
    # Per-slot float32 figures this policy keeps across evictions (zero for a new token).
    slot_stats: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, _checked(f, getattr(self, f.name)))

    @classmethod
    def knobs(cls) -> dict[str, Field]:
        """The policy's settings by name."""
        return {f.name: f for f in fields(cls)}

    def set_knob(self, name: str, value) -> None:
        """Change a live setting; it applies from the next eviction. Raises ValueError for a setting this
        policy lacks, one that is fixed at start, or a value out of range (the policy is then unchanged)."""
        f = self.knobs().get(name)
        if f is None:
            raise ValueError(f"policy {self.name!r} has no setting {name!r}")
        if not f.metadata["live"]:
            raise ValueError(f"{name} of policy {self.name!r} is fixed when the stream starts")
        setattr(self, name, _checked(f, value))

    def check_capacity(self, capacity: int) -> None:
        """Raise ValueError if the settings cannot work with a cache of `capacity` tokens."""

    def protected(self, capacity: int) -> tuple[int, int]:
        """(first, last): how many of the oldest and of the newest slots a full cache of `capacity` keeps
        whatever their score (the sinks and the recent window)."""
        return 0, 0

    @abstractmethod
    def select(self, view: SlotView, keep: int) -> Tensor:
        """Indices [heads, keep] of the slots to keep, ascending in each row."""

    def describe(self) -> dict:
        return {"policy": self.name, **{name: getattr(self, name) for name in self.knobs()}}


def _checked(f: Field, value):
    """The value for knob `f`, or ValueError naming it (ints stay ints; an int is taken for a float)."""
    expected = type(f.default)
    problem = setting_problem(f.name, value, expected, f.metadata["low"], f.metadata["high"], f.metadata["step"])
    if problem:
        raise ValueError(problem)
    return as_declared(value, expected)


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make a policy selectable by its name (the node's eviction_policy, the benchmarks' policy lists). A shipped
    policy has exactly the knobs engine/policy_knobs.py declares for it."""
    shipped = SHIPPED_KNOBS.get(cls.name)
    if shipped is not None and set(cls.knobs()) != set(shipped):
        raise TypeError(f"policy {cls.name!r}: take its knobs from engine/policy_knobs.py with @takes_knobs")
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, *, capacity: int, **settings) -> EvictionPolicy:
    """Build a policy by name with the given settings (the others take their shipped defaults), checked
    against a cache of `capacity` tokens."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    cls = POLICIES[name]
    unknown = sorted(set(settings) - set(cls.knobs()))
    if unknown:
        raise ValueError(f"policy {name!r} has no setting {', '.join(unknown)}; its settings: {sorted(cls.knobs())}")
    policy = cls(**settings)
    policy.check_capacity(capacity)
    return policy


def policy_defaults(name: str) -> dict:
    """The shipped settings of a policy."""
    return knob_defaults(name)


def _keep_ends_and_best(view: SlotView, keep: int, head: int, tail: int, score: Tensor) -> Tensor:
    """Keep the first `head` slots, the last `tail` slots and the best-scored `keep - head - tail` between.

    `score` covers the slots between only: [heads, fill - head - tail].
    """
    device = view.seq.device
    first = torch.arange(head, device=device).expand(view.num_heads, head)
    last = torch.arange(view.fill - tail, view.fill, device=device).expand(view.num_heads, tail)
    best = keep - head - tail
    if best <= 0:
        return torch.cat([first, last], dim=-1).contiguous()
    top = torch.topk(score, best, dim=-1, sorted=False).indices + head
    return torch.cat([first, torch.sort(top, dim=-1).values, last], dim=-1)


def _recent(recent_size: int, capacity: int) -> int:
    return min(recent_size or capacity // 4, capacity)


def _check_recent(recent_size: int, capacity: int) -> None:
    if recent_size > capacity:
        raise ValueError(f"recent_size {recent_size} is larger than the cache capacity {capacity}")
