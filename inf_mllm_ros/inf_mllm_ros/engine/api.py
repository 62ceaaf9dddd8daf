"""The engine's door, without torch: what the node, the parameter table (settings.py), the launch file and the bag
tools need to speak to the engine.

Its configuration (`StreamConfig` and the defaults of the engine's own settings), the policies' settings by name,
its errors, what an answer and its evidence are, and the rules an input is checked by. Importing this module
loads neither torch nor transformers (test_layout.py checks it), so that a process that only reads the parameter
table (the launch file's) or speaks to the engine through ROS stays small. The engine itself (`StreamingEngine`,
engine/runtime/engine.py) is imported by whoever makes one.
"""

from __future__ import annotations

from .answering import DEFAULT_DESCRIPTION_PROMPT, QUOTE_CHARS, Answer, AnswerCancelledError, Evidence
from .models.chat import CLOCKS
from .model_errors import FramesNotSupportedError, ModelLoadError, ModelUnavailableError
from .policy_knobs import policy_knobs
from .poses import Pose, PoseRefusedError
from .stream_config import DEFAULT_SYSTEM_PROMPT, MIN_CAPACITY, STEP_MODES, StreamConfig
from .text_rules import CheckedText, TextRefused, checked_text
from .value_rules import MAX_RECALL_RESULTS, MIN_PERIOD, ValueRule, camera_problem, recall_problem

# The embedded model a stream runs when no model is named (engine/models/embedded_models.py).
DEFAULT_MODEL = "onevision-qwen2.5-0.5b"
# Bounds of the waiting queues (the node's max_pending_texts and max_pending_queries default to these).
DEFAULT_MAX_PENDING_TEXTS = 64
DEFAULT_MAX_PENDING_QUERIES = 8


class EngineNotReadyError(RuntimeError):
    """The model is still loading, failed to load, or the engine was closed."""


class EngineBusyError(RuntimeError):
    """A bounded queue is full; the input was refused, nothing else changed."""


class FrameDroppedError(RuntimeError):
    """A newer frame replaced this one before the model could take it."""


__all__ = [
    "CLOCKS", "DEFAULT_DESCRIPTION_PROMPT", "DEFAULT_MAX_PENDING_QUERIES", "DEFAULT_MAX_PENDING_TEXTS", "DEFAULT_MODEL",
    "DEFAULT_SYSTEM_PROMPT", "MAX_RECALL_RESULTS", "MIN_CAPACITY", "MIN_PERIOD", "QUOTE_CHARS", "STEP_MODES", "Answer",
    "AnswerCancelledError", "CheckedText", "EngineBusyError", "EngineNotReadyError", "Evidence", "FrameDroppedError",
    "FramesNotSupportedError", "ModelLoadError", "ModelUnavailableError", "Pose", "PoseRefusedError", "StreamConfig",
    "TextRefused", "ValueRule", "camera_problem", "checked_text", "policy_knobs", "recall_problem",
]
