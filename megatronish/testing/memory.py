"""Measure what a rank holds: state tensors between steps and the activation peak of a step.

States are the storages of the ZeRO buffers and Adam moments (each storage counted once).
The activation peak is the highest net allocation, over one step's forward and backward,
above the memory held when it started: every allocation and free of the CPU (or CUDA)
allocator recorded by torch's profiler with ``profile_memory``. Under ZeRO 3 the most full
params the step held gathered at once are subtracted (they are states, planned separately).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd.profiler import profile

from megatronish.testing.multiproc import WorldError, run_world


@dataclass
class MeasuredMemory:
    params: int
    grads: int
    optimizer: int
    activations: int | None  # peak net allocation of forward + backward, gathered zero-3 params
    # excluded; None when the profiler recorded nothing
    gathered_params: int  # zero 3: most bytes of full params gathered at once in the step
    events: int = 0  # allocation events the profile recorded
    compression: int = 0  # the gradient compression's state (error feedback, PowerSGD's Q)


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def state_storage(trainer) -> dict[str, int]:
    """Bytes of the params, grads, optimizer and gradient-compression storages this rank holds
    right now."""
    zero, opt = trainer.zero, trainer.optimizer
    params = _storage_bytes(
        [t for b in zero.buckets for t in (b.param_flat, b.param_shard, b.main_shard)]
    )
    grad_tensors = [t for b in zero.buckets for t in (b.grad_flat, b.grad_shard)]
    return {
        "params": params,
        "grads": _storage_bytes(grad_tensors),
        "optimizer": _storage_bytes(opt.exp_avg + opt.exp_avg_sq),
        "compression": _storage_bytes(
            zero.compressor.state_dict().values() if zero.compressor is not None else []
        ),
    }


def _peak_net_bytes(prof) -> tuple[int | None, int]:
    """Peak net allocation over the profiled region, all threads (gloo's worker threads free
    the buffers of finished collectives, a little later from one run to the next); None when
    the profiler recorded no allocation at all; and the number of allocation events (a forked
    process's profile occasionally misses most of them: compare counts across steps)."""
    events = [e for e in prof.kineto_results.events() if e.name() == "[memory]"]
    if not events:
        return None, 0
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, len(events)


def least_activations(runs: list[MeasuredMemory]) -> int:
    """The smallest activation peak of complete profiles: gloo's late frees only add, and a
    profile with clearly fewer allocation events than the fullest one missed some."""
    most = max(m.events for m in runs)
    complete = [m.activations for m in runs if m.activations is not None and m.events >= 0.9 * most]
    return min(complete)


def measure_step(trainer) -> MeasuredMemory:
    """Run one training step (after at least one earlier step) and measure this rank.

    ``activations`` is None when the profile came back empty (it occasionally does in a forked
    process); the step still ran, so every rank stays in step with the others.
    """
    states = state_storage(trainer)
    inner = trainer.forward_backward
    peaks = []

    def profiled(*args, **kwargs):
        # The autograd profiler itself: torch.profiler.profile's start imports torch._inductor
        # (~1.5 s of CPU in every process that profiles), which a memory profile does not need.
        device = "cuda" if trainer.topo.device.type == "cuda" else None
        with profile(use_cpu=True, use_device=device, profile_memory=True) as prof:
            out = inner(*args, **kwargs)
            # Let no collective run on a gloo thread while the profiler stops (see
            # run_profiled_world); the reductions complete here instead of just after.
            trainer.zero.reducer.finish_all()
        peaks.append(_peak_net_bytes(prof))
        return out

    gatherer = trainer.zero.gatherer if trainer.zero.zero_stage.shards_params else None
    if gatherer is not None:
        gatherer.peak_gathered_numel = gatherer.gathered_numel
    trainer.forward_backward = profiled
    try:
        trainer.train_step()
    finally:
        trainer.forward_backward = inner
    gathered = 0
    if gatherer is not None:
        gathered = gatherer.peak_gathered_numel * trainer.zero.param_dtype.itemsize
    return MeasuredMemory(
        params=states["params"],
        grads=states["grads"],
        optimizer=states["optimizer"],
        activations=None if peaks[0][0] is None else peaks[0][0] - gathered,
        gathered_params=gathered,
        events=peaks[0][1],
        compression=states["compression"],
    )


SEGFAULT = "killed by signal 11"


def run_profiled_world(fn, world_size: int, *args, **kwargs) -> list:
    """:func:`~megatronish.testing.multiproc.run_world` for ranks that run the memory profiler,
    run once more if a rank segfaulted: torch's profiler can crash when another thread (a gloo
    worker) reports an allocation while it tears down (pytorch/pytorch#195636), rarely."""
    try:
        return run_world(fn, world_size, *args, **kwargs)
    except WorldError as e:
        if not any(SEGFAULT in error for error in e.errors.values()):
            raise
    return run_world(fn, world_size, *args, **kwargs)


def _measure_layout_rank(rank: int, world: int, overrides: list[str]):
    """States after a step and the least activation peak of six more (ZeRO 3's gathered params
    and ZeRO 2/3's per-bucket full grads counted as part of the step's peak)."""
    from megatronish.testing.runs import build_trainer

    trainer = build_trainer(rank, world, overrides, steps=8)
    trainer.train_step()  # buffers and moments exist from here on
    # gloo's worker threads free the buffers of finished collectives later in some steps than
    # in others (more so on a loaded machine); that only ever adds, so the smallest of six
    # complete steps is what the program itself keeps.
    runs = [measure_step(trainer) for _ in range(6)]
    for m in runs:
        if m.activations is not None:
            m.activations += m.gathered_params
    return trainer.topo.coords.pp, runs[-1], least_activations(runs)


def measure_layout(world: int, overrides: list[str]) -> list[tuple[int, MeasuredMemory, int]]:
    """``(pp rank, states, least activation peak)`` of every rank of the tiny test model trained
    in ``overrides``' layout on ``world`` ranks."""
    if world == 1:
        return [_measure_layout_rank(0, 1, overrides)]
    return run_profiled_world(_measure_layout_rank, world, overrides)


def activations_by_stage(results: list[tuple[int, MeasuredMemory, int]]) -> dict[int, int]:
    """Per pipeline stage, the lower median of its ranks' activation peaks (the ranks of a
    stage keep the same tensors; the median guards against one rank's incomplete profile)."""
    by_stage: dict[int, list[int]] = {}
    for pp_rank, _, activations in results:
        by_stage.setdefault(pp_rank, []).append(activations)
    return {pp: sorted(values)[(len(values) - 1) // 2] for pp, values in by_stage.items()}
