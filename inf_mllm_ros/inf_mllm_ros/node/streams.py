"""Several robots on one model in one process: a node per memory, named by the `streams` parameter.

With `streams` empty (`[""]`, the default) the process is one `InfMLLMNode`, as always. With names, each name is a
robot (or a camera) with a memory of its own: an `InfMLLMNode` of the same node name in the namespace of that name
(under the process's namespace), so that its topics, services, action, parameters and /diagnostics status are its
own (`robot1/text`, `robot1/inf_mllm/query`, `/robot1/inf_mllm` on /diagnostics). Every node takes the parameters the
process was given for the node (a params file's block, `-p`), then its own, given there as `<name>.<parameter>`;
the model's parameters (`settings.MODEL_PARAMETERS`) are every memory's and cannot be given per memory, and two
memories cannot share one memory file. Their engines are built through one `SharedModel` (engine/runtime/
shared_model.py): the model is loaded once and their jobs take turns at it.

The process's own arguments (its remappings, its namespace) are read once, by a node that only reads the
parameters and leaves; the memories' nodes take none of them (`use_global_arguments=False`), so that each keeps the
namespace of its name: their topics are named through their parameters (`<name>.image_topics`, `<name>.pose_topic`),
relative to that namespace.
"""

from __future__ import annotations

import re

import rclpy
from rclpy.exceptions import InvalidParameterValueException
from rclpy.parameter import Parameter

from ..settings import BY_NAME, MODEL_PARAMETERS
from .lifecycle import NODE_NAME, InfMLLMNode

# A memory's name is one segment of a ROS name.
STREAM_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Parameters every node has beside the table's.
NODE_OWN = ("use_sim_time",)


def stream_names(value) -> list[str]:
    """The memories `streams` names ([] for one memory, the node itself); InvalidParameterValueException for a name
    that is not one segment of a ROS name, or said twice."""
    names = [n for n in value if n]
    if len(names) != len(value) and names:
        raise InvalidParameterValueException("streams", value, "an empty name beside others")
    for name in names:
        if not STREAM_NAME.match(name):
            raise InvalidParameterValueException(
                "streams", value, f"{name!r} is not a name of letters, digits and '_' starting with a letter")
    if len(set(names)) != len(names):
        raise InvalidParameterValueException("streams", value, "a name said twice")
    return names


def memory_nodes(**node_options) -> list[InfMLLMNode]:
    """The process's nodes: one `InfMLLMNode` (streams empty), or one for each memory `streams` names, over one
    shared model. `node_options` go to every node (tests pass an engine factory)."""
    reader = rclpy.create_node(NODE_NAME, automatically_declare_parameters_from_overrides=True,
                               start_parameter_services=False, enable_rosout=False)
    try:
        given = reader.get_parameters_by_prefix("")
        names = stream_names(given["streams"].value if "streams" in given else [""])
        if not names:
            return [InfMLLMNode(**node_options)]
        name, namespace = reader.get_name(), reader.get_namespace()
    finally:
        reader.destroy_node()
    shared = {p: v.value for p, v in given.items() if p in BY_NAME or p in NODE_OWN}
    shared["streams"] = [""]
    plans = {stream: {**shared, **own_parameters(stream, given)} for stream in names}
    files: dict[str, str] = {}
    for stream, values in plans.items():
        path = values.get("memory_file", "")
        if path and path in files:
            raise InvalidParameterValueException(
                f"{stream}.memory_file", path, f"the memory file of {files[path]!r} too: give each memory its own")
        files[path] = stream
    from ..engine.runtime.shared_model import SharedModel  # with several memories only, once they are checked: torch

    options = {"engine_factory": SharedModel().engine, **node_options}
    nodes: list[InfMLLMNode] = []
    try:
        for stream, values in plans.items():
            nodes.append(InfMLLMNode(name, namespace=f"{namespace.rstrip('/')}/{stream}", use_global_arguments=False,
                                     parameter_overrides=[Parameter(k, value=v) for k, v in values.items()],
                                     **options))
    except Exception:
        for node in nodes:
            node.destroy_node()
        raise
    return nodes


def own_parameters(stream: str, given: dict) -> dict:
    """A memory's own parameter values, given as `<stream>.<parameter>`; InvalidParameterValueException for one the
    node does not have or one every memory shares."""
    own = {}
    for name, param in given.items():
        if not name.startswith(stream + "."):
            continue
        key = name[len(stream) + 1:]
        if key in MODEL_PARAMETERS:
            raise InvalidParameterValueException(
                name, param.value, f"{key} is the model's: every memory on it has the same (give it without {stream}.)")
        if key not in BY_NAME and key not in NODE_OWN:
            raise InvalidParameterValueException(name, param.value, f"{key!r} is not a parameter of inf_mllm_node")
        own[key] = param.value
    return own


__all__ = ["memory_nodes", "own_parameters", "stream_names"]
