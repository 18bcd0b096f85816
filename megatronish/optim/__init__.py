"""The optimizer (AdamW over flat shards) and the learning-rate schedule."""
