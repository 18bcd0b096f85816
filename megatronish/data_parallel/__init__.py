"""Data parallelism: ZeRO 0-3 over flat buckets, gradient reduction, parameter gathering."""
