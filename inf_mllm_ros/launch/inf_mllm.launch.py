"""Start inf_mllm_node.

    ros2 launch inf_mllm_ros inf_mllm.launch.py params_file:=$(ros2 pkg prefix inf_mllm_ros)/share/inf_mllm_ros/config/jetson_orin.yaml \
        image_topic:=/camera/image_raw text_topic:=/robot/events namespace:=robot1

Arguments left empty keep the value from the params file (or the node's default).
`image_topic` remaps both `image` and `image/compressed` (image_transport's naming).
With `autostart:=true` (the default) the node configures and activates itself, and the launch ends,
with the node's error, if the model cannot load; `autostart:=false` leaves it unconfigured for a
lifecycle manager.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction, Shutdown
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

ARGUMENTS = {
    "model": "Model folder, 'smolvlm-smollm2' (embedded default, untrained vision) or 'smollm2' (text only); "
             "empty: from the params file",
    "cache_size": "KV cache size in tokens; empty: from the params file",
    "attention_bias": "Eviction bias toward newer tokens; empty: from the params file",
    "image_topic": "Camera topic (sensor_msgs/Image); its '/compressed' sibling is used for CompressedImage",
    "text_topic": "Text topic (std_msgs/String)",
    "params_file": "YAML file with the node's parameters (see config/)",
    "namespace": "Namespace of the node and its topics",
    "node_name": "Name of the node",
    "autostart": "true: configure and activate at start, and end the launch if the model cannot load; "
                 "false: wait unconfigured for a lifecycle manager",
}
DEFAULTS = {"image_topic": "image", "text_topic": "text", "node_name": "inf_mllm", "autostart": "true"}


def _typed(name: str, text: str, kind):
    """An argument's value as its parameter's type, or an error that names the argument."""
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"launch argument {name}:={text!r} is not a valid {kind.__name__}") from None


def _flag(name: str, text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"launch argument {name}:={text!r} must be true or false")
    return text.lower() == "true"


def _fastdds_env():
    """Fast DDS with large shared-memory segments for raw frames, unless a profile is chosen already."""
    if os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("FASTDDS_BUILTIN_TRANSPORTS"):
        return {}
    profile = os.path.join(get_package_share_directory("inf_mllm_ros"), "config", "fastdds_large_frames.xml")
    return {"FASTDDS_DEFAULT_PROFILES_FILE": profile}


def _node(context):
    arg = {name: LaunchConfiguration(name).perform(context).strip() for name in ARGUMENTS}
    if arg["params_file"] and not os.path.isfile(arg["params_file"]):
        raise FileNotFoundError(f"launch argument params_file:={arg['params_file']!r}: no such file")
    parameters = [arg["params_file"]] if arg["params_file"] else []
    autostart = _flag("autostart", arg["autostart"])
    overrides = {"autostart": autostart}
    if arg["model"]:
        overrides["model"] = arg["model"]
    if arg["cache_size"]:
        overrides["cache_size"] = _typed("cache_size", arg["cache_size"], int)
    if arg["attention_bias"]:
        overrides["attention_bias"] = _typed("attention_bias", arg["attention_bias"], float)
    if overrides:
        parameters.append(overrides)
    image = arg["image_topic"]
    return [
        Node(
            package="inf_mllm_ros",
            executable="inf_mllm_node",
            name=arg["node_name"],
            namespace=arg["namespace"],
            parameters=parameters,
            remappings=[("image", image), ("image/compressed", image + "/compressed"), ("text", arg["text_topic"])],
            output="screen",
            emulate_tty=True,
            additional_env=_fastdds_env(),
            # A node that exits (a model that cannot load ends it with code 1) ends the launch, so a
            # supervisor sees it. Under a lifecycle manager the manager decides.
            on_exit=Shutdown(reason="inf_mllm_node exited") if autostart else None,
        )
    ]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=DEFAULTS.get(name, ""), description=text)
         for name, text in ARGUMENTS.items()]
        + [OpaqueFunction(function=_node)]
    )
