"""The full cache: no eviction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .base import EvictionPolicy, SlotView, register
from ...policy_knobs import takes_knobs


@register
@dataclass
@takes_knobs
class FullPolicy(EvictionPolicy):
    """No eviction: every token stays until the storage is exhausted."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def select(self, view: SlotView, keep: int) -> Tensor:
        raise RuntimeError("the full cache never evicts")
