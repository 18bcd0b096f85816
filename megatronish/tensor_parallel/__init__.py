"""Megatron-style tensor and sequence parallelism: mappings, layers, loss, RNG tracker."""
