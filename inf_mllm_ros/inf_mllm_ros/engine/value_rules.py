"""The rules a setting's value must follow (type, range, grid, choices, periods), on plain descriptions.

Imports neither ROS nor torch: the launch file checks its arguments with these rules without loading the
engine, and the policies' knobs, the node's parameters and the offline runner use the same ones.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Periods below this (other than 0, off) would keep an executor thread busy with timers.
MIN_PERIOD = 0.05


def as_declared(value, expected: type):
    """The value in the setting's own type where it is taken as one: an int for a float (YAML's `2` for 2.0)."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def setting_problem(name: str, value, expected: type, low: float | None = None, high: float | None = None,
                    step: int = 1) -> str | None:
    """Why `value` is refused for a setting of type `expected` in [low, high] (numbers; with `step`, on a grid
    from `low`), or None. An int is taken for a float (`as_declared`)."""
    value = as_declared(value, expected)
    if expected is list:  # a list of strings (ROS's string array; a tuple is taken for one)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            return f"{name} must be a list of strings, got {value!r}"
        return None
    if type(value) is not expected:
        return f"{name} must be of type {expected.__name__}, got {value!r}"
    if low is None or isinstance(value, (bool, str)):
        return None
    if not low <= value <= high:
        return f"{name} must be in [{low:g}, {high:g}], got {value!r}"
    if step > 1 and (value - low) % step:
        return f"{name} must be {low:g} plus a multiple of {step}, got {value!r}"
    return None


def period_problem(name: str, value: float) -> str | None:
    """Why a period is refused (0 turns it off; a tiny one would busy the executor), or None."""
    if 0.0 < value < MIN_PERIOD:
        return f"{name} must be 0 (off) or at least {MIN_PERIOD} s, got {value:g}"
    return None


# A camera's name, as its frames' markers and evidence say it: a ROS name token, short enough for the memory file.
CAMERA_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")


def camera_problem(name: object) -> str | None:
    """Why `name` cannot name a camera (a letter, then letters, digits or underscores, 32 at most), or None; ""
    (a robot's one camera) names none."""
    if name == "":
        return None
    if not isinstance(name, str) or CAMERA_NAME.fullmatch(name) is None:
        return (f"camera name {name!r} refused: a letter, then letters, digits or underscores, 32 characters at "
                "most")
    return None


# The most moments one recall gives.
MAX_RECALL_RESULTS = 100


def recall_problem(limit: int, since: float | None, until: float | None,
                   near: tuple[float, float, float] | None, camera: str = "") -> str | None:
    """Why a recall's arguments cannot be used, or None: the one rule the node's ~/recall and the stream's own
    callers are held to. `near`: (x, y, radius) with a radius > 0 m (None: anywhere)."""
    if not 1 <= limit <= MAX_RECALL_RESULTS:
        return f"the limit of moments (max_results) must be in [1, {MAX_RECALL_RESULTS}], got {limit}"
    if since is not None and until is not None and until < since:
        return f"the time window ends ({until:g}) before it begins ({since:g}): until < since"
    if near is not None:
        if not all(map(math.isfinite, near)):
            return f"the place must be finite numbers, got {tuple(near)}"
        if not near[2] > 0:
            return f"the radius must be > 0 m, got {near[2]:g}"
    return camera_problem(camera)


@dataclass(frozen=True)
class ValueRule:
    """What one setting accepts. `choices`: the only values a string may take (empty: any); `period`: 0 or
    at least MIN_PERIOD."""

    name: str
    type: type
    low: float | None = None
    high: float | None = None
    step: int = 1
    choices: tuple[str, ...] = ()
    period: bool = False

    def problem(self, value) -> str | None:
        """Why `value` is refused, or None."""
        problem = setting_problem(self.name, value, self.type, self.low, self.high, self.step)
        if problem is None and self.period:
            problem = period_problem(self.name, value)
        if problem is None and self.choices and value not in self.choices:
            problem = f"{self.name} must be one of {list(self.choices)}, got {value!r}"
        return problem

    def from_text(self, text: str):
        """The value a text stands for (a launch argument, a command line), checked; ValueError naming the
        setting if the text is not a valid value."""
        try:
            if self.type is bool:
                if text.strip().lower() not in ("true", "false"):
                    raise ValueError
                value = text.strip().lower() == "true"
            elif self.type is list:  # "a, b" or "[a, b]"
                inner = text.strip().removeprefix("[").removesuffix("]")
                value = [item.strip().strip("'\"") for item in inner.split(",")] if inner.strip() else []
            else:
                value = self.type(text if self.type is str else text.strip())
        except ValueError:
            raise ValueError(f"{self.name}:={text!r} is not a valid {self.type.__name__}") from None
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{self.name}:={text!r}: {problem}")
        return value
