"""LLaVA (fixed-resolution CLIP tower) and LLaVA-OneVision (SigLIP tower, any-resolution tiles).

Both take 1-D positions. LLaVA always gives a frame the same number of tokens (its fixed resolution),
so the resolution bound only scales the input down; for OneVision a smaller frame needs fewer tiles.
"""

from __future__ import annotations

from .registry import register_adapter
from .base import VisionLanguageAdapter


@register_adapter
class LlavaAdapter(VisionLanguageAdapter):
    """LLaVA and LLaVA-OneVision: the image's features in place of its placeholder tokens, 1-D positions."""

    family = "llava"
    model_types = ("llava", "llava_onevision")
    image_placeholder = "<image>"

    def __init__(self, model, tokenizer, *, folder: str = "", processor=None):
        super().__init__(model, tokenizer, folder=folder, processor=processor)
        # Folders built on a language model that has its own image token (Qwen's <|image_pad|>) name it.
        self.image_placeholder = getattr(processor, "image_token", None) or self.image_placeholder
