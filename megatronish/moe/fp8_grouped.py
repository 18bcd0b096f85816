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

from megatronish.moe.grouped_mm import expert_offsets
from megatronish.tensor_parallel.fp8 import (
    E4M3,
    FAST_ACCUM,
    MIN_AMAX,
    abs_max,
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


# A custom op, so torch.compile captures the CPU stand-in whole, as it does CUDA's kernel (its
# fake is torch's meta kernel); dynamo would otherwise trace the loop over the host ends.
@torch.library.custom_op("megatronish::scaled_grouped_mm_reference", mutates_args=())
def _reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    ends: list[int],
    fast_accum: bool,
) -> torch.Tensor:
    _meta_kernel(a, b, scale_a, scale_b, offsets, out_dtype, fast_accum)  # CUDA's checks
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
                use_fast_accum=fast_accum,
            )
        elif end > start:
            out[start:end] = torch._scaled_mm(
                a[start:end],
                b[group],
                scale_a=scale_a[start:end, None],
                scale_b=scale_b[group, None],
                out_dtype=out_dtype,
                use_fast_accum=fast_accum,
            )
        start = end
    return out


def _meta_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """torch's meta kernel of ``torch._scaled_grouped_mm`` on the operands' shapes, strides and
    dtypes: CUDA's checks, and the output (on the meta device)."""
    args = (_on_meta(a), _on_meta(b), _on_meta(scale_a), _on_meta(scale_b))
    return torch._scaled_grouped_mm(
        *args, offs=_on_meta(offsets), out_dtype=out_dtype, use_fast_accum=fast_accum
    )


@_reference.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    ends: list[int],
    fast_accum: bool,
) -> torch.Tensor:
    out = _meta_kernel(a, b, scale_a, scale_b, offsets, out_dtype, fast_accum)
    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=a.device)


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    ends: Sequence[int] | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """Rows ``[offsets[e-1], offsets[e])`` of fp8 ``a [rows, k]`` times ``b[e] [k, n]``, scaled
    by ``scale_a [rows]`` and ``scale_b [experts, n]``: ``[rows, n]`` in ``out_dtype``. With a
    2-d ``b [rows, k]``: group ``e`` is columns ``[offsets[e-1], offsets[e])`` of ``a [n, rows]``
    times those rows of ``b``, scaled by ``scale_a [experts * n]`` and ``scale_b [experts * k]``
    (expert-major): ``[experts, n, k]``. ``ends``: ``offsets`` on the host, where known (the
    CPU stand-in reads them; a GPU never does). ``fast_accum``: as
    :data:`~megatronish.tensor_parallel.fp8.FAST_ACCUM` says for the GEMM."""
    if a.device.type == "cpu":
        ends = offsets.tolist() if ends is None else list(ends)
        return _reference(a, b, scale_a, scale_b, offsets, out_dtype, ends, fast_accum)
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offsets, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


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
    device (no host-to-device copy); ``counts`` (the same on the host) give only sizes. Padded,
    every group is whole blocks of :data:`ALIGN_ROWS` rows, so a group's amax is a segmented
    max over its blocks' (no atomics, no host read)."""

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
        group_of_row = torch.repeat_interleave(experts, sizes, output_size=sum(counts))
        self.destination = torch.arange(len(group_of_row), device=ends.device)
        self.destination += shifts[group_of_row]
        self.blocks = padded_sizes // ALIGN_ROWS  # each group's blocks, at least one
        self.group_of_block = torch.repeat_interleave(
            experts, self.blocks, output_size=self.rows // ALIGN_ROWS
        )
        self.offsets = padded_ends.to(torch.int32)

    def quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``t [rows, c]`` in e4m3 scaled per group and column (``scale [groups * c]``,
        expert-major), its groups padded: ``[padded rows, c]``, column-major (cast straight
        into the layouts the weight-grad GEMM takes: no transposing copy)."""
        c = t.shape[1]
        exact = t.dtype in (torch.bfloat16, torch.float32)  # see cast_by_power_of_2
        padded = t.new_zeros(self.rows, c, dtype=t.dtype if exact else torch.float32)
        blocks = padded.index_copy_(0, self.destination, t).view(-1, ALIGN_ROWS, c)
        block_amax = abs_max(blocks, 1).squeeze(1)  # [blocks, c]
        amax = torch.segment_reduce(block_amax, "max", lengths=self.blocks, axis=0, unsafe=True)
        scale = power_of_2_scale(amax.float().clamp(min=MIN_AMAX), torch.finfo(E4M3).max)
        # In place: zero padding stays +0.0; times a power of two, as cast_by_power_of_2 says.
        blocks.mul_(scale.reciprocal().to(padded.dtype)[self.group_of_block, None])
        q = torch.empty(c, self.rows, dtype=E4M3, device=t.device).t()
        return q.copy_(blocks.view(self.rows, c)), scale.flatten()


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
        # The GEMMs read fresh fp8 copies (row-major: the cast keeps x's layout), never x itself.
        x8, sx = quantize(x, E4M3, -1, power_of_2=True)  # per row, over k
        w8, sw = quantize(weight, E4M3, -1, power_of_2=True)  # per expert and output column
        ends = list(itertools.accumulate(counts))
        w8t, fast = w8.transpose(-2, -1), FAST_ACCUM["forward"]
        out = scaled_grouped_mm(
            x8.contiguous(), w8t, sx.squeeze(-1), sw.squeeze(-1), offsets, x.dtype, ends, fast
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
        grad_x = None
        if ctx.needs_input_grad[0]:
            g8, sg = quantize(grad, E4M3, -1, power_of_2=True)  # per row, over n
            w8, sw = quantize(weight, E4M3, 1, power_of_2=True)  # per expert and input column
            w8 = _column_major_stack(w8)
            grad_x = scaled_grouped_mm(
                g8.contiguous(),
                w8,
                sg.squeeze(-1),
                sw.squeeze(1),
                offsets,
                x.dtype,
                ctx.ends,
                FAST_ACCUM["input grad"],
            )
            del g8, w8  # not kept through the weight grad's temporaries
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None, None
        counts = ctx.counts

        def job() -> GradPairs:  # sums over each expert's tokens, in groups of 16
            groups = PaddedGroups(counts, offsets)
            g8, sg = groups.quantize(grad)
            a = g8.t()  # [n, padded rows], row-major
            b, sx = groups.quantize(x)
            fast = FAST_ACCUM["weight grad"]
            grad_w = scaled_grouped_mm(a, b, sg, sx, groups.offsets, x.dtype, groups.ends, fast)
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
