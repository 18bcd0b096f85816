"""Mixture of experts with expert parallelism: routing, token dispatch, grouped experts."""
