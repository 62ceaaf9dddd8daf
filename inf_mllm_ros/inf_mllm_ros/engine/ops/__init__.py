"""Tensor operations: the attention function, rotary re-rotation, the retrieval-window scores (and their Triton
kernel), linear layers of a few rows."""
