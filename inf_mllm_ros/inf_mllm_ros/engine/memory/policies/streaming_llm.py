"""StreamingLLM: attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .base import EvictionPolicy, SlotView, _keep_ends_and_best, register
from ...policy_knobs import takes_knobs


@register
@dataclass
@takes_knobs
class StreamingLLMPolicy(EvictionPolicy):
    """StreamingLLM: the first `sink_size` tokens of the stream (attention sinks) plus a recent window."""

    name: ClassVar[str] = "streaming_llm"

    def protected(self, capacity: int) -> tuple[int, int]:
        sinks = min(self.sink_size, capacity)
        return sinks, capacity - sinks

    def select(self, view: SlotView, keep: int) -> Tensor:
        # Sinks are the oldest slots: the stream's first tokens are never evicted, so they stay in front.
        sinks = min(self.sink_size, keep)
        return _keep_ends_and_best(view, keep, sinks, keep - sinks, view.window_attention[:, :0])
