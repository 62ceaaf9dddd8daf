"""The errors of finding and loading a model (engine/loading.py, engine/embedded_models.py)."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model folder is missing or unusable; the message names the path and the problem."""


class ModelUnavailableError(ModelLoadError):
    """The model cannot be had on this machine (not prepared, not downloadable, or its device missing), as
    opposed to one that is there and fails to load."""
