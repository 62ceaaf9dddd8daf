"""SmolVLM and Idefics3: a SigLIP-style tower, pixel shuffle, and a frame split into tiles plus a
global view, each tile a fixed number of tokens. The resolution bound limits the number of tiles."""

from __future__ import annotations

import math

from .registry import register_adapter
from .base import VisionLanguageAdapter


@register_adapter
class Idefics3Adapter(VisionLanguageAdapter):
    """Idefics3 and SmolVLM: image tiles as the processor cuts them, 1-D positions."""

    family = "idefics3"
    model_types = ("idefics3", "smolvlm")
    image_placeholder = "<image>"

    def processor_kwargs(self, height: int, width: int, max_pixels: int | None) -> dict:
        if max_pixels is None:
            return {}
        image_processor = self.processor.image_processor
        tile = image_processor.max_image_size["longest_edge"]
        longest = image_processor.size["longest_edge"]
        # The processor scales the longest edge to size["longest_edge"] (up or down) and then cuts tiles:
        # choose the largest multiple of the tile that keeps the frame's area within max_pixels.
        edge = math.sqrt(max_pixels * max(height, width) / min(height, width))
        bounded = max(tile, min(longest, int(edge // tile) * tile))
        return {"images_kwargs": {"size": {"longest_edge": bounded}}}
