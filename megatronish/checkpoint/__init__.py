"""Checkpoints: safetensors + JSON, keyed by global tensor names."""
