"""Section 6: host-device synchronisations per training step.

A GPU runs ahead of Python only while the host never waits for it. A two-layer model of the
shape, dense and with mixture-of-experts blocks, trains its warm-up steps, then ``STEPS`` steps
under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call warns, and the
warnings are counted per step and by the line that made them. ``STEPS`` more steps run under
``megatronish.testing.host_syncs.HostSyncRecorder``, the CPU harness that holds the tests to a
sync budget; on CUDA the section fails when CUDA saw more syncs than the harness recorded (the
tests would miss them). Steps are bare ``train_step`` calls: each settles the one before it (its
one read of the loss and grad norm), as in training. On the CPU nothing synchronises: the
harness's count alone, or "not applicable" where the harness is absent.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import torch

from gpu_check.context import CheckContext
from gpu_check.report import SectionResult

NAME = "syncs"
TITLE = "Host syncs per training step"
SHARE = 0.05
STEPS = 3
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2"]
FULL_MOE_FFN = ["model.moe.ffn_hidden_size=1024"]  # OLMoE's expert size (moe_1b_7b.yaml)
SYNC_WARNING = "called a synchronizing CUDA operation"
SHOWN = 8  # sync sites listed per model


def cuda_syncs(run_steps) -> Counter:
    """Sync sites (``file:line``) and counts while ``run_steps()`` runs in sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_steps()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)
    )


def recorded_syncs(run_steps, device: torch.device) -> Counter:
    """Sync kinds and sites the CPU harness records while ``run_steps()`` runs."""
    from megatronish.testing.host_syncs import HostSyncRecorder

    with HostSyncRecorder(device) as rec:
        run_steps()
    return Counter(str(s) for s in rec.syncs)


def per_step(counts: Counter | None) -> str:
    return "n/a" if counts is None else f"{sum(counts.values()) / STEPS:g}"


def run(ctx: CheckContext, out: SectionResult) -> None:
    out.note(
        f"two layers of the shape, {ctx.precision}: {ctx.warmup} warm-up step(s), then "
        f"{STEPS} steps in CUDA's sync debug mode and {STEPS} in the CPU harness"
    )
    rows, missed = [], []
    models = {"dense": [], "MoE, 8 experts, top-2": MOE + ([] if ctx.smoke else FULL_MOE_FFN)}
    for label, extra in models.items():
        built = ctx.build([*ctx.small(), *extra])

        def run_steps(built=built) -> None:
            for _ in range(STEPS):
                built.trainer.train_step()

        for _ in range(ctx.warmup):  # then each step settles the one before, as in training
            built.trainer.train_step()
        ctx.sync()
        seen = cuda_syncs(run_steps) if ctx.cuda else None
        ctx.sync()
        recorded = recorded_syncs(run_steps, ctx.device)
        built.trainer.settle()
        rows.append([label, per_step(seen), per_step(recorded)])
        for source, counts in (("CUDA", seen), ("harness", recorded)):
            for site, n in (counts or Counter()).most_common(SHOWN):
                out.note(f"{label}, {source}: {n / STEPS:g} per step at {site}")
        if seen is not None and recorded is not None and seen.total() > recorded.total():
            missed.append(label)
        del built, run_steps
        ctx.release()
    out.table("Syncs per step", ["model", "CUDA sync debug mode", "CPU harness"], rows)
    if missed:
        out.fail(f"CUDA synchronised more often than the CPU harness recorded: {missed}")
    elif not ctx.cuda:
        out.note("on the CPU the harness's count is what a GPU would do; CUDA's is not measured")
