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


def assert_same_norms(ref: list[float], got: list[float], rtol: float = 1e-4) -> None:
    """Pre-clip global grad norms, step by step. Step 1 sees identical params, so its norm (every
    element counted exactly once across tp, pp, dp shards) equals one process's to round-off
    (1e-6); later steps drift with the params (``rtol``)."""
    assert len(ref) == len(got), (len(ref), len(got))
    assert abs(got[0] - ref[0]) <= 1e-6 * ref[0], f"step 1 grad norm {got[0]} vs {ref[0]}"
    for i, (a, b) in enumerate(zip(ref, got)):
        assert abs(a - b) <= rtol * a, f"step {i + 1} grad norm {b} vs {a}"


def assert_parity(ref, got, loss_rtol: float = 1e-5, param_rtol: float = 1e-4) -> None:
    """``got`` (per-rank LayoutRun results) trained like ``ref``: losses, every rank's pre-clip
    grad norms (each rank computes the global norm) and final params.

    The model-wide parameter gap must be below ``param_rtol``; per tensor we allow 10x more
    because gpt2's key bias has an exactly-zero true gradient (softmax ignores a constant per
    query), so Adam turns round-off into updates there in every layout.
    """
    from megatronish.testing.runs import losses_of, merge_params

    gap = max_relative_loss_gap(losses_of(ref), losses_of(got))
    assert all(run.grad_norms for run in got), "every rank reports its grad norms"
    for run in got:
        assert_same_norms(ref[0].grad_norms, run.grad_norms)
    assert gap < loss_rtol, f"per-step loss differs by {gap:.2e} relative"
    model_gap, worst = param_gaps(merge_params(ref), merge_params(got))
    assert model_gap < param_rtol, f"final params differ by {model_gap:.2e} relative"
    assert worst < 10 * param_rtol, f"worst tensor differs by {worst:.2e} relative"
