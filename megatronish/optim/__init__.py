"""Optimizer, LR schedule, gradient synchronisation and clipping."""
