"""Eviction policies: which cached tokens survive when the cache is over capacity.

A policy sees one layer's slots (in stream order) and returns, per KV head, the indices of the slots
to keep. The cache does the gathering, so a policy is a few lines of scoring. A policy that needs
per-slot figures across evictions names them in `slot_stats`; the cache allocates, moves and resets
them with the slots, and the policy updates them in `select`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class SlotView:
    """What a policy may look at for one layer: the first `fill` slots, oldest first."""

    fill: int
    num_heads: int
    seq: Tensor  # [heads, fill] int64: index of each token in the stream
    window_attention: Tensor  # [heads, fill] f32: attention received from the queries since the last eviction
    window_queries: Tensor  # [fill] f32: how many of those queries could see each slot
    new: int = 0  # slots appended since the last eviction: the retrieval window's own tokens, newest last
    stats: dict[str, Tensor] = field(default_factory=dict)  # the policy's `slot_stats`, [heads, fill], in place


class EvictionPolicy(ABC):
    """Chooses the slots to keep. Subclasses set `name` and implement `select`."""

    name: ClassVar[str]
    # Whether the cache must compute retrieval-window attention scores for this policy.
    needs_attention: ClassVar[bool] = False
    # Whether the cache is bounded at all (the full cache never evicts).
    evicts: ClassVar[bool] = True
    # Per-slot float32 figures this policy keeps across evictions (zero for a new token).
    slot_stats: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def select(self, view: SlotView, keep: int) -> Tensor:
        """Indices [heads, keep] of the slots to keep, ascending in each row."""

    def describe(self) -> dict:
        return {"policy": self.name}


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


class FullPolicy(EvictionPolicy):
    """No eviction: every token stays until the storage is exhausted."""

    name = "full"
    evicts = False

    def select(self, view: SlotView, keep: int) -> Tensor:
        raise RuntimeError("the full cache never evicts")


class WindowPolicy(EvictionPolicy):
    """Sliding window: keep the newest tokens only."""

    name = "window"

    def select(self, view: SlotView, keep: int) -> Tensor:
        start = view.fill - keep
        return torch.arange(start, view.fill, device=view.seq.device).expand(view.num_heads, keep).contiguous()


class StreamingLLMPolicy(EvictionPolicy):
    """StreamingLLM: the first `sink_size` tokens of the stream (attention sinks) plus a recent window."""

    name = "streaming_llm"

    def __init__(self, sink_size: int = 4):
        if sink_size < 0:
            raise ValueError(f"sink_size must be >= 0, got {sink_size}")
        self.sink_size = sink_size

    def select(self, view: SlotView, keep: int) -> Tensor:
        # Sinks are the oldest slots: the stream's first tokens are never evicted, so they stay in front.
        sinks = min(self.sink_size, keep)
        return _keep_ends_and_best(view, keep, sinks, keep - sinks, view.window_attention[:, :0])

    def describe(self) -> dict:
        return {"policy": self.name, "sink_size": self.sink_size}


class H2OPolicy(EvictionPolicy):
    """H2O: a recent window plus the heavy hitters by attention accumulated over every step."""

    name = "h2o"
    needs_attention = True
    slot_stats = ("accumulated",)

    def __init__(self, recent_size: int):
        if recent_size < 0:
            raise ValueError(f"recent_size must be >= 0, got {recent_size}")
        self.recent_size = recent_size

    def select(self, view: SlotView, keep: int) -> Tensor:
        # The window's attention is every step's since the last eviction: adding it here once equals
        # adding each step's as it happens.
        accumulated = view.stats["accumulated"].add_(view.window_attention)
        recent = min(self.recent_size, keep)
        return _keep_ends_and_best(view, keep, 0, recent, accumulated[:, : view.fill - recent])

    def describe(self) -> dict:
        return {"policy": self.name, "recent_size": self.recent_size}


class InfMLLMPolicy(EvictionPolicy):
    """Inf-MLLM: attention sinks, a recent window, and the attention saddles between, with a recency bias.

    Kept always: the first `sink_size` tokens of the stream, and the newest `recent_size` tokens, at
    least the block just pushed and the one before it. A block's own queries cannot judge it fairly (its
    last key would be judged by one query, its own), and the next block's queries sit right after it,
    where local attention favours its last tokens; so a block is first judged by the block after next.
    The tokens between are the candidates. At each eviction the candidates' attention from the retrieval
    window (the queries pushed since the last eviction) is averaged per query: every candidate is older
    than the window, so every window query sees it. With `score_decay` d > 0, a candidate's attention is a
    moving average over the windows that judged it, started from zero:

        A <- d * A + (1 - d) * a

    Saddles are the tokens that keep drawing attention over many prompts; a token judged once has shown
    that for one prompt and counts (1 - d) of its attention, a token that has drawn attention for many
    prompts counts what it has drawn lately. So a newcomer takes an incumbent's slot only with about
    1 / (1 - d) times its attention (10x at 0.9) or by the bias, and a fact that drew attention once is
    not washed out by the next paragraph. The score ranks candidates by log attention against log age, and
    a kept token keeps its neighbours (each candidate scores as the best within `score_pool` slots
    centred on it):

        score = log A - attention_bias * log(age)      (age: tokens pushed since the candidate's block)

    that is A / age^attention_bias: a token twice as old keeps its slot against a younger one only if it
    draws 2^attention_bias times more attention (10 times as old: 10^attention_bias). Both terms are
    ratios, so the bias means the same at any cache size, head count, pooling or stream length, and the
    cache keeps moving however long the stream runs: a saddle stays as long as its attention outgrows
    its age. A bias of 0 lets early winners hold the cache for good; a very large bias turns the
    candidates into a window. Age counts from the end of the block a token came in (`born`, stamped at
    the first eviction that sees it), so the tokens of one block are equally old: the bias prefers newer
    blocks, never the second half of a block.
    `score_decay=0, score_pool=1` is the plain method (the newest window's attention alone).
    """

    name = "inf_mllm"
    needs_attention = True
    slot_stats = ("score_memory", "born")

    def __init__(self, recent_size: int, attention_bias: float = 1.0, *, sink_size: int = 4,
                 score_decay: float = 0.0, score_pool: int = 1):
        if recent_size < 0:
            raise ValueError(f"recent_size must be >= 0, got {recent_size}")
        if sink_size < 0:
            raise ValueError(f"sink_size must be >= 0, got {sink_size}")
        if not 0.0 <= score_decay < 1.0:
            raise ValueError(f"score_decay must be in [0, 1), got {score_decay}")
        if score_pool < 1 or score_pool % 2 == 0:
            raise ValueError(f"score_pool must be an odd number >= 1 (a window centred on the token), got {score_pool}")
        self.recent_size = recent_size
        self.sink_size = sink_size
        self.attention_bias = attention_bias
        self.score_decay = score_decay
        self.score_pool = score_pool

    @property
    def attention_bias(self) -> float:
        return self._attention_bias

    @attention_bias.setter
    def attention_bias(self, value: float) -> None:
        value = float(value)
        if not 0.0 <= value <= 1e4:
            raise ValueError(f"attention_bias must be in [0, 10000], got {value}")
        self._attention_bias = value

    def regions(self, view: SlotView, keep: int) -> tuple[int, int]:
        """(sinks, recent): the slots kept at the front and at the back whatever their score."""
        sinks = min(self.sink_size, keep)
        # The block just pushed, and the one before it: the queries right after a block are the ones
        # whose local attention favours its last tokens, so a block is first judged by the block after next.
        recent = min(max(self.recent_size, 2 * view.new), keep - sinks)
        return sinks, recent

    def scores(self, view: SlotView, sinks: int, recent: int) -> Tensor:
        """Scores of the candidates (slots sinks .. fill - recent), updating their memory."""
        now = view.seq[:, view.fill - 1 : view.fill].to(torch.float32) + 1.0  # one past the newest token
        if view.new:
            view.stats["born"][:, view.fill - view.new :] = now
        cand = slice(sinks, view.fill - recent)
        attention = view.window_attention[:, cand] / view.window_queries[cand].clamp(min=1.0)
        seen = view.window_queries[cand] > 0
        if self.score_decay > 0.0:
            # Saddles keep drawing attention: a candidate's score is the evidence of many windows, a
            # moving average that starts from zero, so a token judged once counts for (1 - d) of its
            # attention and an incumbent for what it has drawn lately.
            memory = view.stats["score_memory"][:, cand]
            d = self.score_decay
            memory.copy_(torch.where(seen, d * memory + (1.0 - d) * attention, memory))
            attention = memory
        score = torch.log(attention.clamp(min=1e-30))
        n = score.shape[-1]
        if self.score_pool > 1 and n > 1:
            # A token that draws attention is usually part of a phrase: keep its neighbours with it.
            score = F.max_pool1d(score[:, None], self.score_pool, stride=1, padding=self.score_pool // 2)[:, 0]
        if self._attention_bias > 0.0 and n > 0:
            # Tokens pushed since the candidate's block ended: the queries that will judge the cache next.
            age = (now - view.stats["born"][:, cand]).clamp(min=1.0)
            score = score - self._attention_bias * torch.log(age)
        return score

    def select(self, view: SlotView, keep: int) -> Tensor:
        sinks, recent = self.regions(view, keep)
        return _keep_ends_and_best(view, keep, sinks, recent, self.scores(view, sinks, recent))

    def describe(self) -> dict:
        return {"policy": self.name, "recent_size": self.recent_size, "sink_size": self.sink_size,
                "attention_bias": self._attention_bias, "score_decay": self.score_decay,
                "score_pool": self.score_pool}


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (InfMLLMPolicy, StreamingLLMPolicy, H2OPolicy, WindowPolicy, FullPolicy)
}

# The settings that ship for inf_mllm (StreamConfig and the node take their defaults from here).
INF_MLLM_DEFAULTS = {"attention_bias": 1.0, "score_decay": 0.9, "score_pool": 13}


def make_policy(
    name: str,
    *,
    capacity: int,
    recent_size: int | None = None,
    sink_size: int = 4,
    attention_bias: float = INF_MLLM_DEFAULTS["attention_bias"],
    score_decay: float = INF_MLLM_DEFAULTS["score_decay"],
    score_pool: int = INF_MLLM_DEFAULTS["score_pool"],
) -> EvictionPolicy:
    """Build a policy by name, with the shipped settings unless given. `recent_size` defaults to a quarter
    of the capacity."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    recent = capacity // 4 if recent_size is None else recent_size
    if recent > capacity:
        raise ValueError(f"recent_size {recent} is larger than the cache capacity {capacity}")
    if name == "inf_mllm":
        return InfMLLMPolicy(recent, attention_bias, sink_size=sink_size, score_decay=score_decay,
                             score_pool=score_pool)
    if name == "h2o":
        return H2OPolicy(recent)
    if name == "streaming_llm":
        return StreamingLLMPolicy(sink_size)
    return POLICIES[name]()


__all__ = ["EvictionPolicy", "INF_MLLM_DEFAULTS", "POLICIES", "SlotView", "make_policy"]
