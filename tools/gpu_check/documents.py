"""Section 9: attention within packed documents, and a training step with document masks.

One attention core of gpt_1b's shape (16 heads, 8 kv heads of 128, one sequence of 8192 tokens
in documents of 3 to 3000 tokens), in the run's precision, forward + backward by each candidate:
megatronish's FlexAttention path (compiled, a block mask per microbatch), torch's varlen
attention (``torch.nn.attention.varlen``, an optional row: where this torch has it, called as
its signature allows, see :func:`varlen_call`), SDPA with the document mask as a tensor, and
unmasked causal SDPA as the bound. The FlexAttention output and query grad must
equal each document attended alone (flash SDPA per document) to bf16 round-off. Then one step of
the two-layer model with ``data.reset_attention_mask``, ``reset_position_ids`` and
``eod_mask_loss`` must give a finite loss. On the CPU (``--smoke``): toy sizes, megatronish's CPU
path (segments) against the mask and causal SDPA (torch's varlen attention has no CPU kernel:
its row is left out with the error, as anywhere it cannot run).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from bench.common import interleaved, median

from gpu_check.context import CheckContext
from gpu_check.optional import runnable
from gpu_check.report import SectionResult
from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.document_attention import (
    document_attention,
    document_mask,
)
from megatronish.context_parallel.documents import Documents
from megatronish.data.documents import attention_segments
from megatronish.training.precision import DTYPES

NAME = "documents"
TITLE = "Packed documents: attention within documents"
SHARE = 0.05
OPTIONAL = ("varlen",)  # rows that are left out, never fail the section, where they cannot run
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
PACKED = [
    "data.reset_attention_mask=true",
    "data.reset_position_ids=true",
    "data.eod_mask_loss=true",
]


def document_lengths(total: int, median_length: int, seed: int = 0) -> list[int]:
    """Lengths summing to ``total``: log-normal around ``median_length``, 3 to 3000."""
    rng = np.random.default_rng(seed)
    lengths, left = [], total
    while left > 0:
        n = int(np.clip(rng.lognormal(math.log(median_length), 1.2), 3, 3000))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


class Core:
    """q, k, v leaves of one attention core and the documents of its one sequence."""

    def __init__(self, ctx: CheckContext):
        s, self.heads, self.kv, d = (256, 4, 2, 32) if ctx.smoke else (8192, 16, 8, 128)
        self.dtype = DTYPES[ctx.precision]
        gen = torch.Generator(ctx.device).manual_seed(0)

        def leaf(heads: int) -> torch.Tensor:
            x = torch.randn(1, heads, s, d, device=ctx.device, generator=gen, dtype=self.dtype)
            return x.requires_grad_()

        self.q, self.k, self.v = leaf(self.heads), leaf(self.kv), leaf(self.kv)
        self.lengths = document_lengths(s, 24 if ctx.smoke else 400)
        ids = np.repeat(np.arange(len(self.lengths)), self.lengths)
        self.ids = torch.from_numpy(ids)[None].to(ctx.device)
        self.cu = torch.tensor(np.cumsum([0, *self.lengths]), device=ctx.device)
        self.segments = (
            attention_segments(np.array([*self.lengths[:-1], self.lengths[-1] + 1]), s),
        )
        self.cp = CPContext(seq_length=s)
        self.upstream = torch.randn_like(self.q)
        self.ctx = ctx

    def backward(self, out: torch.Tensor) -> None:
        for t in (self.q, self.k, self.v):
            t.grad = None
        out.backward(self.upstream)
        self.ctx.sync()

    def ours(self) -> torch.Tensor:
        docs = Documents(ids=self.ids, segments=self.segments)  # a new microbatch
        return document_attention(self.q, self.k, self.v, docs, self.cp, 0.0)

    def per_document(self) -> torch.Tensor:
        outs = []
        for a, b in zip(self.cu[:-1].tolist(), self.cu[1:].tolist()):
            outs.append(
                F.scaled_dot_product_attention(
                    self.q[:, :, a:b],
                    self.k[:, :, a:b],
                    self.v[:, :, a:b],
                    is_causal=True,
                    enable_gqa=True,
                )
            )
        return torch.cat(outs, dim=2)

    def masked(self) -> torch.Tensor:
        pos = torch.arange(self.ids.shape[1], device=self.ids.device)
        mask = document_mask(self.ids, self.ids, pos, self.dtype)
        return F.scaled_dot_product_attention(
            self.q, self.k, self.v, attn_mask=mask, enable_gqa=True
        )

    def causal(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            self.q, self.k, self.v, is_causal=True, enable_gqa=True
        )

    def varlen(self, varlen_attn: Callable | None = None) -> Callable[[], torch.Tensor] | None:
        """torch's varlen attention over the documents (``varlen_attn``: this torch's), or None
        where this torch lacks it or :func:`varlen_call` cannot call it causally."""
        if varlen_attn is None:
            try:
                from torch.nn.attention.varlen import varlen_attn
            except ImportError:
                return None
        call = varlen_call(varlen_attn)
        if call is None:
            return None
        cu = self.cu.to(torch.int32)
        longest = max(self.lengths)

        def run() -> torch.Tensor:
            q, k, v = (t[0].transpose(0, 1) for t in (self.q, self.k, self.v))  # [T, H, D]
            return call(q, k, v, cu, longest).transpose(0, 1)[None]

        return run


def varlen_call(varlen_attn: Callable) -> Callable | None:
    """``call(q, k, v, cu_seqlens, max_len)``: causal ``varlen_attn`` of ``[T, heads, D]``
    queries and ``[T, kv_heads, D]`` keys and values in the documents ``cu_seqlens`` delimits,
    in the form its signature takes (torch 2.10: ``is_causal``; 2.11: ``window_size``; 2.12 on:
    ``enable_gqa``, else K/V expanded to the query heads as SDPA's ``enable_gqa`` pairs them);
    None when it has no causal form."""
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    gqa = "enable_gqa" in params

    def call(q, k, v, cu: torch.Tensor, longest: int) -> torch.Tensor:
        if gqa:
            return varlen_attn(q, k, v, cu, cu, longest, longest, **causal, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, longest, longest, **causal)

    return call


def run(ctx: CheckContext, out: SectionResult) -> None:
    core = Core(ctx)
    s = core.ids.shape[1]
    pairs = sum(n * n for n in core.lengths)
    out.note(
        f"{core.heads} heads / {core.kv} kv heads, one sequence of {s} tokens in "
        f"{len(core.lengths)} documents (sum of squared lengths {pairs / s**2:.1%} of s^2), "
        f"{ctx.precision}"
    )
    want = core.per_document()
    core.backward(want)
    want_grad = core.q.grad.clone()
    got = core.ours()
    core.backward(got)
    err = (got - want).abs().max().item()
    grad_err = (core.q.grad - want_grad).abs().max().item() / want_grad.abs().max().item()
    out.note(
        f"megatronish vs each document alone: output {err:.2e}, query grad {grad_err:.2e} (rel)"
    )
    variants = {"megatronish": core.ours, "SDPA with the mask": core.masked, "causal": core.causal}
    if (varlen := core.varlen()) is not None:  # on a CPU too: left out there (flash only)
        variants["varlen"] = varlen
    else:
        out.note("no varlen row: torch.nn.attention.varlen.varlen_attn is not in this torch")
    steps = {n: (lambda f=f: core.backward(f())) for n, f in variants.items()}
    steps = runnable(out, steps, OPTIONAL)
    times = interleaved(
        steps,
        ctx.max_repeats,
        ctx.steps_per_repeat,
        warmup=ctx.warmup,
        sync=ctx.sync,
        budget_s=ctx.share(SHARE),
        min_repeats=2,
    )
    if "varlen" in times:  # compared, never failed on: torch's kernel, not ours
        err_varlen = (variants["varlen"]() - want).abs().max().item()
        out.note(f"varlen vs each document alone: output {err_varlen:.2e}")
    base = median(times["causal"])
    rows = [[n, f"{median(t) * 1e3:.2f}", f"{median(t) / base:.2f}"] for n, t in times.items()]
    out.table(
        "Forward + backward of one attention core (ms, median)", ["path", "ms", "/ causal"], rows
    )
    built = ctx.build([*ctx.small(), *PACKED])
    loss = ctx.step(built).loss
    out.note(f"a training step with packed documents: loss {loss:.4f}")
    if err > TOLERANCE[core.dtype] or grad_err > TOLERANCE[core.dtype]:
        out.fail(f"document attention differs from each document alone by {max(err, grad_err):.2e}")
    elif not math.isfinite(loss):
        out.fail(f"the packed-document training step's loss is {loss}")
