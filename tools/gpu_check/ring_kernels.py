"""Section 10: ring attention's block kernels on this device.

Ring attention (``parallel.cp_comm_type=ring``) runs attention a block of keys at a time with
the rows' log-sum-exp, and each block's backward with the merged output and log-sum-exp
(``megatronish/context_parallel/ring_kernel.py``). Its CUDA paths (the flash kernel for bf16,
the plain-matmul block for what flash does not take) are written against ATen's signatures but
run on no CPU: this section runs them. gpt_1b's attention shape (16 heads, 8 kv heads of 128), a
ring step of 2 x 2048 queries against 2 x 2048 keys, in the run's precision: the diagonal
block (causal), a full block, and a document-masked block, each forward and backward with the
kernel the device picks, against the same in fp32 plain matmuls; then a two-block merge against
attention over all keys. Errors must stay within bf16 round-off; times are medians.
"""

from __future__ import annotations

import time

import torch
from bench.common import median

from gpu_check.context import CheckContext
from gpu_check.report import SectionResult
from megatronish.context_parallel.ring_kernel import (
    block_attention,
    block_backward,
    block_kernel,
    math_block_attention,
    math_block_backward,
    merge_block,
    unseen_rows,
)
from megatronish.training.precision import DTYPES

NAME = "ring_kernels"
TITLE = "Ring attention's block kernels"
SHARE = 0.04
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def _inputs(ctx: CheckContext, dtype: torch.dtype):
    s, heads, kv, d = (64, 4, 2, 16) if ctx.smoke else (4096, 16, 8, 128)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    make = lambda n: torch.randn(1, n, s, d, device=ctx.device, generator=g).to(dtype)  # noqa: E731
    return make(heads), make(kv), make(kv)


def _document_mask(s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of 300 tokens (the last rows of each see nothing of the block's first keys)."""
    ids = torch.arange(s, device=device) // 300
    visible = (ids[:, None] == ids[None, :]) & (torch.arange(s, device=device)[None, :] < s // 2)
    mask = torch.zeros(1, 1, s, s, device=device).masked_fill(~visible, float("-inf"))
    return mask, visible.any(-1)[None, None]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _case(ctx, q, k, v, causal, mask, seen, dtype) -> list[str]:
    def forward():
        block = block_attention(q, k, v, causal, mask)
        return block if mask is None else unseen_rows(block, seen)

    block = forward()
    ref = math_block_attention(q.float(), k.float(), v.float(), causal, mask)
    if mask is not None:
        ref = unseen_rows(ref, seen)
    dout = torch.randn_like(q)
    got = block_backward(dout, q, k, v, block.out, block.lse, causal, block.extra, mask)
    want = math_block_backward(
        dout.float(), q.float(), k.float(), v.float(), ref.out, ref.lse, causal, mask
    )
    errors = [_relative(block.out, ref.out)] + [_relative(a, b) for a, b in zip(got, want)]
    times = []
    for _ in range(5 if not ctx.smoke else 2):
        ctx.sync()
        t0 = time.perf_counter()
        b = forward()
        block_backward(dout, q, k, v, b.out, b.lse, causal, b.extra, mask)
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return [*(f"{e:.1e}" for e in errors), f"{median(times) * 1e3:.2f}"], max(errors)


def run(ctx: CheckContext, out: SectionResult) -> None:
    dtype = DTYPES[ctx.precision]
    q, k, v = _inputs(ctx, dtype)
    s = q.shape[2]
    out.note(
        f"{q.shape[1]} heads / {k.shape[1]} kv heads of {q.shape[-1]}, blocks of {s} queries x "
        f"{s} keys, {ctx.precision}; kernel: "
        f"{block_kernel(ctx.device.type, dtype, q.shape[-1])} (unmasked), "
        f"{block_kernel(ctx.device.type, dtype, q.shape[-1], True)} (masked)"
    )
    mask, seen = _document_mask(s, ctx.device)
    rows, worst = [], 0.0
    for name, causal, m in (("diagonal (causal)", True, None), ("full", False, None)) + (
        ("documents (masked)", False, mask),
    ):
        row, err = _case(ctx, q, k, v, causal, m, seen, dtype)
        rows.append([name, *row])
        worst = max(worst, err)
    out.table(
        "Block kernel against fp32 matmuls: relative error (norm) and forward + backward time",
        ["block", "out", "dq", "dk", "dv", "ms"],
        rows,
    )
    half = s // 2
    merged_out = lse = None
    for lo, hi in ((0, half), (half, s)):
        part = block_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], False)
        merged_out, lse = merge_block(merged_out, lse, part)
    whole = math_block_attention(q.float(), k.float(), v.float(), False)
    merge_error = _relative(merged_out, whole.out)
    out.note(f"two blocks merged by log-sum-exp against all keys at once: {merge_error:.1e}")
    worst = max(worst, merge_error)
    bound = TOLERANCE.get(dtype, 3e-2)
    if worst > bound:
        out.fail(f"a block kernel is off by {worst:.1e} (relative), above {bound:.0e}")
    else:
        out.note(f"every block within {bound:.0e} of fp32 matmuls (worst {worst:.1e})")
