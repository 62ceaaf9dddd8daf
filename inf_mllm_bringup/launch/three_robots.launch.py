"""Start one inf_mllm_node process serving three robots from one model (config/three_robots.yaml).

    ros2 launch inf_mllm_bringup three_robots.launch.py [params_file:=my_robots.yaml] [any inf_mllm.launch.py argument]

Each robot is a node of its own in the namespace of its name (/robot_a/inf_mllm: topics robot_a/text, robot_a/image,
services robot_a/inf_mllm/query...), with the file's values at its top and its own under its name (docs/node.md,
Several robots on one model). Every argument of inf_mllm.launch.py is passed on.
"""

import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration


def generate_launch_description():
    share = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's share folder, installed
    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=os.path.join(share, "config", "three_robots.yaml"),
                              description="The robots' parameters: streams, every robot's values, each one's own"),
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, "launch", "inf_mllm.launch.py")),
            launch_arguments={"params_file": LaunchConfiguration("params_file")}.items(),
        ),
    ])
