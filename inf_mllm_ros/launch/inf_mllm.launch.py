"""Start inf_mllm_node.

    ros2 launch inf_mllm_ros inf_mllm.launch.py params_file:=$(ros2 pkg prefix inf_mllm_ros)/share/inf_mllm_ros/config/jetson_orin.yaml \
        image_topic:=/camera/image_raw text_topic:=/robot/events namespace:=robot1

Arguments left empty keep the value from the params file (or the node's default).
`image_topic` remaps both `image` and `image/compressed` (image_transport's naming).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
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
}
DEFAULTS = {"image_topic": "image", "text_topic": "text", "node_name": "inf_mllm"}


def _fastdds_env():
    """Fast DDS with large shared-memory segments for raw frames, unless a profile is chosen already."""
    if os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("FASTDDS_BUILTIN_TRANSPORTS"):
        return {}
    profile = os.path.join(get_package_share_directory("inf_mllm_ros"), "config", "fastdds_large_frames.xml")
    return {"FASTDDS_DEFAULT_PROFILES_FILE": profile}


def _node(context):
    arg = {name: LaunchConfiguration(name).perform(context).strip() for name in ARGUMENTS}
    parameters = [arg["params_file"]] if arg["params_file"] else []
    overrides = {}
    if arg["model"]:
        overrides["model"] = arg["model"]
    if arg["cache_size"]:
        overrides["cache_size"] = int(arg["cache_size"])
    if arg["attention_bias"]:
        overrides["attention_bias"] = float(arg["attention_bias"])
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
        )
    ]


def generate_launch_description():
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=DEFAULTS.get(name, ""), description=text)
         for name, text in ARGUMENTS.items()]
        + [OpaqueFunction(function=_node)]
    )
