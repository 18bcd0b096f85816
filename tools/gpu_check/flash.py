"""Section 2: the model's attention runs SDPA's flash kernel.

Two looks at a two-layer model of the shape: the attention ops and kernels ``torch.profiler``
records in one ordinary training step (a flash op must be among them), and one step with SDPA
restricted to the flash backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``), which raises when
flash cannot run these inputs; torch's warnings then say why. On a CPU SDPA has no CUDA flash
kernel: the section reports what ran and "not applicable".
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from gpu_check.context import CheckContext
from gpu_check.report import SectionResult

NAME = "flash"
TITLE = "Attention kernel: flash SDPA"
SHARE = 0.05
ATTENTION = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn_attention")
SHOWN = 90  # characters of a kernel name in the table


def attention_events(step, cuda: bool) -> Counter:
    """Names (ops and kernels) of the attention work recorded while ``step()`` runs."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
    return Counter(e.name for e in prof.events() if ATTENTION.search(e.name.lower()))


def forced_flash_error(step) -> tuple[str | None, list[str]]:
    """(None, []) when a step runs with SDPA restricted to flash; else the error and torch's
    reasons."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                step()
        except RuntimeError as e:
            reasons = sorted({str(w.message).splitlines()[0] for w in caught})
            return str(e).splitlines()[0], reasons
    return None, []


def run(ctx: CheckContext, out: SectionResult) -> None:
    built = ctx.build(ctx.small())
    spec = built.spec
    out.note(
        f"{spec.num_layers} layers, {spec.num_heads} heads / {spec.num_kv_heads} kv heads "
        f"of {spec.head_dim}, seq {spec.seq_length}, {ctx.precision}"
    )
    ctx.step(built)  # warm-up: kernels chosen and loaded
    seen = attention_events(lambda: ctx.step(built), ctx.cuda)
    rows = [[f"`{name[:SHOWN]}`", str(n)] for name, n in sorted(seen.items())]
    out.table("Attention ops and kernels in one profiled step", ["name", "calls"], rows)
    flash = [name for name in seen if "flash" in name.lower()]
    error, reasons = forced_flash_error(lambda: ctx.step(built))
    if error is None:
        out.note("a step with SDPA restricted to the flash backend runs")
    else:
        out.note(f"with SDPA restricted to the flash backend: {error}")
        for reason in reasons[:5]:
            out.note(f"torch: {reason}")
    if not ctx.cuda:
        out.not_applicable("flash attention is a CUDA kernel; on the CPU SDPA ran the ops above")
    elif not flash:
        out.fail(f"no flash op or kernel in the step; attention ran {sorted(seen) or 'nothing'}")
    elif error is not None:
        out.fail(f"flash was not usable for every call: {error}")
    else:
        out.note(f"flash SDPA runs the attention: {', '.join(sorted(flash))[:200]}")
