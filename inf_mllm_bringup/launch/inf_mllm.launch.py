"""Start inf_mllm_node.

    ros2 launch inf_mllm_bringup inf_mllm.launch.py \\
        params_file:=$(ros2 pkg prefix inf_mllm_bringup)/share/inf_mllm_bringup/config/jetson_orin.yaml \\
        image_topic:=/camera/image_raw text_topic:=/robot/events namespace:=robot1 cache_size:=2048

Every node parameter is also a launch argument of the same name (`ros2 launch inf_mllm_bringup
inf_mllm.launch.py --show-args` lists them); left empty, it keeps the value from the params file (or
the node's default). A value that is not valid for its parameter ends the launch with an error that
names the argument. `image_topic` remaps both `image` and `image/compressed` (image_transport's naming).
With `autostart:=true` (the default) the node configures and activates itself, and the launch ends,
with the node's error, if the model cannot load; `autostart:=false` leaves it unconfigured for a
lifecycle manager.
"""

import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction, Shutdown
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from inf_mllm_ros.fastdds import large_frames_env
# The node's parameter table: it imports no torch (inf_mllm_ros.engine.api), so this process stays small.
from inf_mllm_ros.settings import PARAMETERS

LAUNCH_ONLY = {
    "image_topic": ("image", "Camera topic (sensor_msgs/Image); its '/compressed' sibling is used for CompressedImage"),
    "text_topic": ("text", "Text topic (std_msgs/String); its '/pinned' sibling takes the texts to keep"),
    "params_file": ("", "YAML file with the node's parameters (see inf_mllm_bringup's config/)"),
    "namespace": ("", "Namespace of the node and its topics"),
    "node_name": ("inf_mllm", "Name of the node"),
    "use_sim_time": ("", "true: the node's clock follows /clock (replaying a bag with --clock); empty: the node's own"),
}
# autostart has its default here, and so wins over a params file: the launch decides from it whether the
# node's exit ends the launch.
PARAMETER_DEFAULTS = {"autostart": "true"}


def _node_exited(event, context):
    """The node's exit ends the launch; an exit with an error code (a model that cannot load) also makes
    the launch's result non-zero, which a Shutdown alone does not. Exits during a shutdown are expected."""
    if event.returncode and not context.is_shutdown:
        raise RuntimeError(f"inf_mllm_node exited with code {event.returncode}")
    return Shutdown(reason="inf_mllm_node exited")


def _node(context):
    arg = {name: LaunchConfiguration(name).perform(context) for name in LAUNCH_ONLY}
    params_file = arg["params_file"].strip()
    if params_file and not os.path.isfile(params_file):
        raise FileNotFoundError(f"launch argument params_file:={params_file!r}: no such file")
    overrides = {}
    for param in PARAMETERS:
        rule = param.rule
        text = LaunchConfiguration(rule.name).perform(context)
        if text.strip():
            try:
                overrides[rule.name] = rule.from_text(text)
            except ValueError as exc:
                raise ValueError(f"launch argument {exc}") from None
    sim_time = arg["use_sim_time"].strip().lower()
    if sim_time:
        if sim_time not in ("true", "false"):
            raise ValueError(f"launch argument use_sim_time:={arg['use_sim_time']!r} must be true or false")
        overrides["use_sim_time"] = sim_time == "true"
    if "autostart" not in overrides:  # the launch decides from it what the node's exit does
        raise ValueError("launch argument autostart:='' must be true or false")
    autostart = overrides["autostart"]
    image = arg["image_topic"].strip()
    text = arg["text_topic"].strip()
    return [
        Node(
            package="inf_mllm_ros",
            executable="inf_mllm_node",
            name=arg["node_name"].strip(),
            namespace=arg["namespace"].strip(),
            parameters=([params_file] if params_file else []) + [overrides],
            remappings=[("image", image), ("image/compressed", image + "/compressed"),
                        ("text", text), ("text/pinned", text + "/pinned")],
            output="screen",
            emulate_tty=True,
            additional_env=large_frames_env(),
            # A node that exits (a model that cannot load ends it with code 1) ends the launch, so a
            # supervisor sees it. Under a lifecycle manager the manager decides.
            on_exit=_node_exited if autostart else None,
            # On shutdown the node stops the model within a block or a token, then saves its memory (it waits
            # up to 30 s): SIGTERM and SIGKILL, 5 s apart by default, must not cut that save short.
            sigterm_timeout="35",
        )
    ]


def generate_launch_description():
    launch_only = [DeclareLaunchArgument(name, default_value=default, description=text)
                   for name, (default, text) in LAUNCH_ONLY.items()]
    empty = " Empty: from params_file, else the node's default."
    parameters = [DeclareLaunchArgument(p.name, default_value=PARAMETER_DEFAULTS.get(p.name, ""),
                                        description=p.description + empty)
                  for p in PARAMETERS]
    return LaunchDescription(launch_only + parameters + [OpaqueFunction(function=_node)])
