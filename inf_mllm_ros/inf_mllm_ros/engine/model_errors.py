"""The errors of finding and loading a model (engine/models/loading.py, engine/models/embedded_models.py), and of
giving it what it cannot take."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model folder is missing or unusable; the message names the path and the problem."""


class ModelUnavailableError(ModelLoadError):
    """The model cannot be had on this machine (not prepared, not downloadable, or its device missing), as
    opposed to one that is there and fails to load."""


class FramesNotSupportedError(ValueError):
    """A camera frame was pushed to a model that has no vision tower."""
