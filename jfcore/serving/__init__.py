"""Serving a model over an OpenAI-compatible API with continuous batching (docs/SERVING.md)."""
