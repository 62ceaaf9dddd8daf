"""The sliding window: the newest tokens only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .base import EvictionPolicy, SlotView, register
from ...policy_knobs import takes_knobs


@register
@dataclass
@takes_knobs
class WindowPolicy(EvictionPolicy):
    """Sliding window: keep the newest tokens only."""

    name: ClassVar[str] = "window"

    def select(self, view: SlotView, keep: int) -> Tensor:
        start = view.fill - keep
        return torch.arange(start, view.fill, device=view.seq.device).expand(view.num_heads, keep).contiguous()
