"""The second memory: the stream's KV archived in host memory, its retrieval index, heads and retriever, and
the evidence an answer rests on."""
