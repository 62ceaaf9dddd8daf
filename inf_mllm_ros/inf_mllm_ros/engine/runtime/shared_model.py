"""One loaded model for several memories: `SharedModel`, the weights loaded once and the model's turns.

A process that serves several robots (or cameras), a memory each, builds each memory's `StreamingEngine` through one
`SharedModel`: the first engine's worker loads the model, the others wait for that load and use the same adapter;
every engine takes its jobs in the model's turns (model_turns.py), in the order asked for, so that one memory's flood
of input never holds the model for more than a job while another's question waits; inputs and questions of several
memories that wait at once go through the model together, their blocks batched and their answers decoded as one batch
(model_bench.py). Each engine keeps its own cache, archive, clock, queues, live settings and memory file.
"""

from __future__ import annotations

import threading

from ..models.adapters import ModelAdapter
from ..models.loading import load_model
from .engine import StreamingEngine
from .model_bench import ModelBench
from .model_turns import ModelTurns


class SharedModel:
    """Engines over one model. `engine(...)` takes `StreamingEngine`'s arguments; the model, device, dtype and
    trust_remote_code of the first engine built are every engine's (ValueError for another)."""

    def __init__(self) -> None:
        self.turns = ModelTurns()
        self.bench = ModelBench(self.turns)  # the engines' work done together where it waits at once
        self._lock = threading.Lock()  # the model the first engine asked for
        self._load_lock = threading.Lock()  # held while the model loads
        self._adapter: ModelAdapter | None = None
        self._source: tuple | None = None  # (model, device, dtype, trust_remote_code) of the first engine
        self.loads = 0  # times the model was loaded (1 once loaded, whatever the number of engines)

    def engine(self, model=None, config=None, *, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False, **options) -> StreamingEngine:
        if "adapter" in options or "load" in options:
            raise TypeError("a shared model loads its adapter itself: give the model, not an adapter or a loader")
        source = (str(model), device, dtype, trust_remote_code)
        with self._lock:
            if self._source is None:
                self._source = source
            elif source != self._source:
                raise ValueError(f"a shared model is loaded once: this memory asks for {source}, the first asked "
                                 f"for {self._source}")
        return StreamingEngine(model, config, load=lambda: self._load(model, device, dtype, trust_remote_code),
                               bench=self.bench, **options)

    def _load(self, model, device: str, dtype: str, trust_remote_code: bool) -> ModelAdapter:
        # The lock is held while the first engine loads: the others wait here for its adapter, on their workers.
        with self._load_lock:
            if self._adapter is None:
                self._adapter = load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
                self.loads += 1
            return self._adapter


__all__ = ["SharedModel"]
