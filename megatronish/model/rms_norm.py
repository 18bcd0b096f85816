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

Split backward (zero-bubble schedules, :mod:`megatronish.tensor_parallel.weight_grad`): both
are autograd functions whose backward computes the input's grad and hands the weight's to a
store. "torch" runs what ``F.rms_norm`` runs: ``aten::_fused_rms_norm`` and its backward (with
an output mask: input grad in B, weight grad in W) where torch has that backward for the device,
and elsewhere the ops of torch's composite RMSNorm and of their autograd formulas, so the grads
are bit for bit ``F.rms_norm``'s. The fp32-statistics function's weight grad recomputes the
normalised value from the saved input and ``1/rms`` (two more elementwise kernels), so nothing
in fp32 is kept from B to W.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

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


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, store: WeightGradStore | None = None
) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, with the kernel :func:`rms_norm_kernel`
    picks; returned in ``x``'s dtype. ``store``: where the weight's grad goes (None: "torch"
    is ``F.rms_norm`` itself)."""
    if rms_norm_kernel(x.device.type, x.dtype, TORCH_VERSION) == "torch":
        if store is None:
            return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
        return _TorchRMSNorm.apply(x, x, weight, eps, store)
    return low_precision_rms_norm(x, weight, eps, store)


def fused_backward_on(device: torch.device, x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether ``F.rms_norm`` runs ``aten::_fused_rms_norm`` with its fused backward here: torch
    has that backward's kernel for the device (CUDA from 2.9) and weight and input share a
    dtype (else ``F.rms_norm`` falls back to its composite)."""
    return x_dtype == w_dtype and _has_fused_backward(device.type)


@functools.cache  # asked at every forward; the answer is fixed for a process
def _has_fused_backward(device_type: str) -> bool:
    if not hasattr(torch.ops.aten, "_fused_rms_norm_backward"):
        return False
    key = {"cuda": "CUDA", "cpu": "CPU", "xpu": "XPU"}.get(device_type)
    op = "aten::_fused_rms_norm_backward"
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


class _TorchRMSNorm(torch.autograd.Function):
    """``F.rms_norm``'s computation, forward and backward, with the weight grad through a store:
    the fused kernels where torch has them, else the composite's ops (in its opmath dtype).

    The input comes twice (``x``, ``x_again``): the composite uses it in two ops, whose grads
    autograd adds to whatever else reaches the input (a residual's grad) one after the other;
    returning them as two grads keeps that order of the sums, so the input's grad is bit for
    bit the composite's.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        x_again: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.weight, ctx.store = weight, store
        ctx.fused = fused_backward_on(x.device, x.dtype, weight.dtype)
        if ctx.fused:
            out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
            ctx.save_for_backward(x, rstd)
            return out
        xu = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        rstd = torch.rsqrt(xu.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = xu.mul(rstd)
        ctx.save_for_backward(xu, rstd, normed)
        ctx.x_dtype = x.dtype
        return normed.mul(weight).type_as(x).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        weight = ctx.weight
        want_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = grad_x_again = None
        if ctx.fused:
            x, rstd = ctx.saved_tensors
            shape = [x.shape[-1]]
            fused = torch.ops.aten._fused_rms_norm_backward
            if want_x:
                grad_x = fused(grad, x, shape, rstd, weight, [True, False])[0]

            def job() -> GradPairs:
                return [(weight, fused(grad, x, shape, rstd, weight, [False, True])[1])]

        else:
            xu, rstd, normed = ctx.saved_tensors
            g = grad.to(torch.promote_types(normed.dtype, weight.dtype))  # the type_as's
            if want_x:
                grad_x, grad_x_again = _composite_input_grads(g, xu, rstd, weight)
                if ctx.x_dtype != xu.dtype:  # summed at the upcast, then cast back
                    grad_x, grad_x_again = (grad_x + grad_x_again).to(ctx.x_dtype), None

            def job() -> GradPairs:  # the mul's grad summed to the weight's shape
                return [(weight, (g * normed).sum_to_size(weight.shape))]

        if not ctx.needs_input_grad[2]:
            return grad_x, grad_x_again, None, None, None
        grads = weight_grads(ctx.store, job)
        return grad_x, grad_x_again, grad_of(grads, weight), None, None


def _composite_input_grads(
    g: torch.Tensor, xu: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two grads at the input of torch's composite RMSNorm (``pow(x, 2).mean().add_(eps)
    .rsqrt()``, ``x * rstd``, ``* weight``), through ``x * rstd`` and through ``pow``, op by op
    as autograd's formulas compute them."""
    g_normed = g * weight  # mul: grad * other
    g_direct = g_normed * rstd  # x * rstd, at x
    g_rstd = (g_normed * xu).sum(-1, keepdim=True)  # x * rstd, at rstd (summed to its shape)
    g_ms = g_rstd * -0.5 * rstd.pow(3)  # rsqrt: -0.5 * grad * result^3
    g_mean = g_ms.expand(xu.shape) / xu.shape[-1]  # mean: expanded grad / count
    return g_direct, g_mean * (2.0 * xu.pow(1.0))  # pow(x, 2): grad * (2 * x^1)


class _LowPrecisionRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.store = store
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad_out.float() * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        if not ctx.needs_input_grad[1]:
            return grad_x.to(x.dtype), None, None, None

        def job() -> GradPairs:  # the normalised value again: no fp32 tensor kept for W
            normed = x.float() * rstd
            grad_w = (grad_out.float() * normed).reshape(-1, normed.shape[-1]).sum(0)
            return [(weight, grad_w.to(weight.dtype))]

        grads = weight_grads(ctx.store, job)
        return grad_x.to(x.dtype), grad_of(grads, weight), None, None


def low_precision_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, store: WeightGradStore | None = None
) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, in fp32, returned in ``x``'s dtype; ``store``:
    where the weight's grad goes."""
    return _LowPrecisionRMSNorm.apply(x, weight, eps, store)
