"""Turns at one loaded model for the engines that share it: `ModelTurns`.

Several `StreamingEngine`s (a robot's memory each) may run over one `ModelAdapter`, the weights loaded once. Each
engine's worker takes a turn for every job it runs (an input, a question, a save), and the turns go in the order
they were asked for: a worker that wants the model while another runs waits for that one job, and for the job of each
worker that asked before it, never for a second job of any. A stream flooded with texts thus takes one job a round
(its text calls are bounded in the model's time: engine/runtime/work_queue.py), and another stream's question waits
at most for one job of each other stream. One job at a time also keeps the cores to one job, as for one stream.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager


class ModelTurns:
    """A fair lock over one model: turns in the order asked for. `turn()` is a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._tickets = itertools.count()
        self._serving = 0  # the ticket whose turn it is
        self._issued = 0  # tickets given

    @property
    def asked(self) -> int:
        """Turns asked for and not yet ended, the one in progress among them."""
        with self._lock:
            return self._issued - self._serving

    @contextmanager
    def turn(self):
        with self._lock:
            ticket = next(self._tickets)
            self._issued += 1
            while ticket != self._serving:
                self._lock.wait()
        try:
            yield
        finally:
            with self._lock:
                self._serving += 1
                self._lock.notify_all()


__all__ = ["ModelTurns"]
