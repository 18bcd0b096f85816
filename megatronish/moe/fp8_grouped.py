"""The experts' grouped GEMMs in fp8 (``trainer.fp8`` in MoE blocks), through
``torch._scaled_grouped_mm``.

Recipe, under both ``trainer.fp8`` recipes, all three GEMMs in float8 e4m3 with current scaling
as in :mod:`megatronish.tensor_parallel.fp8`, every scale a power of two, scaled along the
dimensions that are not summed (torchao's MoE recipe): the forward ``x W_e^T`` by token row and
by each expert's output column, the input grad ``g W_e`` by token row and by each expert's input
column, the weight grad ``g_e^T x_e`` by each expert's columns of ``g`` and of ``x`` over that
expert's tokens. Why, from ``torch._scaled_grouped_mm``'s CUDA contract (torch 2.11-2.13): e4m3
operands only (so output grads are e4m3 here, not e5m2) and rowwise scales only (so tensorwise
is rowwise here). The
weight grad sums over tokens, and its kernel asserts on the device that every group but the last
is a multiple of 16 tokens: backward copies each expert's tokens into groups padded with zero
rows to a multiple of 16 (at least 16, so no group is empty), placed on the device from the
offsets there (no host read, no host-to-device copy). The experts keep their bf16 inputs (each
GEMM quantizes along its own axes), as bf16 experts do.

Where: CUDA compute capability 9.x (the kernel is CUTLASS's SM90 rowwise one). On CPU torch has
no kernel: :func:`scaled_grouped_mm` first runs torch's meta kernel on the same shapes, strides
and dtypes (it checks CUDA's contract: e4m3, ``a`` row-major, ``b`` column-major, fp32 scales
of ``[rows]`` and ``[experts, n]``, bf16 out), then one ``torch._scaled_mm`` per expert, so
CPU tests run the operands a GPU would get. Elsewhere the experts stay bf16
(:func:`fp8_experts_supported`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch._compile import _disable_dynamo

from megatronish.moe.grouped_mm import contiguous_aligned, expert_offsets
from megatronish.tensor_parallel.fp8 import (
    E4M3,
    MIN_AMAX,
    column_major,
    power_of_2_scale,
    quantize,
)
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


ALIGN_ROWS = 16  # the fp8 weight-grad kernel's groups: 16-byte multiples of 1-byte elements
T = TypeVar("T", int, torch.Tensor)


@_disable_dynamo  # torch.compiler.disable, importing dynamo only when called
def _reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    ends: list[int],
) -> torch.Tensor:
    args = (_on_meta(a), _on_meta(b), _on_meta(scale_a), _on_meta(scale_b))
    torch._scaled_grouped_mm(*args, offs=_on_meta(offsets), out_dtype=out_dtype)  # CUDA's checks
    summed = b.dim() == 2  # 2d x 2d: the groups split the summed dimension
    if summed and any((e - s) % ALIGN_ROWS for s, e in zip([0, *ends[:-2]], ends[:-1])):
        raise RuntimeError(  # CUDA's kernel asserts this on the device
            f"expected every group but the last to be a multiple of {ALIGN_ROWS} rows: {ends}"
        )
    if summed:
        n, k = a.shape[0], b.shape[1]
        out = a.new_empty(len(ends), n, k, dtype=out_dtype)
    else:
        out = a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype)
    start = 0
    for group, end in enumerate(ends):
        if summed:  # the group's columns of a and rows of b, in the layouts cuBLASLt takes
            out[group] = torch._scaled_mm(
                a[:, start:end].contiguous(),
                column_major(b[start:end]),
                scale_a=scale_a[group * n : (group + 1) * n, None],
                scale_b=scale_b[None, group * k : (group + 1) * k],
                out_dtype=out_dtype,
            )
        elif end > start:
            out[start:end] = torch._scaled_mm(
                a[start:end],
                b[group],
                scale_a=scale_a[start:end, None],
                scale_b=scale_b[group, None],
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
    ends: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rows ``[offsets[e-1], offsets[e])`` of fp8 ``a [rows, k]`` times ``b[e] [k, n]``, scaled
    by ``scale_a [rows]`` and ``scale_b [experts, n]``: ``[rows, n]`` in ``out_dtype``. With a
    2-d ``b [rows, k]``: group ``e`` is columns ``[offsets[e-1], offsets[e])`` of ``a [n, rows]``
    times those rows of ``b``, scaled by ``scale_a [experts * n]`` and ``scale_b [experts * k]``
    (expert-major): ``[experts, n, k]``. ``ends``: ``offsets`` on the host, where known (the
    CPU stand-in reads them; a GPU never does)."""
    if a.device.type == "cpu":
        ends = offsets.tolist() if ends is None else list(ends)
        return _reference(a, b, scale_a, scale_b, offsets, out_dtype, ends)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=out_dtype)


def _column_major_stack(t: torch.Tensor) -> torch.Tensor:
    """Each matrix of the stack ``t`` with column-major strides."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def padded_size(size: T) -> T:
    """``size`` rows (an int, or a tensor of sizes) padded to a multiple of :data:`ALIGN_ROWS`,
    at least that many."""
    up = (size + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    return up.clamp(min=ALIGN_ROWS) if isinstance(up, torch.Tensor) else max(up, ALIGN_ROWS)


class PaddedGroups:
    """Where the rows of a matrix grouped by expert go when every group is padded with zero
    rows (:func:`padded_size`): from the groups' end rows on the device (``offsets``), on the
    device (no host-to-device copy); ``counts`` (the same on the host) give only sizes."""

    def __init__(self, counts: Sequence[int], offsets: torch.Tensor):
        padded = [padded_size(c) for c in counts]
        self.groups, self.rows = len(counts), sum(padded)
        self.ends = list(itertools.accumulate(padded))  # on the host, for the CPU stand-in
        ends = offsets.long()
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        padded_sizes = padded_size(sizes)
        padded_ends = padded_sizes.cumsum(0)
        shifts = padded_ends - padded_sizes - (ends - sizes)  # padded start - start, per group
        experts = torch.arange(self.groups, device=ends.device)
        self.group_of_row = torch.repeat_interleave(experts, sizes, output_size=sum(counts))
        self.destination = torch.arange(len(self.group_of_row), device=ends.device)
        self.destination += shifts[self.group_of_row]
        self.offsets = padded_ends.to(torch.int32)

    def quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``t [rows, c]`` in e4m3 scaled per group and column (``scale [groups * c]``,
        expert-major), its groups padded: ``[padded rows, c]``."""
        top = torch.finfo(E4M3).max
        t32 = t.float()
        index = self.group_of_row[:, None].expand_as(t32)
        amax = t32.new_zeros(self.groups, t.shape[1]).scatter_reduce_(0, index, t32.abs(), "amax")
        scale = power_of_2_scale(amax.clamp(min=MIN_AMAX), top)
        q = (t32 / scale[self.group_of_row]).clamp(-top, top).to(E4M3)
        padded = torch.zeros(self.rows, t.shape[1], dtype=torch.uint8, device=t.device)
        padded.index_copy_(0, self.destination, q.view(torch.uint8))  # zero bytes are +0.0
        return padded.view(E4M3), scale.flatten()


class Fp8GroupedLinear(torch.autograd.Function):
    """``x [rows, k]`` grouped by ``offsets`` (``counts`` rows each) times ``weight [experts, n,
    k]`` (each group by its expert's transpose), its three GEMMs in fp8; the stack's grad goes
    through a store."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        counts: tuple[int, ...],
        offsets: torch.Tensor,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        x = contiguous_aligned(x)
        x8, sx = quantize(x, E4M3, -1, power_of_2=True)  # per row, over k
        w8, sw = quantize(weight, E4M3, -1, power_of_2=True)  # per expert and output column
        ends = list(itertools.accumulate(counts))
        out = scaled_grouped_mm(
            x8, w8.transpose(-2, -1), sx.squeeze(-1), sw.squeeze(-1), offsets, x.dtype, ends
        )
        ctx.save_for_backward(x, weight, offsets)
        ctx.weight, ctx.store, ctx.counts, ctx.ends = weight, store, counts, ends
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight, offsets = ctx.saved_tensors
        param = ctx.weight
        grad = contiguous_aligned(grad)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g8, sg = quantize(grad, E4M3, -1, power_of_2=True)  # per row, over n
            w8, sw = quantize(weight, E4M3, 1, power_of_2=True)  # per expert and input column
            w8 = _column_major_stack(w8)
            grad_x = scaled_grouped_mm(
                g8, w8, sg.squeeze(-1), sw.squeeze(1), offsets, x.dtype, ctx.ends
            )
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None, None
        counts = ctx.counts

        def job() -> GradPairs:  # sums over each expert's tokens, in groups of 16
            groups = PaddedGroups(counts, offsets)
            g8, sg = groups.quantize(grad)
            x8, sx = groups.quantize(x)
            a = g8.t().contiguous()  # [n, padded rows], row-major
            b = column_major(x8)
            grad_w = scaled_grouped_mm(a, b, sg, sx, groups.offsets, x.dtype, groups.ends)
            return [(param, grad_w)]

        return grad_x, grad_of(weight_grads(ctx.store, job), param), None, None, None


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int],
    offsets: torch.Tensor | None = None,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """:func:`~megatronish.moe.grouped_mm.grouped_linear` with its three GEMMs in fp8
    (``counts``: each expert's rows, host ints, at least one row in all; ``offsets``: their
    int32 end rows on ``x``'s device, else built from ``counts``)."""
    if offsets is None:
        offsets = expert_offsets(counts, x.device)
    return Fp8GroupedLinear.apply(x, weight, tuple(counts), offsets, store)
