"""The node's parameters: declared from the settings table, checked when set, and applied while it runs.

`NodeParameters` is a part of `InfMLLMNode` (node.py): it declares every parameter of `settings.PARAMETERS`
with its ROS descriptor, refuses what the descriptors cannot (a policy's name, a period's 0-or-at-least
rule, a knob of another policy), and fans a live change out to whatever reads it: the frame gate, the
engine, or a timer.
"""

from __future__ import annotations

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.exceptions import InvalidParameterValueException

from .settings import BY_NAME, PARAMETERS, Param, knob_problem, live_engine_changes, value_problem


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


class NodeParameters:
    """Declaring, checking and applying the node's parameters, and the periodic timers they set.

    A mixin of `InfMLLMNode`: it uses the node's `engine`, `_active`, `_stats_pub`, `_frame_gate`,
    `_periodic`, `_description_error` and the timer callbacks of the other parts (`_on_description_timer`,
    `_publish_stats`, `_set_diagnostics_period`).
    """

    def _declare_parameters(self) -> None:
        """Declare every parameter of the settings table; a value its rule refuses ends the constructor."""
        for p in PARAMETERS:
            self.declare_parameter(p.name, p.default, descriptor(p))
        for p in PARAMETERS:  # what the descriptors cannot say (a policy's name, a period's rule)
            problem = value_problem(p.name, self._param(p.name))
            if problem:
                raise InvalidParameterValueException(p.name, self._param(p.name), problem)

    def _param(self, name: str):
        return self.get_parameter(name).value

    def _on_set_parameters(self, params) -> SetParametersResult:
        # Ranges and read-only flags were checked by rclpy against the descriptors already; the table's rule
        # also says what a descriptor cannot (a period's 0-or-at-least rule).
        for p in params:
            problem = value_problem(p.name, p.value) if p.name in BY_NAME else None
            if problem:
                return SetParametersResult(successful=False, reason=problem)
        # Read-only parameters were refused already, so these are the policy's live settings.
        knobs = {p.name for p in params if p.name in BY_NAME and BY_NAME[p.name].policy_knob}
        for name in knobs:
            problem = knob_problem(name, self._param("eviction_policy"))
            if problem:
                return SetParametersResult(successful=False, reason=problem)
        # Before configure the parameter alone changes: configure reads it. After, the engine takes its part of
        # the change in one call, checked whole, and applies it between two jobs.
        if self.engine is not None:
            change = live_engine_changes({p.name: p.value for p in params})
            if change:
                try:
                    self.engine.update_settings(**change)
                except ValueError as exc:
                    return SetParametersResult(successful=False, reason=str(exc))
        for p in params:
            if p.name == "frame_rate":
                self._frame_gate.rate = p.value
            elif p.name == "description_period" and self._active:
                self._set_timer("description", p.value)
            elif p.name == "stats_period" and self._stats_pub is not None:
                self._set_timer("stats", p.value)
            elif p.name == "diagnostics_period":
                self._set_diagnostics_period(p.value)
            if p.name in BY_NAME:
                self.get_logger().info(f"{p.name} set to {p.value!r}")
        return SetParametersResult(successful=True)

    def _set_timer(self, name: str, period: float) -> None:
        """(Re)create a periodic timer of `period` seconds; 0: none."""
        old = self._periodic.pop(name, None)
        if old is not None:
            self.destroy_timer(old)
        if name == "description":
            self._description_error = None  # a failure is news only while descriptions run
        if period > 0.0:
            callback = {"description": self._on_description_timer, "stats": self._publish_stats}[name]
            self._periodic[name] = self.create_timer(period, callback)
