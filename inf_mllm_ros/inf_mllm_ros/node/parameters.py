"""The node's parameters: declared from the settings table, checked when set, and applied while it runs.

`declare_parameters` declares every parameter of `settings.PARAMETERS` with its ROS descriptor; `change_problem`
refuses what the descriptors cannot (a policy's name, a period's 0-or-at-least rule, a knob of another policy).
The node (node/lifecycle.py) fans a live change out to whatever reads it: the frame gate, the engine, or a timer.
"""

from __future__ import annotations

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import InvalidParameterValueException

from ..settings import BY_NAME, PARAMETERS, Param, knob_problem, value_problem


def descriptor(p: Param) -> ParameterDescriptor:
    """The ROS descriptor of a parameter of the settings table (ranges enforced by rclpy)."""
    d = ParameterDescriptor(name=p.name, description=p.description, read_only=p.read_only,
                            additional_constraints=p.constraints)
    if isinstance(p.default, bool) or p.low is None:
        return d
    if isinstance(p.default, int):
        d.integer_range = [IntegerRange(from_value=int(p.low), to_value=int(p.high), step=p.step)]
    else:
        d.floating_point_range = [FloatingPointRange(from_value=float(p.low), to_value=float(p.high), step=0.0)]
    return d


def declare_parameters(node) -> None:
    """Declare every parameter of the settings table on `node`; a value its rule refuses ends the constructor."""
    for p in PARAMETERS:
        node.declare_parameter(p.name, p.default, descriptor(p))
    for p in PARAMETERS:  # what the descriptors cannot say (a policy's name, a period's rule)
        value = node.get_parameter(p.name).value
        problem = value_problem(p.name, value)
        if problem:
            raise InvalidParameterValueException(p.name, value, problem)


def change_problem(params, policy: str) -> str | None:
    """Why a change of parameters is refused (None: it is not). Ranges and read-only flags were checked by rclpy
    against the descriptors already; the table's rule also says what a descriptor cannot (a period's 0-or-at-least
    rule, a knob of another policy than `policy`)."""
    for p in params:
        problem = value_problem(p.name, p.value) if p.name in BY_NAME else None
        if problem:
            return problem
    # Read-only parameters were refused already, so these are the policy's live settings.
    for name in {p.name for p in params if p.name in BY_NAME and BY_NAME[p.name].policy_knob}:
        problem = knob_problem(name, policy)
        if problem:
            return problem
    return None
