"""The models: one adapter per family, loading (folders and the embedded models) and the chat format."""
