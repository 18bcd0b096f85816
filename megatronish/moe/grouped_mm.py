"""Rows grouped by expert times a stack of expert weights, with a backward whose work and memory
do not grow with the number of experts beyond the weights' own grads.

One ``torch._grouped_mm`` where this torch has it for the device, dtype and shapes
(:func:`grouped_mm_supported`), else :class:`ExpertLoop`: one matmul per expert, written into
one output, and in backward into one input grad and one stack grad. Never autograd through a
slice or an index per expert: the backward of each ``rows[a:b]`` or ``weight[e]`` allocates zeros
the size of the whole input or the whole stack, and a split + unbind still makes every expert's
weight grad twice (its matmul, then the stack).

Where ``torch._grouped_mm`` runs (checked against torch's sources and issues, 2026-12): absent
before torch 2.8; in 2.8 on CUDA only, bf16 on compute capability 9.x only; from 2.9 also on CPU
(2.9-2.12 want 16-byte aligned data pointers) and on CUDA >= 8.0 in fp32, fp16 and bf16; not on
ROCm (it raises). Every operand's rows must be 16-byte multiples (hidden and ffn sizes divisible
by 4 in fp32, 8 in bf16) and its fp32 backward rejects an expanded (stride-0) incoming gradient,
so we hand it a contiguous one. On CUDA only bf16 on compute capability 9.x or 10.x is one
grouped kernel (CUTLASS); elsewhere it loops over the groups after copying the offsets to the
host, a device sync per call that :class:`ExpertLoop` (host counts) avoids: we use it there
only. Blackwell (10.x) gives a nonzero weight grad to a group without rows (pytorch#172439,
open): an empty expert takes the loop there. On CPU it is a loop like ours; we use it wherever
it exists, so CPU tests run torch's op and the two grouped calls of its backward. No grouped
call is made with no rows at all (grouped GEMM kernels have crashed or hung on it).

Split backward (zero-bubble schedules): both are autograd functions whose backward computes the
rows' grad and hands the stack's to a store (:mod:`megatronish.tensor_parallel.weight_grad`),
which runs it at once or in the schedule's W.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

ALIGN_BYTES = 16


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch's)."""
    major, minor = re.match(r"(\d+)\.(\d+)", version or torch.__version__).groups()
    return int(major), int(minor)


TORCH_VERSION = torch_version()


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0


def use_grouped_mm(
    device_type: str,
    dtype: torch.dtype,
    version: tuple[int, int],
    capability: tuple[int, int] | None = None,
    rocm: bool = False,
) -> bool:
    """Whether we hand matmuls in ``dtype`` on ``device_type`` to torch ``version``'s
    ``torch._grouped_mm`` (see the module's docstring); ``capability``: the CUDA device's."""
    if version < (2, 8) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if device_type == "cpu":
        return version >= (2, 9)
    if device_type != "cuda" or rocm or capability is None or dtype != torch.bfloat16:
        return False
    return capability[0] == 9 or (capability[0] == 10 and version >= (2, 9))


@lru_cache(maxsize=16)
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability (None elsewhere)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int]) -> bool:
    """Whether ``x [rows, k]`` times ``weight [experts, n, k]`` in groups of ``counts`` rows is
    one ``torch._grouped_mm`` here (see the module's docstring for the rules)."""
    if x.dtype != weight.dtype or x.device != weight.device or x.shape[0] == 0:
        return False
    capability = device_capability(x.device)
    here = use_grouped_mm(
        x.device.type, x.dtype, TORCH_VERSION, capability, rocm=torch.version.hip is not None
    )
    if not here or not hasattr(torch, "_grouped_mm"):
        return False
    row_bytes = [size * x.element_size() for size in weight.shape[1:]]  # n and k
    if any(b % ALIGN_BYTES for b in row_bytes) or not _aligned(weight):
        return False
    blackwell = capability is not None and capability[0] == 10
    return not (blackwell and 0 in counts)


def expert_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """``torch._grouped_mm``'s ``offs``: the end row of each expert's group (int32)."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where it is not contiguous and 16-byte aligned."""
    return t if _aligned(t) else t.clone(memory_format=torch.contiguous_format)


class ExpertLoop(torch.autograd.Function):
    """``x [rows, k]`` in groups of ``counts`` rows times ``weight [experts, n, k]`` (each
    group by its expert's transpose) as one ``torch.mm`` per expert, into one ``[rows, n]``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        counts: tuple[int, ...],
        store: WeightGradStore | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.weight, ctx.store = counts, weight, store
        out = x.new_empty(x.shape[0], weight.shape[1])
        for part, w, o in zip(x.split(counts), weight.unbind(0), out.split(counts), strict=True):
            torch.mm(part, w.t(), out=o)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        counts, grads, param = ctx.counts, grad.split(ctx.counts), ctx.weight
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = x.new_empty(x.shape)
            for g, w, o in zip(grads, weight.unbind(0), grad_x.split(counts), strict=True):
                torch.mm(g, w, out=o)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None

        def job() -> GradPairs:
            grad_w = weight.new_empty(weight.shape)
            for n, g, part, o in zip(counts, grads, x.split(counts), grad_w.unbind(0)):
                if n:
                    torch.mm(g.t(), part, out=o)
                else:  # an expert without rows: its grad is zero, whatever mm does with k=0
                    o.zero_()
            return [(param, grad_w)]

        return grad_x, grad_of(weight_grads(ctx.store, job), param), None, None


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)`` with the two grouped
    matmuls of torch's backward for it, the stack's through a store."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        offsets: torch.Tensor,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        x = contiguous_aligned(x)
        ctx.save_for_backward(x, weight, offsets)
        ctx.weight, ctx.store = weight, store
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, offsets = ctx.saved_tensors
        param = ctx.weight
        grad = contiguous_aligned(grad)  # its fp32 backward rejects an expanded grad
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offsets)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None

        def job() -> GradPairs:
            return [(param, torch._grouped_mm(grad.t(), x, offs=offsets))]

        return grad_x, grad_of(weight_grads(ctx.store, job), param), None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int],
    offsets: torch.Tensor | None = None,
    grouped: bool | None = None,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """``x [rows, k]`` grouped by expert (``counts`` rows each, in expert order) through
    ``weight [experts, n, k]``: ``[rows, n]``, group ``e`` being ``F.linear(rows_e, weight[e])``.

    ``offsets``: the int32 end rows on ``x``'s device (else built from ``counts``: a host to
    device copy on GPUs). ``grouped``: use (True, unless there are no rows) or never use
    (False) ``torch._grouped_mm``; None: where :func:`grouped_mm_supported`. ``store``: where
    the stack's grad goes.
    """
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"{x.shape[0]} rows do not split into {list(counts)} for {weight.shape[0]} experts"
        )
    if grouped is None:
        grouped = grouped_mm_supported(x, weight, counts)
    if not grouped or x.shape[0] == 0:
        return ExpertLoop.apply(x, weight, tuple(counts), store)
    if offsets is None:
        offsets = expert_offsets(counts, x.device)
    if store is not None and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedMM.apply(x, weight, offsets, store)
    out = torch._grouped_mm(contiguous_aligned(x), weight.transpose(1, 2), offs=offsets)
    if out.requires_grad:  # torch's backward for it; its fp32 kernel rejects an expanded grad
        out.register_hook(contiguous_aligned)
    return out
