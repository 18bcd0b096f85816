"""Human-readable text of a :class:`~megatronish.plan.estimate.Plan`."""

from __future__ import annotations

from megatronish.plan.devices import GiB
from megatronish.plan.estimate import Plan


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _si(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} "


def plan_report(
    plan: Plan,
    *,
    device_bytes: int | None = None,
    runtime_bytes: int = 0,
    peak_flops: float | None = None,
    step_time_s: float | None = None,
) -> str:
    """The plan as printed by ``python -m megatronish.plan``."""
    lay, spec = plan.layout, plan.spec
    lines = [
        f"model: {spec.arch}, {plan.parameters:,} parameters ({spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_heads} heads / {spec.num_kv_heads} kv, ffn "
        f"{spec.ffn_hidden_size}, vocab {spec.padded_vocab_size}, seq {spec.seq_length})",
        f"layout: {lay.describe()} on {lay.world_size} ranks, {lay.num_microbatches} microbatches "
        f"of {lay.micro_batch_size} per step, {lay.precision}",
        f"tokens per step: {plan.tokens_per_step:,}",
        f"model FLOPs per step: {plan.model_flops_per_step:.3e} "
        f"(with recompute: {plan.hardware_flops_per_step:.3e})",
        f"pipeline bubble: {plan.bubble:.1%} of compute",
        "",
        "per rank (GiB)  | params | grads | optimizer | states | activations (in flight) | peak",
    ]
    for st in plan.stages:
        s, a = st.states, st.activations
        extra = s.params_step + s.grads_step
        states = f"{s.total / GiB:.2f}" + (f" +{extra / GiB:.2f} in step" if extra else "")
        lines.append(
            f"pp stage {st.pp_rank:<5} | {s.params / GiB:6.2f} | {s.grads / GiB:5.2f} | "
            f"{s.optimizer / GiB:9.2f} | {states} | {a.peak / GiB:.2f} ({a.in_flight:.2f} "
            f"microbatches) | {st.peak / GiB:.2f}"
        )
    lines += ["", "communication per step per rank (tensor bytes handed to the collective):"]
    for st in plan.stages:
        parts = [f"{k} {_si(b)}B in {c}" for k, (c, b) in sorted(st.comm.items())]
        lines.append(f"  pp stage {st.pp_rank}: " + ("; ".join(parts) or "none"))
    if device_bytes:
        need = plan.peak_bytes + runtime_bytes
        verdict = "fits" if need <= device_bytes else "does NOT fit"
        lines += [
            "",
            f"memory: peak {gib(plan.peak_bytes)} + runtime {gib(runtime_bytes)} = {gib(need)} "
            f"per rank, device {gib(device_bytes)}: {verdict}",
        ]
    if peak_flops:
        lines.append(f"peak: {_si(peak_flops)}FLOP/s per device")
        if step_time_s:
            mfu = plan.mfu_needed(step_time_s, peak_flops)
            lines.append(f"a {step_time_s:g} s step needs {mfu:.1%} MFU")
        for mfu in (0.3, 0.4, 0.5):
            t = plan.model_flops_per_step / (mfu * peak_flops * lay.world_size)
            lines.append(
                f"  at {mfu:.0%} MFU: {t:.2f} s per step, {plan.tokens_per_step / t:,.0f} tokens/s"
            )
    return "\n".join(lines)
