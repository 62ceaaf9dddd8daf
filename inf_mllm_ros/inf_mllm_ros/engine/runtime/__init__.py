"""The stream and what runs it: `KVStream` (one stream through one model), the threaded `StreamingEngine`, its
worker, work queue, live settings and checkpoints."""
