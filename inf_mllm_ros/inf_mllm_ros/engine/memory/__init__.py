"""The bounded KV cache: its layers, the plan of each forward, the eviction policies and the fixed-shape steps
over its storage."""
