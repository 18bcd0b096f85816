"""Test helpers shipped with the package (used by tests/ and by benchmarks)."""
