"""The advisor's table: the fastest layout of each (tp, pp), its terms and why it wins."""

from __future__ import annotations

from megatronish.plan.advisor import Advice, Ranked, reason
from megatronish.plan.devices import GiB
from megatronish.plan.step_time import TERMS, Hardware


def hardware_line(hw: Hardware, world_size: int, device_bytes: int, runtime_bytes: int) -> str:
    """The inputs of the model in one sentence."""
    nodes = -(-world_size // hw.gpus_per_node)
    where = (
        f"{hw.shared_cores:g} shared cores"
        if hw.shared_cores
        else f"{nodes} node(s) of {hw.gpus_per_node}"
    )
    return (
        f"{world_size} ranks on {where}; {device_bytes / GiB:.2f} GiB per device "
        f"(runtime {runtime_bytes / GiB:.2f} GiB); {hw.peak_flops / 1e12:g} TFLOP/s peak at "
        f"{hw.efficiency:.0%}; intra-node {hw.intra_node_bw / 1e9:g} GB/s, inter-node "
        f"{hw.inter_node_bw / 1e9:g} GB/s, latency {hw.latency_s * 1e6:g} us"
    )


def _row(i: int, r: Ranked, nxt: Ranked | None, hw: Hardware) -> list[str]:
    lay, t = r.layout, r.time
    mfu = r.plan.model_flops_per_step / (t.total * hw.peak_flops * lay.world_size)
    terms = [f"{t.terms()[k]:.3f}" for k in TERMS]
    return [str(i), lay.describe(), f"{t.total:.3f}", f"{mfu:.1%}",
            f"{r.plan.peak_bytes / GiB:.1f}", *terms, reason(r, nxt, hw)]  # fmt: skip


COLUMNS = ["#", "layout", "step s", "MFU", "peak GiB", *(f"{k} s" for k in TERMS), "why"]


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table with padded columns (readable as plain text too)."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])


def advice_table(advice: Advice, hw: Hardware, top: int) -> str:
    """The top ``top`` rows (one per (tp, pp), fastest first)."""
    best = advice.best_of_each_shape()
    rows = [
        _row(i + 1, r, best[i + 1] if i + 1 < len(best) else None, hw)
        for i, r in enumerate(best[:top])
    ]
    return markdown(COLUMNS, rows)


def advice_report(
    advice: Advice, hw: Hardware, top: int, world_size: int, device_bytes: int, runtime: int
) -> str:
    """What ``python -m megatronish.plan ... advise=true`` prints."""
    best = advice.best_of_each_shape()
    skipped = advice.valid - advice.planned
    lines = [
        hardware_line(hw, world_size, device_bytes, runtime),
        f"{advice.valid} valid layouts; {advice.planned} planned ({skipped} could not reach the "
        f"top {top}), {advice.too_big} of them do not fit, {len(advice.ranked)} do.",
        f"Fastest layout of each tp/pp ({min(top, len(best))} of {len(best)} shown); the "
        "terms add up to the step; 'why' compares a row with the next:",
        "",
        advice_table(advice, hw, top),
    ]
    return "\n".join(lines)
