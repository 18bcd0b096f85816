"""How many layers of the gpt_1b shape one device holds at tp = pp = 1, by the planner.

Two answers: megatronish alone (planned peak plus the runtime's own bytes within the device),
and side by side with the plain-PyTorch reference of the throughput section, which keeps its
fp32 params, grads and Adam moments (16 bytes a parameter) and its logits at the loss (bf16,
their fp32 copy and its grad) while megatronish computes. The sections that train the large
model use the side-by-side size, so that every table describes the same model. The reference's
bytes are an estimate, not a plan: the side-by-side total must stay within ``MARGIN`` of the
device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gpu_check.context import CheckContext, GiB, batch, gib
from megatronish.config.schema import TrainConfig
from megatronish.plan.devices import local_device_memory, runtime_bytes_for
from megatronish.plan.estimate import Plan, make_plan
from megatronish.plan.layout import layout_from_config, spec_of

REFERENCE_BYTES_PER_PARAM = 16  # fp32 params, grads and two Adam moments
LOGIT_BYTES = 2 + 4 + 4  # bf16 logits, their fp32 copy for the loss, its grad
MARGIN = 0.9


@dataclass(frozen=True)
class Sizing:
    """The model the large sections train and why."""

    layers: int  # fits side by side with the reference
    alone_layers: int  # fits megatronish alone
    full_layers: int  # the experiment's
    micro_batch_size: int
    device_bytes: int
    runtime_bytes: int
    plan: Plan  # of the chosen model

    @property
    def overrides(self) -> list[str]:
        return [f"model.num_layers={self.layers}", *batch(self.micro_batch_size)]

    @property
    def side_by_side_bytes(self) -> int:
        return self.plan.peak_bytes + reference_bytes(self.plan) + self.runtime_bytes

    def describe(self) -> str:
        p = self.plan
        return (
            f"model: {self.layers} of {self.full_layers} layers of the gpt_1b shape "
            f"({p.parameters:,} parameters, micro batch {self.micro_batch_size}, seq "
            f"{p.spec.seq_length}); megatronish alone would fit {self.alone_layers} layers. "
            f"Planned peak {gib(p.peak_bytes)} GiB, with the reference and the runtime "
            f"{gib(self.side_by_side_bytes)} GiB of {gib(self.device_bytes)} GiB"
        )


def reference_bytes(plan: Plan) -> int:
    """What the reference holds while megatronish computes (see the module docstring)."""
    spec, lay = plan.spec, plan.layout
    logits = lay.micro_batch_size * spec.seq_length * spec.padded_vocab_size * LOGIT_BYTES
    return REFERENCE_BYTES_PER_PARAM * plan.parameters + logits


def largest(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``1..limit`` with ``fits(n)`` (which holds up to some n), or 0."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def device_budget(ctx: CheckContext) -> tuple[int, int]:
    """(bytes the device offers, the runtime's own bytes); a host without a known RAM size
    counts as unlimited."""
    if ctx.device_memory_gb is not None:
        return int(ctx.device_memory_gb * GiB), runtime_bytes_for(ctx.device.type)
    total, runtime = local_device_memory(str(ctx.device), 1)
    return (total if total is not None else 2**62), runtime


def sizing_at(micro: int, cfg: TrainConfig, device_bytes: int, runtime: int) -> Sizing | None:
    """The sizing at micro batch ``micro`` (``cfg`` composed with it), or None when not even
    one layer fits side by side with the reference."""
    spec, layout = spec_of(cfg), layout_from_config(cfg, 1)
    plans: dict[int, Plan] = {}

    def plan(n: int) -> Plan:
        if n not in plans:
            plans[n] = make_plan(replace(spec, num_layers=n), layout)
        return plans[n]

    def alone(n: int) -> bool:
        return plan(n).peak_bytes + runtime <= device_bytes

    def side_by_side(n: int) -> bool:
        return plan(n).peak_bytes + reference_bytes(plan(n)) + runtime <= MARGIN * device_bytes

    layers = largest(spec.num_layers, side_by_side)
    if not layers:
        return None
    return Sizing(
        layers,
        largest(spec.num_layers, alone),
        spec.num_layers,
        micro,
        device_bytes,
        runtime,
        plan(layers),
    )


def choose(ctx: CheckContext, device_bytes: int, runtime: int) -> Sizing:
    """The sizing for a device of ``device_bytes``: the experiment's micro batch, halved until
    a layer fits; raises when none does."""
    micro = ctx.micro_batch_size
    while micro >= 1:
        found = sizing_at(micro, ctx.config(batch(micro)), device_bytes, runtime)
        if found is not None:
            return found
        micro //= 2
    raise RuntimeError(
        f"not even one layer of the model fits {device_bytes / GiB:.1f} GiB side by side "
        "with the reference at micro batch 1"
    )


def size_model(ctx: CheckContext) -> Sizing:
    """The sizing for this run's device (``--device-memory-gb`` overrides its memory)."""
    return choose(ctx, *device_budget(ctx))
