"""Parity assertions shared by the layout tests."""

from __future__ import annotations

import torch


def max_relative_loss_gap(ref: list[float], got: list[float]) -> float:
    """Largest per-step ``|got - ref| / |ref|``."""
    assert len(ref) == len(got), (len(ref), len(got))
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got))


def param_gaps(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``(model-wide ||d|| / ||p||, worst per-tensor ||d|| / ||p||)`` over the same names."""
    assert set(ref) == set(got), sorted(set(ref) ^ set(got))
    diff_sq = sum(float((ref[k] - got[k]).double().pow(2).sum()) for k in ref)
    norm_sq = sum(float(ref[k].double().pow(2).sum()) for k in ref)
    worst = max(float((ref[k] - got[k]).norm() / ref[k].norm().clamp_min(1e-12)) for k in ref)
    return (diff_sq / norm_sq) ** 0.5, worst
