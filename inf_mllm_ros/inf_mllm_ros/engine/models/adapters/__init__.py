"""One adapter per model family, chosen from the model folder's config."""

from __future__ import annotations

# The vision-language families register themselves on import.
from . import idefics3, llava, qwen2_vl  # noqa: F401
from .base import CausalLMAdapter, FramesNotSupportedError, ModelAdapter, Prompt, VisionLanguageAdapter
from .registry import ADAPTERS, adapter_for, register_adapter

__all__ = [
    "ADAPTERS", "CausalLMAdapter", "FramesNotSupportedError", "ModelAdapter", "Prompt", "VisionLanguageAdapter",
    "adapter_for", "register_adapter",
]
