"""Context parallelism: each sequence split over the cp group, attention over the whole of it."""
