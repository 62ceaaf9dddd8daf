"""CPU-bound work beside what a test or benchmark measures, as a robot's other work (perception, planning) takes
cores: `busy_cores(n)` starts n processes that each keep a core busy, and stops them when its block ends.

Each process is a plain Python loop (`python -S`: no site, so no ROS bootstrap and no imports), bounded in time and
watching its parent: it ends by itself after `seconds`, or once the process that started it is gone, so a test
killed midway leaves no load behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

from .node_process import proc_cpu_seconds

# The loop each process runs: spin until the deadline or until the parent is gone (checked every ~50 ms).
_SPIN = """
import os, time
parent, end = {parent}, time.monotonic() + {seconds}
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(200000):
        pass
"""


def cores_less_one() -> int:
    """As many CPU-bound processes as the machine has cores less one (at least one): a robot's other work."""
    return max(1, (os.cpu_count() or 2) - 1)


class BusyCores:
    """The running load: its processes, and the CPU time they have had."""

    def __init__(self, n: int, seconds: float):
        self.started = time.monotonic()
        self.procs = [subprocess.Popen([sys.executable, "-S", "-c", _SPIN.format(parent=os.getpid(),
                                                                                  seconds=float(seconds))])
                      for _ in range(n)]
        self._cpu_s = 0.0
        self.ended: float | None = None

    def cpu_seconds(self) -> float:
        """CPU time the load's processes have had so far (kept once they end)."""
        live = [proc_cpu_seconds(p.pid) for p in self.procs if p.poll() is None]
        return max(self._cpu_s, sum(s for s in live if s is not None))

    def cores_taken(self) -> float:
        """Cores the load kept busy on average since it started (n if it had them to itself)."""
        end = time.monotonic() if self.ended is None else self.ended
        return self.cpu_seconds() / max(end - self.started, 1e-9)

    @property
    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        if self.ended is not None:
            return
        self._cpu_s = self.cpu_seconds()
        self.ended = time.monotonic()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)


@contextmanager
def busy_cores(n: int, seconds: float = 600.0):
    """n CPU-bound processes while the block runs (each ends by itself after `seconds` at most); yields `BusyCores`.
    n 0: no load."""
    load = BusyCores(n, seconds)
    try:
        yield load
    finally:
        load.stop()
