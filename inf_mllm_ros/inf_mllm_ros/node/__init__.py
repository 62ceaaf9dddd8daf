"""The ROS 2 node: a thin adapter from topics, services, the action and parameters to the engine."""
