"""Eviction policies: which cached tokens survive when the cache is over capacity.

A policy sees one layer's slots (in stream order) and returns, per KV head, the indices of the slots
to keep. The cache does the gathering, so a policy is a few lines of scoring.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


@dataclass
class SlotView:
    """What a policy may look at for one layer: the first `fill` slots, oldest first."""

    fill: int
    num_heads: int
    seq: Tensor  # [heads, fill] int64: index of each token in the stream
    window_attention: Tensor  # [heads, fill] f32: attention received from the queries since the last eviction
    window_queries: Tensor  # [fill] f32: how many of those queries could see each slot
    accumulated_attention: Tensor  # [heads, fill] f32: attention received since the token arrived
    history: Tensor  # [heads, fill] f32: a per-slot score a policy may keep across evictions (in place)


class EvictionPolicy(ABC):
    """Chooses the slots to keep. Subclasses set `name` and implement `select`."""

    name: ClassVar[str]
    # Whether the cache must compute retrieval-window attention scores for this policy.
    needs_attention: ClassVar[bool] = False
    # Whether the cache is bounded at all (the full cache never evicts).
    evicts: ClassVar[bool] = True

    @abstractmethod
    def select(self, view: SlotView, keep: int) -> Tensor:
        """Indices [heads, keep] of the slots to keep, ascending in each row."""

    def describe(self) -> dict:
        return {"policy": self.name}


def _recent_and_best(view: SlotView, keep: int, recent: int, score: Tensor) -> Tensor:
    """Keep the newest `recent` slots plus the best-scored of the rest."""
    recent = min(recent, keep)
    old = view.fill - recent
    best = keep - recent
    device = score.device
    tail = torch.arange(old, view.fill, device=device).expand(view.num_heads, recent)
    if best <= 0:
        return tail.contiguous()
    top = torch.topk(score[:, :old], best, dim=-1, sorted=False).indices
    return torch.cat([torch.sort(top, dim=-1).values, tail], dim=-1)


def _group_max(score: Tensor, group: Tensor) -> Tensor:
    """Each slot's score replaced by the maximum over the slots of its group ([heads, n], sorted groups)."""
    new_group = torch.ones_like(group, dtype=torch.bool)
    new_group[:, 1:] = group[:, 1:] != group[:, :-1]
    run = new_group.long().cumsum(-1) - 1
    best = torch.full_like(score, float("-inf")).scatter_reduce(1, run, score, reduce="amax", include_self=True)
    return best.gather(1, run)


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
        sinks = min(self.sink_size, keep)
        # Sinks are the oldest slots: the stream's first tokens are never evicted, so they stay in front.
        head = torch.arange(sinks, device=view.seq.device)
        tail = torch.arange(view.fill - (keep - sinks), view.fill, device=view.seq.device)
        return torch.cat([head, tail]).expand(view.num_heads, keep).contiguous()

    def describe(self) -> dict:
        return {"policy": self.name, "sink_size": self.sink_size}


class H2OPolicy(EvictionPolicy):
    """H2O: a recent window plus the heavy hitters by attention accumulated over every step."""

    name = "h2o"
    needs_attention = True

    def __init__(self, recent_size: int):
        if recent_size < 0:
            raise ValueError(f"recent_size must be >= 0, got {recent_size}")
        self.recent_size = recent_size

    def select(self, view: SlotView, keep: int) -> Tensor:
        return _recent_and_best(view, keep, self.recent_size, view.accumulated_attention)

    def describe(self) -> dict:
        return {"policy": self.name, "recent_size": self.recent_size}


class InfMLLMPolicy(EvictionPolicy):
    """Inf-MLLM: a recent window plus the attention saddles of the newest prompt, with a recency bias.

    Each slot's score is the attention it received from the retrieval window (the queries of the prompt
    just pushed), averaged over the window queries that can see it, plus

        attention_bias * rank / (fill - 1)

    where rank is the slot's place in stream order (0 = oldest). The bias is on the scale of an attention
    probability, so 1e-3 means "a newer token beats an older one unless the older one draws 0.1 % more
    of each query's attention". Without it, tokens that won early keep winning and new input never
    enters the cache; with it, the cache keeps moving forward while real saddles, whose attention is far
    above the bias, stay.
    """

    name = "inf_mllm"
    needs_attention = True

    def __init__(self, recent_size: int, attention_bias: float = 1e-3, *, decay: float = 0.0, pool_size: int = 1):
        if recent_size < 0:
            raise ValueError(f"recent_size must be >= 0, got {recent_size}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.recent_size = recent_size
        self.attention_bias = float(attention_bias)
        self.decay = decay
        self.pool_size = pool_size

    @property
    def attention_bias(self) -> float:
        return self._attention_bias

    @attention_bias.setter
    def attention_bias(self, value: float) -> None:
        if not value >= 0.0:
            raise ValueError(f"attention_bias must be >= 0, got {value}")
        self._attention_bias = float(value)

    def scores(self, view: SlotView) -> Tensor:
        mean = view.window_attention / view.window_queries.clamp(min=1.0)
        if self.decay > 0.0:
            # Saddles keep drawing attention over many prompts: remember recent prompts' attention too.
            view.history.mul_(self.decay).add_(mean, alpha=1.0 - self.decay)
            mean = view.history.clone()
        if self.pool_size > 1:
            # A token that draws attention is usually part of a phrase: the stream is cut into groups of
            # pool_size tokens and each token scores as the best of its group, so phrases stay whole.
            mean = _group_max(mean, view.seq // self.pool_size)
        if self._attention_bias == 0.0 or view.fill < 2:
            return mean
        rank = torch.arange(view.fill, device=mean.device, dtype=mean.dtype) / (view.fill - 1)
        return mean + self._attention_bias * rank

    def select(self, view: SlotView, keep: int) -> Tensor:
        return _recent_and_best(view, keep, self.recent_size, self.scores(view))

    def describe(self) -> dict:
        return {"policy": self.name, "recent_size": self.recent_size, "attention_bias": self._attention_bias}


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (InfMLLMPolicy, StreamingLLMPolicy, H2OPolicy, WindowPolicy, FullPolicy)
}


def make_policy(
    name: str,
    *,
    capacity: int,
    recent_size: int | None = None,
    sink_size: int = 4,
    attention_bias: float = 1e-3,
    score_decay: float = 0.0,
    score_pool: int = 1,
) -> EvictionPolicy:
    """Build a policy by name. `recent_size` defaults to a quarter of the capacity."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    recent = capacity // 4 if recent_size is None else recent_size
    if recent > capacity:
        raise ValueError(f"recent_size {recent} is larger than the cache capacity {capacity}")
    if name == "inf_mllm":
        return InfMLLMPolicy(recent, attention_bias, decay=score_decay, pool_size=score_pool)
    if name == "h2o":
        return H2OPolicy(recent)
    if name == "streaming_llm":
        return StreamingLLMPolicy(sink_size)
    return POLICIES[name]()
