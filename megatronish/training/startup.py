"""The lines a run logs before its first step: the model's size, the planned memory per rank,
how many times the data will be read, and what the step lines' numbers mean."""

from __future__ import annotations

from dataclasses import replace

from megatronish.config.schema import TrainConfig
from megatronish.plan.estimate import Plan, make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.training.progress import fmt_bytes


def planned(cfg: TrainConfig, world_size: int, vocab_size: int, device_type: str) -> Plan:
    """The planner's view of this run (no allocation)."""
    layout = replace(layout_from_config(cfg, world_size), device_type=device_type)
    return make_plan(spec_of(cfg, vocab_size), layout)


def model_line(plan: Plan, arch: str, rank_params: int) -> str:
    """Total (and active) parameters and what this rank's chunks hold."""
    active = ""
    if plan.active_parameters and plan.active_parameters != plan.parameters:
        active = f" ({plan.active_parameters:,} active per token)"
    return (
        f"model: {arch}, {plan.parameters:,} parameters{active}; "
        f"this rank's chunks: {rank_params:,}"
    )


def memory_line(plan: Plan) -> str:
    """The planned peak per rank and, for the largest stage, what makes it up."""
    worst = max(plan.stages, key=lambda s: s.peak)
    st = worst.states
    where = f" (pipeline stage {worst.pp_rank})" if len(plan.stages) > 1 else ""
    return (
        f"planned peak memory per rank: {fmt_bytes(worst.peak)}{where} = "
        f"{fmt_bytes(st.params)} params + {fmt_bytes(st.grads)} grads + "
        f"{fmt_bytes(st.optimizer)} optimizer + {fmt_bytes(worst.peak - st.total)} in the step "
        "(activations, gathered params); `python -m megatronish.plan` breaks it down"
    )


def epochs_line(kind: str, available: int, read: int) -> str:
    """How many samples a dataset has and how many times the run reads it."""
    epochs = read / max(available, 1)
    again = f": every sample read {epochs:.1f} times" if epochs > 1 else ""
    return (
        f"data: {kind} {available:,} samples per epoch, the run reads {read:,} "
        f"({epochs:.3g} epochs{again})"
    )


def throughput_note(world_size: int, fp8: str | None = None) -> str:
    """What tok/s and MFU on the step lines are."""
    against = "; MFU counts against the device's fp8 peak (trainer.fp8)" if fp8 else ""
    if world_size == 1:
        return "step lines: tok/s of this one device" + against
    return (
        f"step lines: tok/s is global (all {world_size} ranks), tok/s/dev = tok/s / "
        f"{world_size}; MFU is per device" + against
    )


def log_startup(cfg: TrainConfig, job, trainer, logger) -> None:
    """Log what the run is before its first step (on the rank that logs): model size, planned
    memory, data epochs, the steps left and what the step lines report."""
    if not logger.enabled:
        return
    topo, t = job.topo, cfg.trainer
    plan = planned(cfg, topo.world_size, job.spec.vocab_size, topo.device.type)
    rank_params = sum(p.numel() for c in job.chunks for p in c.parameters())
    logger.info(model_line(plan, job.spec.arch, rank_params))
    logger.info(memory_line(plan))
    if not hasattr(job.train_data, "describe"):  # a blend lists its datasets' epochs itself
        logger.info(epochs_line("train", len(job.train_data), t.max_steps * t.global_batch_size))
    left = t.max_steps - trainer.state.step
    logger.info(
        f"training for {left} steps (step {trainer.state.step} -> {t.max_steps}), "
        f"{job.derived.tokens_per_step:,} tokens/step, device {topo.device}; "
        + throughput_note(topo.world_size, t.fp8)
    )
