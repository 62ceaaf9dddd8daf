"""inf_mllm_ros: a multimodal LLM over an endless camera and text stream, in constant memory."""

__version__ = "0.1.0"
