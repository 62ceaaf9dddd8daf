"""A multi-threaded executor that hands each callback to its threads once: `OnceQueuedExecutor`.

rclpy's `MultiThreadedExecutor` (Humble to Kilted) submits a ready callback to its thread pool and then, on every
turn until a pool thread has started it, yields it again without waiting and submits it once more
(ros2/rclpy#1452). Under load the spinning thread holds the GIL while the pool's threads wait for it to start the
work, so the queue grows faster than it is worked off: under a flood of texts beside a camera, the node's executor
thread ran a whole core while the model's thread and the frame callbacks took almost nothing (docs/node.md).

This executor keeps the same wait set (rclpy's public `wait_for_ready_callbacks`) and differs in one thing: a
callback already in the pool's queue is not queued again; the spinning thread waits, without the GIL, for a pool
thread to take it up. An exception raised in a callback ends `spin_once` on the spinning thread, as rclpy's does.

`BoundedCallbackGroup` lets at most a set number of its callbacks run at once: while they are all taken, the
executor leaves the group's entities out of its wait set, so what comes for them waits in the middleware's history
(the node's `~/query` and `~/recall` run in one: docs/node.md, Many callers).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from rclpy.callback_groups import CallbackGroup
from rclpy.executors import (ConditionReachedException, Executor, ExternalShutdownException, ShutdownException,
                             TimeoutException)

# The longest the spinning thread waits for a pool thread to take up a callback it already queued before it looks
# at the wait set again (a shutdown or a callback of higher order may be waiting meanwhile).
QUEUED_WAIT_S = 0.05


def _never() -> bool:
    return False


class OnceQueuedExecutor(Executor):
    """`num_threads` threads run the callbacks; the thread that calls `spin_once` only waits and hands them out."""

    def __init__(self, num_threads: int, *, context=None):
        super().__init__(context=context)
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="ros_callbacks")
        self._queued: dict[object, threading.Event] = {}  # handed to the pool, not finished: set once started
        self._queued_lock = threading.Lock()
        self._errors: deque[BaseException] = deque()  # raised by callbacks, re-raised on the spinning thread

    def spin_once(self, timeout_sec: float | None = None) -> None:
        self._spin_once(timeout_sec)

    def spin_once_until_future_complete(self, future, timeout_sec: float | None = None) -> None:
        self._spin_once(timeout_sec, future.done)

    def _spin_once_until_future_complete(self, future, timeout_sec: float | None = None) -> None:
        # What `spin_until_future_complete` calls from Jazzy on (Humble calls the public one).
        self._spin_once(timeout_sec, future.done)

    def _spin_once(self, timeout_sec: float | None, condition=_never) -> None:
        if self._errors:
            raise self._errors.popleft()
        try:
            # The same arguments each turn: rclpy keeps handing out what one wait found until it is all out.
            handler, _entity, _node = self.wait_for_ready_callbacks(timeout_sec, None, condition)
        except (ShutdownException, ExternalShutdownException, TimeoutException, ConditionReachedException):
            return
        with self._queued_lock:
            started = self._queued.get(handler)
            if started is None:
                started = self._queued[handler] = threading.Event()
                self._pool.submit(self._run, handler, started)
                return
        started.wait(QUEUED_WAIT_S)

    def _run(self, handler, started: threading.Event) -> None:
        started.set()
        try:
            handler()
        finally:
            # A coroutine that awaits something is handed out again when rclpy yields it next.
            with self._queued_lock:
                self._queued.pop(handler, None)
        if handler.done() and handler.exception() is not None:
            self._errors.append(handler.exception())

    def shutdown(self, timeout_sec: float | None = None, *, wait_for_threads: bool = True) -> bool:
        """Stop handing out callbacks and wait up to `timeout_sec` for those running (as rclpy's executors)."""
        done = super().shutdown(timeout_sec)
        self._pool.shutdown(wait=wait_for_threads)
        return done


class BoundedCallbackGroup(CallbackGroup):
    """At most `slots` callbacks of the group run at once (a `ReentrantCallbackGroup` up to that many).

    While every slot is taken, `can_execute` is False: rclpy's executors (Humble to Kilted, and this module's, which
    keeps their wait set) leave the group's entities out of the wait set, so a service's requests stay in its
    middleware history, unread, until a callback ends and frees a slot; `beginning_execution` refuses a callback
    that lost the race for the last slot, and the executor hands it out again later, its request still untaken.
    """

    def __init__(self, slots: int):
        super().__init__()
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Callbacks of the group running now."""
        with self._lock:
            return self._running

    def can_execute(self, entity) -> bool:
        with self._lock:
            return self._running < self.slots

    def beginning_execution(self, entity) -> bool:
        with self._lock:
            if self._running >= self.slots:
                return False
            self._running += 1
            return True

    def ending_execution(self, entity) -> None:
        with self._lock:
            self._running -= 1
