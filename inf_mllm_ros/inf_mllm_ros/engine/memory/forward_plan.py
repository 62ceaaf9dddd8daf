"""What one forward pass through the bounded cache does, decided before it runs and passed down.

The stream decides, for each forward of the model over its cache, where the new tokens sit (`PromptPositions`),
whether the cache evicts and re-packs after the last layer, whether the layers keep the attention the new
tokens pay (the retrieval window), whether their keys and values are copied for the archive, and whether the
layers' queries are captured (a question's, to score the archive with). That is one `ForwardPlan`, given to the
cache with `BoundedKVCache.stage` and by the cache to each layer as it takes the tokens; no layer reads any of
it from its owner, and nothing of it outlives the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class PromptPositions:
    """Positions of the tokens about to be appended (same for every layer and head)."""

    start: Tensor  # [q] int64: the position the key is rotated with
    end: Tensor  # [q] int64: one past the largest position component of the token
    first_seq: int  # index in the stream of the first of these tokens (the others follow it)
    frame: bool = False  # the tokens belong to a camera frame's prompt (else to text)
    pinned: bool | Tensor = False  # the caller asked to keep these tokens (or [q] bool, per token)

    @classmethod
    def contiguous(cls, first_position: int, first_seq: int, length: int, device=None) -> "PromptPositions":
        pos = torch.arange(first_position, first_position + length, dtype=torch.long, device=device)
        return cls(pos, pos + 1, first_seq)

    def __len__(self) -> int:
        return int(self.start.shape[0])

    @property
    def seq_end(self) -> int:
        """One past the stream index of the last of these tokens: the stream's clock once they are in."""
        return self.first_seq + len(self)

    @cached_property
    def seq(self) -> Tensor:
        """[q] int64: index of each token in the stream, made once per prompt on the positions' device."""
        return torch.arange(self.first_seq, self.seq_end, dtype=torch.long, device=self.start.device)

    @cached_property
    def last_end(self) -> int:
        """One past the largest position of these tokens: read once per prompt, not once per layer (on a
        GPU every read waits for the device)."""
        return int(self.end.max())


class LayerRecorder(Protocol):
    """Takes each layer's new keys and values of one forward ([1, heads, q, dim], as the cache received them):
    the archive's copy of the forward (engine/archive/archive.py, `ForwardRecording`)."""

    def take(self, layer: int, keys: Tensor, values: Tensor) -> None: ...


@dataclass
class ForwardPlan:
    """One forward over the cache: its tokens' positions and what happens around it.

    evict: the policy chooses the slots that stay after the last layer (where the policy evicts at all).
    pack: positions may be re-packed then (not between the blocks of one frame, whose layout must stay whole).
    observe: the layers add the attention the new tokens pay to the retrieval window.
    recorder: where the layers' new keys and values are copied to (None: not recorded).
    capture: filled with each layer's queries [heads, q, dim] by layer index (None: not captured).
    """

    positions: PromptPositions
    evict: bool = False
    pack: bool = True
    observe: bool = True
    recorder: LayerRecorder | None = None
    capture: dict[int, Tensor] | None = None

    def __len__(self) -> int:
        return len(self.positions)
