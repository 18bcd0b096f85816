"""RMSNorm: torch's kernel where it computes in fp32, else a function that does.

:func:`low_precision_rms_norm` runs the statistics, the normalisation and the scaling of bf16
(or other low-precision) activations in fp32 and rounds the output once; backward keeps only
the input and the per-token ``1/rms`` (as fused GPU kernels do), not fp32 copies of the
activations. It is a Python autograd function: about 5 kernels forward and 10 backward.

``torch.nn.functional.rms_norm`` of 16-bit activations: torch 2.6 rounds the normalised value
to 16 bits before the weight multiplies it (two roundings); 2.7 and 2.8 compute in fp32 and
round once, but as a chain of unfused ops whose autograd keeps fp32 copies; from 2.9 on CUDA
runs one fused kernel (``aten::_fused_rms_norm``, fp32 statistics and math, one rounding, and a
fused backward). :func:`rms_norm_kernel` picks torch's kernel for fp32 everywhere and for
16-bit on CUDA from torch 2.9, and the fp32-statistics function otherwise (CPU included).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

FUSED_CUDA_RMS_NORM = (2, 9)  # the first torch with aten::_fused_rms_norm's CUDA kernel
# (major, minor): a 2.9.0a0 pre-release (NGC containers) counts as 2.9; one older than the kernel
# falls back to 2.8's unfused ops, which compute in fp32 too.
TORCH_VERSION = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def rms_norm_kernel(device_type: str, dtype: torch.dtype, torch_version: tuple[int, int]) -> str:
    """The RMSNorm for ``dtype`` activations on ``device_type`` under torch ``(major, minor)``:
    "torch" (``F.rms_norm``) or "fp32_statistics" (:func:`low_precision_rms_norm`)."""
    if dtype in (torch.float32, torch.float64):
        return "torch"
    if device_type == "cuda" and torch_version >= FUSED_CUDA_RMS_NORM:
        return "torch"
    return "fp32_statistics"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, with the kernel :func:`rms_norm_kernel`
    picks; returned in ``x``'s dtype."""
    if rms_norm_kernel(x.device.type, x.dtype, TORCH_VERSION) == "torch":
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return low_precision_rms_norm(x, weight, eps)


class _LowPrecisionRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):
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
