"""Qwen2-VL and Qwen2.5-VL: 3-D M-RoPE positions (time, height, width) for image tokens.

A frame's positions come from the model's own `get_rope_index` over the frame turn alone, counted from
0; the engine adds the running position. Text tokens get three equal components, so a uniform shift of
all three (what the cache does when it re-packs positions) is an ordinary 1-D rotation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import register_adapter
from .base import VisionLanguageAdapter


@register_adapter
class Qwen2VLAdapter(VisionLanguageAdapter):
    """Qwen2-VL and Qwen2.5-VL: M-RoPE positions from the model's own rope index, per frame."""

    family = "qwen2_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def text_position_ids(self, positions: Tensor) -> Tensor:
        return positions.unsqueeze(0).expand(3, -1)

    def processor_kwargs(self, height: int, width: int, max_pixels: int | None) -> dict:
        if max_pixels is None:
            return {}
        # Qwen's image processor keeps its pixel-count bounds under these names: max and min pixels.
        size = dict(self.processor.image_processor.size)
        longest = min(size["longest_edge"], max_pixels)
        bound = {"longest_edge": longest, "shortest_edge": min(size["shortest_edge"], longest)}
        return {"images_kwargs": {"size": bound}}

    def frame_positions(self, ids: Tensor, inputs) -> tuple[Tensor, Tensor]:
        token_types = inputs.get("mm_token_type_ids")
        if token_types is None:
            token_types = (ids == self.image_token_id).int()
        position_ids, _ = self.model.model.get_rope_index(
            ids[None],
            mm_token_type_ids=torch.as_tensor(token_types, device=ids.device).reshape(1, -1),
            image_grid_thw=inputs["image_grid_thw"].to(ids.device),
        )
        position_ids = position_ids[:, 0]  # [3, q]
        return position_ids, position_ids.max(0).values + 1
