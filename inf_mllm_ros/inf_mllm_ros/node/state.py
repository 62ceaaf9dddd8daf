"""What the node's parts share of the node's state, as one typed object the node owns and hands them.

The node (node/lifecycle.py) changes it through its lifecycle; its parts (node/inputs.py, node/services.py,
node/health.py) read it, and none of them reads the node itself: each gets the rclpy node for the ROS entities it
makes (publishers, subscriptions, services, timers, its logger and clock), this state, a way to read a parameter
(`ParameterReader`) and the counters, passed down when it is made.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .engine_interface import EngineLike

ParameterReader = Callable[[str], Any]  # a parameter's value by its name (the node's `param`)


@dataclass
class NodeState:
    """The node's engine and where it stands in its lifecycle."""

    engine: EngineLike | None = None  # from configure to cleanup
    active: bool = False  # taking input
    lifecycle_state: str = "unconfigured"  # as the lifecycle names it; /diagnostics reports it
    # Set while autostart configures and activates: callers then hear "model is still loading".
    autostarting: bool = False
    stopping: threading.Event = field(default_factory=threading.Event)  # set at shutdown
    model_download: str = ""  # while configure downloads a hub model: its progress, for /diagnostics
