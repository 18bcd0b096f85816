"""The experts' grouped GEMMs in fp8 (``trainer.fp8`` in MoE blocks), through
``torch._scaled_grouped_mm``.

Recipe, under both ``trainer.fp8`` recipes: the forward ``x W_e^T`` and the input grad ``g W_e``
run in float8 e4m3 with rowwise scales (one per token row; one per output column of each
expert's weight), current scaling as in :mod:`megatronish.tensor_parallel.fp8`; the weight grad
``g_e^T x_e`` stays one bf16 grouped GEMM (torchao's "rowwise with the weight grad in high
precision" recipe). Why, from ``torch._scaled_grouped_mm``'s CUDA contract (torch 2.11-2.13):
it takes e4m3 operands only (so output grads are e4m3 here, not e5m2) and rowwise scales only
(so tensorwise is rowwise for the experts); the weight-grad form (2d x 2d, groups along the
summed token dimension) asserts on the device that every expert's token count is a multiple of
16, which would need dispatch to pad every expert's rows. The input stays bf16 for the weight
grad, so fp8 experts keep what bf16 experts keep.

Where: CUDA compute capability 9.x (the kernel is CUTLASS's SM90 rowwise one). On CPU torch has
no kernel: :func:`scaled_grouped_mm` first runs torch's meta kernel on the same shapes, strides
and dtypes (it checks CUDA's contract: e4m3, ``a`` row-major, ``b`` column-major, fp32 scales
of ``[rows]`` and ``[experts, n]``, bf16 out), then one ``torch._scaled_mm`` per expert, so
CPU tests run the operands a GPU would get. Elsewhere the experts stay bf16
(:func:`fp8_experts_supported`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._compile import _disable_dynamo

from megatronish.moe.grouped_mm import contiguous_aligned
from megatronish.tensor_parallel.fp8 import E4M3, quantize
from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def fp8_experts_supported(device: torch.device, capability: tuple[int, int] | None) -> bool:
    """Whether the experts' GEMMs on ``device`` (a CUDA one of ``capability``) run in fp8."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and capability is not None and capability[0] == 9


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@_disable_dynamo  # torch.compiler.disable, importing dynamo only when called
def _reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    args = (_on_meta(a), _on_meta(b), _on_meta(scale_a), _on_meta(scale_b))
    torch._scaled_grouped_mm(*args, offs=_on_meta(offsets), out_dtype=out_dtype)  # CUDA's checks
    out = a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype)
    start = 0
    for expert, end in enumerate(offsets.tolist()):  # a host tensor here
        if end > start:
            out[start:end] = torch._scaled_mm(
                a[start:end],
                b[expert],
                scale_a=scale_a[start:end, None],
                scale_b=scale_b[expert, None],
                out_dtype=out_dtype,
            )
        start = end
    return out


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``[offsets[e-1], offsets[e])`` of fp8 ``a [rows, k]`` times ``b[e] [k, n]``, scaled
    by ``scale_a [rows]`` and ``scale_b [experts, n]``: ``[rows, n]`` in ``out_dtype``."""
    if a.device.type == "cpu":
        return _reference(a, b, scale_a, scale_b, offsets, out_dtype)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=out_dtype)


def _column_major_stack(t: torch.Tensor) -> torch.Tensor:
    """Each matrix of the stack ``t`` with column-major strides."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


class Fp8GroupedLinear(torch.autograd.Function):
    """``x [rows, k]`` grouped by ``offsets`` times ``weight [experts, n, k]`` (each group by
    its expert's transpose): forward and input grad in fp8, the stack's grad in bf16 through
    a store."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        offsets: torch.Tensor,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        x = contiguous_aligned(x)
        x8, sx = quantize(x, E4M3, -1)  # per row, over k
        w8, sw = quantize(weight, E4M3, -1)  # per expert and output column, over k
        out = scaled_grouped_mm(
            x8, w8.transpose(-2, -1), sx.squeeze(-1), sw.squeeze(-1), offsets, x.dtype
        )
        ctx.save_for_backward(x, weight, offsets)
        ctx.weight, ctx.store = weight, store
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, offsets = ctx.saved_tensors
        param = ctx.weight
        grad = contiguous_aligned(grad)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g8, sg = quantize(grad, E4M3, -1)  # per row, over n
            w8, sw = quantize(weight, E4M3, 1)  # per expert and input column, over n
            w8 = _column_major_stack(w8)
            grad_x = scaled_grouped_mm(g8, w8, sg.squeeze(-1), sw.squeeze(1), offsets, x.dtype)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None

        def job() -> GradPairs:
            return [(param, torch._grouped_mm(grad.t(), x, offs=offsets))]

        return grad_x, grad_of(weight_grads(ctx.store, job), param), None, None


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """:func:`~megatronish.moe.grouped_mm.grouped_linear` with the forward and input-grad GEMMs
    in fp8 (``offsets``: the groups' int32 end rows on ``x``'s device; at least one row)."""
    return Fp8GroupedLinear.apply(x, weight, offsets, store)
