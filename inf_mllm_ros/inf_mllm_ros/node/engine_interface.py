"""What the node uses of its engine, declared once: `EngineLike`.

The node talks to `StreamingEngine` (engine/runtime/engine.py) through this interface only, and its tests pass a
stand-in that provides the same members (test_node.py checks that both do). No ROS import, and no import
of the model at run time: the engine's types appear in annotations only.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing this module loads nothing of the model
    import numpy as np

    from ..engine.models.adapters import ModelAdapter
    from ..engine.runtime.worker import EngineCounters
    from ..engine.persistence.memory_file import MemoryFileInfo
    from ..engine.poses import Pose
    from ..engine.runtime.live_settings import LiveSettings
    from ..engine.runtime.stream import StreamStats


@runtime_checkable
class EngineLike(Protocol):
    """An engine as the node drives it: inputs and questions submitted for futures, control jobs (reset,
    save), the figures it reports, the settings the node changes while it runs, and its lifecycle (ready,
    closed). Exactly the members the node reads, sets or calls; nothing else of the engine is relied on.
    """

    # The clock the node keeps with the memory.
    time_origin: float | None  # the caller's time of stream time 0, kept with the memory
    pose_frame: str  # the frame of the poses kept with inputs, kept with the memory
    preparation: dict  # what loading prepared for the first question, with its seconds

    # Lifecycle.
    ready: threading.Event  # set once the model is usable
    load_error: Exception | None  # why the model did not load
    memory_file: str | None  # where the memory is saved; None: no file
    memory_status: str  # what happened to the memory file at load (restored, refused, missing)
    last_saved: MemoryFileInfo | None  # the last save that went through
    save_error: str | None  # why the last save failed; None once one succeeds

    # Figures.
    counters: EngineCounters

    @property
    def pending(self) -> dict:
        """Inputs waiting for the model: {"texts": int, "queries": int, "frame": bool}."""
        ...

    @property
    def adapter(self) -> ModelAdapter | None:
        """The loaded model (its `notice` is shown to users); None until loaded."""
        ...

    @property
    def closed(self) -> bool:
        """Closed: it takes no more work."""
        ...

    @property
    def settings(self) -> LiveSettings:
        """The live settings as last changed (policy knobs, answer length, system prompt, periods)."""
        ...

    def stats(self) -> StreamStats | None: ...

    # Work, answered through futures.
    def submit_text(self, text: str, stamp: float | None = None, *, pin: bool = False,
                    pose: Pose | None = None) -> Future: ...

    def submit_frame(self, rgb: np.ndarray, stamp: float | None = None, *, pose: Pose | None = None,
                     camera: str = "") -> Future: ...

    def submit_ask(self, question: str, *, max_new_tokens: int | None = None, keep_in_memory: bool = False,
                   on_token=None, cancel: threading.Event | None = None, asked_at: float | None = None) -> Future: ...

    def submit_describe(self, prompt: str | None = None, *, max_new_tokens: int | None = None) -> Future: ...

    def submit_recall(self, text: str, *, limit: int = 5, since: float | None = None, until: float | None = None,
                      near: tuple[float, float, float] | None = None, camera: str = "") -> Future: ...

    def submit_reset(self) -> Future: ...

    def submit_save(self) -> Future: ...

    def abandon(self, future: Future) -> bool: ...

    # Lifecycle and live settings.
    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def update_settings(self, **changes) -> LiveSettings:
        """Change live settings in one step, checked whole (ValueError: nothing changed)."""
        ...

    def close(self, timeout: float | None = 10.0) -> bool | None: ...


__all__ = ["EngineLike"]
