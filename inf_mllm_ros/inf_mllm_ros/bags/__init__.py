"""Rosbag2 tooling: reading bags without ROS, bag messages as the node's inputs, the replay tool, the
offline runner with its report, and the sample bag generator."""
