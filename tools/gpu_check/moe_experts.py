"""Section 7: one mixture-of-experts layer's forward and backward at 8 and at 64 local experts.

The MoE layer of ``configs/model/moe_1b_7b.yaml`` (OLMoE's shape: hidden 2048, expert ffn 1024,
top-8 routing, SwiGLU experts) alone on the device (ep = 1), in the run's precision, built with 8
and with 64 experts and fed the same tokens (one sequence of 4096). Their forward + backward is
timed interleaved after warm-up; then one more each measures the peak memory above the layer's
weights, input and incoming gradient (``torch.cuda.max_memory_allocated``). Less the grads it
makes (weights and input), that is the backward's working memory, which must not grow with the
number of experts: the experts' backward makes no per-expert tensor the size of the input or of
a weight stack (``megatronish/moe/grouped_mm.py``). Fails when it grows by more than
``GROWTH_LIMIT``. In bf16 on a GPU with fp8 grouped GEMMs a third row times the 8 experts with
``trainer.fp8``'s expert GEMMs (``megatronish/moe/fp8_grouped.py``), its working memory included
(the weight grad's padded fp8 copies). On the CPU (``--smoke``): toy sizes, times only.
"""

from __future__ import annotations

import torch
from bench.common import interleaved, median

from gpu_check.context import CheckContext
from gpu_check.optional import optional, runnable
from gpu_check.report import SectionResult
from megatronish.config.compose import load_config
from megatronish.model.blocks import moe_layer
from megatronish.model.parallel_context import ParallelContext
from megatronish.moe.experts import GroupedExperts
from megatronish.moe.grouped_mm import grouped_mm_supported
from megatronish.spec import ModelSpec
from megatronish.training.precision import DTYPES

NAME = "moe_experts"
TITLE = "MoE layer at 8 and 64 local experts"
SHARE = 0.05
EXPERTS = (8, 64)
GROWTH_LIMIT = 1.5  # working memory at 64 experts / at 8
MiB = 2**20
FULL = ["+experiment=moe_1b_7b", "model.vocab_size=32000"]
TOY = [
    "+experiment=moe_1b_7b",
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=172",
    "model.moe.ffn_hidden_size=32",
    "model.moe.top_k=2",
    "model.seq_length=64",
]


class LayerRun:
    """One MoE layer with its input and incoming gradient; ``step()`` is a forward + backward."""

    def __init__(self, ctx: CheckContext, experts: int, fp8: bool = False):
        cfg = load_config([*(TOY if ctx.smoke else FULL), f"model.moe.num_experts={experts}"])
        self.spec = ModelSpec.from_config(cfg.model, cfg.model.vocab_size)
        dtype, h = DTYPES[ctx.precision], self.spec.hidden_size
        gen = torch.Generator(ctx.device).manual_seed(experts)
        self.layer = moe_layer(self.spec, ParallelContext(), ctx.device).to(dtype)
        self.layer.experts.fp8 = "rowwise" if fp8 else None
        self.experts = experts
        with torch.no_grad():
            for p in self.layer.parameters():
                p.normal_(0.0, self.spec.init_std, generator=gen)
        batch = 2 if ctx.smoke else 1
        shape = (self.spec.seq_length, batch, h)
        self.x = torch.randn(shape, device=ctx.device, dtype=dtype, generator=gen)
        self.x.requires_grad_()
        self.upstream = torch.randn(shape, device=ctx.device, dtype=dtype, generator=gen)
        self.ctx = ctx

    @property
    def tokens(self) -> int:
        return self.x.shape[0] * self.x.shape[1]

    def grouped(self) -> bool:
        rows = self.x.detach().reshape(-1, self.spec.hidden_size)
        counts = [rows.shape[0] // self.spec.moe.num_experts] * self.spec.moe.num_experts
        return grouped_mm_supported(rows, self.layer.experts.fc1, counts)

    def step(self) -> None:
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None
        self.layer(self.x).backward(self.upstream)
        self.ctx.sync()

    def grad_bytes(self) -> int:
        grads = [p.grad for p in self.layer.parameters()] + [self.x.grad]
        return sum(g.numel() * g.element_size() for g in grads if g is not None)

    def peak_above_states(self) -> int | None:
        """Peak bytes of one step above what existed before it (None off CUDA)."""
        if not self.ctx.cuda:
            return None
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None
        self.ctx.sync()
        torch.cuda.reset_peak_memory_stats(self.ctx.device)
        before = torch.cuda.memory_allocated(self.ctx.device)
        self.step()
        return torch.cuda.max_memory_allocated(self.ctx.device) - before


def mib(n: int | None) -> str:
    if n is None:
        return "n/a (CPU)"
    return f"{n / MiB:,.0f}" if n >= 100 * MiB else f"{n / MiB:.3g}"


def run(ctx: CheckContext, out: SectionResult) -> None:
    runs = {str(e): LayerRun(ctx, e) for e in EXPERTS}
    few, many = EXPERTS
    optional_rows = [f"{few} fp8"]  # left out, never failed on, where it cannot run
    if ctx.precision == "bf16" and GroupedExperts.fp8_here(ctx.device):
        fp8 = optional(out, optional_rows[0], lambda: LayerRun(ctx, few, fp8=True))
        if fp8 is not None:
            runs[optional_rows[0]] = fp8
    first = runs[str(few)]
    s, m = first.spec, first.spec.moe
    out.note(
        f"hidden {s.hidden_size}, expert ffn {m.ffn_hidden_size}, top-{m.top_k}, "
        f"{first.tokens} tokens ({first.tokens * m.top_k} routed rows), {ctx.precision}, "
        f"ep = 1"
    )
    budget = ctx.share(SHARE)
    steps = runnable(out, {name: r.step for name, r in runs.items()}, optional_rows)
    runs = {name: r for name, r in runs.items() if name in steps}
    times = interleaved(
        steps,
        ctx.max_repeats,
        ctx.steps_per_repeat,
        warmup=ctx.warmup,
        sync=ctx.sync,
        budget_s=budget,
        min_repeats=2,
    )
    rows, working = [], {}
    for name, r in runs.items():
        peak = r.peak_above_states()
        grads = r.grad_bytes()
        working[name] = None if peak is None else peak - grads
        rows.append(
            [
                name,
                f"{r.tokens * m.top_k // r.experts:,}",
                "fp8" if r.layer.experts.fp8 else "yes" if r.grouped() else "no",
                f"{median(times[name]) * 1e3:.2f}",
                mib(peak),
                mib(grads),
                mib(working[name]),
            ]
        )
    out.table(
        "Forward + backward of one layer (median of the timed repeats)",
        [
            "experts",
            "rows per expert",
            "grouped matmul",
            "ms",
            "peak MiB above the states",
            "grads MiB",
            "working MiB (peak - grads)",
        ],
        rows,
    )
    few, many = str(few), str(many)
    out.note(f"time at {many} experts / at {few}: {median(times[many]) / median(times[few]):.2f}x")
    if f"{few} fp8" in times:
        ratio = median(times[f"{few} fp8"]) / median(times[few])
        out.note(f"time with fp8 expert GEMMs / bf16 at {few} experts: {ratio:.2f}x")
    if working[few] is None:
        out.note("peak memory is measured on CUDA only")
        return
    growth = working[many] / max(working[few], 1)
    out.note(f"working memory at {many} experts / at {few}: {growth:.2f}x")
    if growth > GROWTH_LIMIT:
        out.fail(
            f"the backward's working memory grows with the experts: {growth:.2f}x "
            f"(limit {GROWTH_LIMIT}x)"
        )
