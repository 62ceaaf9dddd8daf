"""The streaming engine: bounded KV cache, eviction policies, model adapters. Imports no rclpy."""
