"""Eviction policies: which cached tokens survive when the cache is over capacity.

A policy sees one layer's slots (in stream order) and returns, per KV head, the indices of the slots
to keep. The cache does the gathering, so a policy is a few lines of scoring. A policy that needs
per-slot figures across evictions names them in `slot_stats`; the cache allocates, moves and resets
them with the slots, and the policy updates them in `select`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import Field, dataclass, field, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .scoring import visible_counts
from .value_rules import as_declared, setting_problem


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
class EvictionPolicy(ABC):
    """Chooses the slots to keep. Subclasses are dataclasses whose fields are their settings (made with
    `knob`); they set `name`, implement `select` and join `POLICIES` with `@register`."""

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


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make a policy selectable by its name (the node's eviction_policy, the benchmarks' policy lists)."""
    POLICIES[cls.name] = cls
    return cls


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


@register
@dataclass
class FullPolicy(EvictionPolicy):
    """No eviction: every token stays until the storage is exhausted."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def select(self, view: SlotView, keep: int) -> Tensor:
        raise RuntimeError("the full cache never evicts")


@register
@dataclass
class WindowPolicy(EvictionPolicy):
    """Sliding window: keep the newest tokens only."""

    name: ClassVar[str] = "window"

    def select(self, view: SlotView, keep: int) -> Tensor:
        start = view.fill - keep
        return torch.arange(start, view.fill, device=view.seq.device).expand(view.num_heads, keep).contiguous()


@register
@dataclass
class StreamingLLMPolicy(EvictionPolicy):
    """StreamingLLM: the first `sink_size` tokens of the stream (attention sinks) plus a recent window."""

    name: ClassVar[str] = "streaming_llm"
    sink_size: int = _sink_size()

    def protected(self, capacity: int) -> tuple[int, int]:
        sinks = min(self.sink_size, capacity)
        return sinks, capacity - sinks

    def select(self, view: SlotView, keep: int) -> Tensor:
        # Sinks are the oldest slots: the stream's first tokens are never evicted, so they stay in front.
        sinks = min(self.sink_size, keep)
        return _keep_ends_and_best(view, keep, sinks, keep - sinks, view.window_attention[:, :0])


def _recent(recent_size: int, capacity: int) -> int:
    return min(recent_size or capacity // 4, capacity)


def _check_recent(recent_size: int, capacity: int) -> None:
    if recent_size > capacity:
        raise ValueError(f"recent_size {recent_size} is larger than the cache capacity {capacity}")


@register
@dataclass
class H2OPolicy(EvictionPolicy):
    """H2O: a recent window plus the heavy hitters by attention accumulated over every step."""

    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = True
    slot_stats: ClassVar[tuple[str, ...]] = ("accumulated",)
    recent_size: int = _recent_size()

    def check_capacity(self, capacity: int) -> None:
        _check_recent(self.recent_size, capacity)

    def protected(self, capacity: int) -> tuple[int, int]:
        return 0, _recent(self.recent_size, capacity)

    def select(self, view: SlotView, keep: int) -> Tensor:
        # The window's attention is every step's since the last eviction: adding it here once equals
        # adding each step's as it happens.
        accumulated = view.stats["accumulated"].add_(view.window_attention)
        recent = self.protected(keep)[1]
        return _keep_ends_and_best(view, keep, 0, recent, accumulated[:, : view.fill - recent])


@register
@dataclass
class InfMLLMPolicy(EvictionPolicy):
    """Inf-MLLM: attention sinks, a recent window, and the attention saddles between, with a recency bias.

    Kept always: the first `sink_size` tokens of the stream, and the newest `recent_size` tokens, at
    least twice the block just pushed (so the block before it too, unless that one was longer). A block's
    own queries cannot judge it fairly (its last key would be judged by one query, its own), and the next
    block's queries sit right after it, where local attention favours its last tokens; so a block is first
    judged by the block after next.
    The tokens between are the candidates. At each eviction the candidates' attention from the retrieval
    window (the queries pushed since the last eviction) is averaged per query: every candidate is older
    than the window, so every window query sees it. With `score_memory`, a candidate's attention A is the
    decayed sum of what the windows since it arrived paid it:

        A <- memory_decay * A + a

    Saddles are the tokens that keep drawing attention: attention that comes prompt after prompt adds up
    (a token drawing the same attention at every eviction counts 1 / (1 - memory_decay) times a
    newcomer's: ten times at 0.9), and fades by that factor per eviction (one per block of up to
    chunk_size tokens) once it stops. (Keeping each token's
    peak as well, max(A, P), held a fact hit once for longer, but in a 300-round dialogue the 0.5B model
    then answered "OK" to every question after round 50: 2/42 right against 12/42.) The score ranks
    candidates by log attention against log age, and a kept token keeps its neighbours (each candidate
    scores as the best within `score_pool` slots centred on it):

        score = log A - attention_bias * log(age)      (age: tokens pushed since the candidate's block)

    that is A / age^attention_bias: a token twice as old keeps its slot against a younger one only if it
    has drawn 2^attention_bias times more attention (10 times as old: 10^attention_bias). Both terms are
    ratios, so the bias means the same at any cache size, head count, pooling or stream length, and the
    cache keeps moving however long the stream runs: a saddle stays until its age outgrows its attention.
    A bias of 0 lets early winners hold the cache for good; a very large bias turns the candidates into a
    window. Age counts from the end of the block a token came in (`born`, stamped at the first eviction
    that sees it), so the tokens of one block are equally old: the bias prefers newer blocks, never the
    second half of a block.
    A camera frame brings a hundred tokens or more that draw attention from one another; the text a
    robot is told is sparse. So `text_share` of the candidate slots go to the text tokens that have drawn
    the most attention, their age aside, whenever there is that much text, and the rest to the best of
    everything. The bias is what keeps frames from holding the cache; inside the text's share it would
    only put each newer mention of a subject ahead of the older fact it refers to.
    Attention keeps only what something has referred to: a fact a robot is told and not asked about for
    an hour draws none. So a caller may pin a message (`KVStream.push_text(..., pin=True)`): its tokens
    rank above every other candidate, the newest pins first, in up to `pin_share` of the slots beside the
    sinks (those the recent window holds count in it); pins beyond that compete on score like any token.
    `score_memory=False, score_pool=1, text_share=0` with nothing pinned is the plain method (the newest
    window's attention alone, one ranking for all).
    """

    name: ClassVar[str] = "inf_mllm"
    needs_attention: ClassVar[bool] = True
    slot_stats: ClassVar[tuple[str, ...]] = ("attention_sum", "born")
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

    def check_capacity(self, capacity: int) -> None:
        _check_recent(self.recent_size, capacity)

    def protected(self, capacity: int) -> tuple[int, int]:
        sinks = min(self.sink_size, capacity)
        return sinks, min(_recent(self.recent_size, capacity), capacity - sinks)

    def regions(self, view: SlotView, keep: int) -> tuple[int, int]:
        """(sinks, recent) at this eviction: the protected slots, and at least twice the block just pushed in
        the recent window (the block before it too, unless that one was longer): the queries right after a
        block are the ones whose local attention favours its last tokens, so a block is first judged by the
        block after next. (The size of the block before is not known here, only the one just pushed.)"""
        sinks, recent = self.protected(keep)
        return sinks, min(max(recent, 2 * view.new), keep - sinks)

    def drawn(self, view: SlotView, sinks: int, recent: int) -> Tensor:
        """Log of the attention the candidates (slots sinks .. fill - recent) have drawn, pooled; updates
        their memory and stamps the window's own tokens with their block's end."""
        if view.new:
            view.stats["born"][:, view.fill - view.new :] = float(view.stream_end)
        end = view.fill - recent
        cand = slice(sinks, end)
        attention = view.window_attention[:, cand]
        if end <= view.fill - view.new:
            # Every candidate is older than the window: each window query saw it.
            attention = attention / max(view.window_queries, 1)
        else:
            # Candidates among the window's own tokens (at the first eviction, or when pins take the recent
            # window's room) are seen by the window's queries from their own on.
            attention = attention / visible_counts(view.fill - view.new, view.new, attention.device)[cand]
        if self.score_memory:
            # Attention that keeps coming adds up; once it stops it fades by memory_decay per eviction.
            total = view.stats["attention_sum"][:, cand]
            if view.window_queries:  # a window that judged nothing (after a restore) ages nothing
                total.mul_(self.memory_decay).add_(attention)
            attention = total
        drawn = torch.log(attention.clamp(min=1e-30))
        if self.score_pool > 1 and drawn.shape[-1] > 1:
            # A token that draws attention is usually part of a phrase: keep its neighbours with it.
            drawn = F.max_pool1d(drawn[:, None], self.score_pool, stride=1, padding=self.score_pool // 2)[:, 0]
        return drawn

    def aged(self, view: SlotView, drawn: Tensor, sinks: int) -> Tensor:
        """The candidates' scores from what they have drawn (`drawn`, from slot `sinks` on): less the bias
        times the log of their age."""
        if self.attention_bias == 0.0 or drawn.shape[-1] == 0:
            return drawn
        # Tokens pushed since the candidate's block ended: the queries that will judge the cache next.
        born = view.stats["born"][:, sinks : sinks + drawn.shape[-1]]
        age = (float(view.stream_end) - born).clamp_(min=1.0)
        return drawn - self.attention_bias * torch.log_(age)

    def select(self, view: SlotView, keep: int) -> Tensor:
        sinks, recent = self.regions(view, keep)
        pinned = view.pinned if self.pin_share > 0.0 and view.pinned is not None else None
        if pinned is not None and bool(pinned[:, sinks:].any()):
            # The pins' budget is a share of every slot but the sinks, and they outrank the oldest of the
            # recent window when it would leave them no room (at the first eviction the whole stream is new).
            pin_room = int(self.pin_share * (keep - sinks))
            recent = min(recent, keep - sinks - min(int(pinned[:, sinks:].sum(-1).max()), pin_room))
        else:
            pinned = None
        drawn = self.drawn(view, sinks, recent)
        score = self.aged(view, drawn, sinks)
        cand = slice(sinks, view.fill - recent)
        best = keep - sinks - recent
        frame = None if view.frame is None else view.frame[:, cand]
        if self.text_share > 0.0 and frame is not None:
            # Frame tokens come by the hundred per frame and draw attention from one another; text is sparse
            # and is what a robot is told. Ranked on score alone, a camera flood pushes every text token out;
            # with a share, the text competes for its slots with other text, by the attention it has drawn
            # (a fact told long ago is no less true: with the age term each newer mention of its subject would
            # outrank it), and the rest go to whichever scores best. (Where none is text the lift lifts
            # nothing; not asking which spares the host a wait for a GPU.)
            score = _lift_first(score, ~frame, by=drawn, room=int(self.text_share * max(best, 0)))
        if pinned is not None:
            # The newest pins first: those in the recent window are kept already and use up their share.
            room = pin_room - pinned[:, view.fill - recent : view.fill].sum(-1, keepdim=True)
            score = _lift_first(score, pinned[:, cand], by=view.seq[:, cand].to(score.dtype), room=room)
        return _keep_ends_and_best(view, keep, sinks, recent, score)


def _lift_first(score: Tensor, members: Tensor, *, by: Tensor, room: int | Tensor) -> Tensor:
    """Lift the `room` members (per head: an int, or [heads, 1]) with the highest `by` in each head above
    every candidate not lifted (or all the members there are); their order among themselves, and everyone
    else's, stays by score."""
    if score.shape[-1] == 0:
        return score
    ranked = torch.where(members, by, torch.full_like(by, -torch.inf)).argsort(dim=-1, descending=True)
    rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(score.shape[-1], device=score.device)
                                             .expand_as(ranked))
    lifted = members & (rank < room)
    return torch.where(lifted, score + (score.abs().max() + 1.0) * 4.0, score)


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
    return {n: f.default for n, f in POLICIES[name].knobs().items()}


__all__ = ["EvictionPolicy", "POLICIES", "SlotView", "knob", "make_policy", "policy_defaults", "register"]
