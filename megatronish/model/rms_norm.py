"""RMSNorm for bf16 (or other low-precision) activations, computed in fp32.

The statistics, the normalisation and the scaling run in fp32 and the output is rounded once;
backward keeps only the input and the per-token ``1/rms`` (as fused GPU kernels do), not fp32
copies of the activations. fp32 activations use ``torch.nn.functional.rms_norm``.
"""

from __future__ import annotations

import torch


class _LowPrecisionRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad_out.float()
        grad_w = (g * normed).reshape(-1, normed.shape[-1]).sum(0)
        g = g * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def low_precision_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, in fp32, returned in ``x``'s dtype."""
    return _LowPrecisionRMSNorm.apply(x, weight, eps)
