"""FP8 linear layers (``trainer.fp8``): a linear's three GEMMs in float8 with current scaling.

A thin layer over ``torch._scaled_mm`` (on CUDA cuBLASLt's fp8 GEMMs; on CPU a reference kernel
with the same contract, so the path is tested here). Not torchao's ``Float8Linear``: it swaps
``nn.Linear`` modules and its tensor parallelism goes through DTensor, while our linears are our
own tensor-parallel modules with their own collectives and ZeRO's flat buffers own the weights;
the cast-and-scale arithmetic is small enough to own (the recipes are torchao's).

Current scaling: every GEMM operand is scaled from its own amax at the time it is cast (no
amax history), ``scale = amax / max_finite`` in fp32, ``q = t / scale`` cast to fp8 (no clamp:
the quotient exceeds ``max_finite`` by a rounding at most, which the cast rounds back); the
GEMM multiplies by the scales of both operands (it gets dequantization scales) and writes the
output in the activations' dtype (bf16). A cast reads and writes as few bytes as eager ops
allow, with the bits of the fp32 computation (see :func:`quantize`). The two recipes are
torchao's of the same names:

- ``tensorwise``: one exact scale per tensor; e4m3 (more mantissa) for activations and weights,
  e5m2 (more range) for output gradients, as in torchao and Transformer Engine. Forward keeps the
  fp8 copy of the input (and its scale) for backward: half the bytes of the bf16 input a bf16
  linear keeps. The weight is cast again in backward from the parameter (unchanged within a
  step, so to the same bits): an fp8 copy kept per microbatch in flight would cost more than the
  input saves once several are.
- ``rowwise``: one scale per row of a GEMM's left operand and per column of its right one (the
  dimensions that are not summed over), so an outlier token or output channel costs only its own
  row's precision; every operand in e4m3, output gradients included (a row's own scale leaves
  e5m2's range unused, and e4m3's extra mantissa bit halves the rounding), and every scale a
  power of two (rounded as ``power_of_2_scale`` says). The input and weight are quantized along
  other axes in backward than in forward, so backward quantizes them again from the bf16 input
  and weight it keeps (as torchao's rowwise recipe does).

For ``y = x W^T`` with ``x`` ``[M, K]``, ``W`` ``[N, K]`` and the output grad ``g`` ``[M, N]``:
forward ``x W^T``, input grad ``g W``, weight grad ``g^T x``; each right operand is handed to
``_scaled_mm`` column-major, as it requires.

Tensor parallelism: each rank quantizes the operands it holds and its GEMM's output is
dequantized on that rank, so results do not depend on other ranks' scales and no amax is
all-reduced. Scales agree across tp ranks where the quantized tensor itself is the same on
every rank: the input of a column-parallel linear (replicated, or all-gathered under sequence
parallelism) and the output grad of a row-parallel one (replicated, or all-gathered). The weight
shards, the input of a row-parallel linear and the output grad of a column-parallel one are
split over tp, and their scales are each rank's own, as if each shard were its own tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
MIN_AMAX = 1e-12  # an all-zero tensor gets scale 1e-12 / max: its fp8 copy is all zeros anyway
# Which GEMMs accumulate in Hopper's faster, less precise mode (torchao's float8 defaults): the
# forward's output, not the gradients (whose rounding training is more sensitive to).
FAST_ACCUM = {"forward": True, "input grad": False, "weight grad": False}


def quantize(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``t`` cast to the fp8 ``dtype`` after dividing by ``scale = amax /
    max_finite`` (fp32), so ``q * scale`` approximates ``t``. ``dim``: one scale per slice along
    it (keepdim; None: one for the whole tensor). ``power_of_2``: the scale rounded up to a power
    of two (``power_of_2_scale``). The bits of ``(t.float() / scale).clamp(-max, max)`` cast,
    in 13 bytes moved an element of bf16 ``t`` (rowwise: 9) instead of that form's 39."""
    top = torch.finfo(dtype).max
    amax = abs_max(t, dim).float().clamp(min=MIN_AMAX)
    if power_of_2:
        scale = power_of_2_scale(amax, top)
        return cast_by_power_of_2(t, scale, dtype), scale
    scale = amax / top
    # One scale of every dimension of t: bf16 / fp32 then divides in fp32, as the cast needs
    # (a 0-dim scale would leave the quotient in t's dtype).
    return torch.div(t, scale.expand((1,) * t.dim()) if dim is None else scale).to(dtype), scale


def abs_max(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``t.abs().amax(dim, keepdim=True)`` (all of ``t`` for None) in ``t``'s dtype, read once:
    the largest magnitude is one of ``t``'s values, so no precision is lost."""
    if dim is None:
        return torch.linalg.vector_norm(t, float("inf"))
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True)


def cast_by_power_of_2(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(t / scale).to(dtype)`` for a power-of-two ``scale`` (broadcast to ``t``), in ``t``'s
    own dtype where that is exact: bf16 and fp32 have fp32's exponent range, so multiplying by
    the power of two ``1 / scale`` only moves exponents, as the fp32 division does (a result
    too small for the format is below fp8's smallest step either way)."""
    if t.dtype not in (torch.bfloat16, torch.float32):
        return (t.float() / scale).to(dtype)
    return torch.mul(t, scale.reciprocal().to(t.dtype)).to(dtype)


def power_of_2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """torchao's rounding: the multiplier ``top / amax`` (computed in fp64, then fp32) rounded
    down to a power of two, as its inverse (fp32). Dividing by it only moves exponents, so the
    cast rounds each value once, and no value lands above ``top``."""
    multiplier = (top / amax.double()).float()
    return torch.exp2(-torch.floor(torch.log2(multiplier)))


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix with column-major strides (``_scaled_mm``'s right operand)."""
    return t.t().contiguous().t()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for fp8 ``a`` ``[M, K]`` and ``b`` ``[K, N]``; scales
    fp32, scalar or ``[M, 1]`` / ``[1, N]``. cuBLASLt takes ``a`` row-major and ``b``
    column-major only (CPU takes any layout; tests hold every call to CUDA's rule).
    ``fast_accum``: :data:`FAST_ACCUM` says which GEMMs take it."""
    # A no-op where it is row-major already; inductor may lay out a quantized transpose either way.
    a = a.contiguous()
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, recipe: str
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rowwise = recipe == "rowwise"
        x8, sx = quantize(x2, E4M3, -1 if rowwise else None, power_of_2=rowwise)
        w8, sw = quantize(weight, E4M3, -1 if rowwise else None, power_of_2=rowwise)
        out = scaled_mm(x8, w8.t(), sx, sw.t() if rowwise else sw, x.dtype, FAST_ACCUM["forward"])
        if rowwise:
            ctx.save_for_backward(x2, weight)
        else:  # the weight is the parameter itself: cast again in backward, to the same bits
            ctx.save_for_backward(x8, sx, weight)
        ctx.recipe, ctx.x_shape, ctx.dtypes = recipe, x.shape, (x.dtype, weight.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        g = grad.reshape(-1, grad.shape[-1])
        x_dtype, w_dtype = ctx.dtypes
        want_x, want_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        if ctx.recipe == "rowwise":
            x2, weight = ctx.saved_tensors
            if want_x:  # g [M, N] by rows, W [N, K] by columns (K: the output's columns)
                g8, sg = quantize(g, E4M3, -1, power_of_2=True)
                w8, sw = quantize(weight, E4M3, 0, power_of_2=True)
                grad_x = scaled_mm(g8, column_major(w8), sg, sw, x_dtype, FAST_ACCUM["input grad"])
            if want_w:  # g^T [N, M] by rows, x [M, K] by columns
                gt8, sgt = quantize(g.t(), E4M3, -1, power_of_2=True)
                xc8, sxc = quantize(x2, E4M3, 0, power_of_2=True)
                grad_w = scaled_mm(
                    gt8, column_major(xc8), sgt, sxc, w_dtype, FAST_ACCUM["weight grad"]
                )
        else:
            x8, sx, weight = ctx.saved_tensors
            g8, sg = quantize(g, E5M2)
            if want_x:
                w8, sw = quantize(weight, E4M3)
                grad_x = scaled_mm(g8, column_major(w8), sg, sw, x_dtype, FAST_ACCUM["input grad"])
            if want_w:
                gt8 = g8.t().contiguous()
                grad_w = scaled_mm(
                    gt8, column_major(x8), sg, sx, w_dtype, FAST_ACCUM["weight grad"]
                )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_w, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in fp8 (``recipe``: tensorwise | rowwise);
    the bias is added in the activations' dtype (the config checked the recipe's name)."""
    y = _Fp8Linear.apply(x, weight, recipe)
    return y if bias is None else y + bias
