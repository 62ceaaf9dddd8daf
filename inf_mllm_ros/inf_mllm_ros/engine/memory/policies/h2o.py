"""H2O: a recent window plus the heavy hitters by accumulated attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .base import EvictionPolicy, SlotView, _check_recent, _keep_ends_and_best, _recent, register
from ...policy_knobs import takes_knobs


@register
@dataclass
@takes_knobs
class H2OPolicy(EvictionPolicy):
    """H2O: a recent window plus the heavy hitters by attention accumulated over every step."""

    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = True
    slot_stats: ClassVar[tuple[str, ...]] = ("accumulated",)

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
