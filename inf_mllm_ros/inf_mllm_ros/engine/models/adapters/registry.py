"""The adapter registry: family modules register themselves here, and `adapter_for` picks one from a
model folder's config. Importing only the base classes, it lets the package import the families
without them importing the package back."""

from __future__ import annotations

from .base import CausalLMAdapter, ModelAdapter

ADAPTERS: list[type[ModelAdapter]] = [CausalLMAdapter]


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: make a family adapter selectable by its config.model_type values."""
    ADAPTERS.insert(0, cls)
    return cls


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
    raise ValueError(f"model type {model_type!r} is not supported; "
                     f"supported: {', '.join(known)} and other *ForCausalLM")
