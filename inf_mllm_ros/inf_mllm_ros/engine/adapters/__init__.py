"""One adapter per model family, chosen from the model folder's config."""

from __future__ import annotations

from .base import CausalLMAdapter, FramesNotSupportedError, ModelAdapter, Prompt, VisionLanguageAdapter

ADAPTERS: list[type[ModelAdapter]] = [CausalLMAdapter]


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: make a family adapter selectable by its config.model_type values."""
    ADAPTERS.insert(0, cls)
    return cls


# The vision-language families register themselves on import.
from . import idefics3, llava, qwen2_vl  # noqa: E402,F401


def adapter_for(config) -> type[ModelAdapter]:
    model_type = getattr(config, "model_type", "")
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls
    # Any other decoder-only model with a causal LM head is served as text only.
    architectures = getattr(config, "architectures", None) or []
    if any(name.endswith("ForCausalLM") for name in architectures):
        return CausalLMAdapter
    known = sorted({t for cls in ADAPTERS for t in cls.model_types})
    raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(known)} and other *ForCausalLM")


__all__ = [
    "ADAPTERS", "CausalLMAdapter", "FramesNotSupportedError", "ModelAdapter", "Prompt", "VisionLanguageAdapter",
    "adapter_for", "register_adapter",
]
