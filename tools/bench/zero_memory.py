"""Memory per rank of megatronish's ZeRO stages (and of DDP / FSDP2) on a 2-rank world.

Each variant runs in a fresh forked world, so its peak resident set is its own: the rank resets
its high-water mark (``/proc/self/clear_refs``) when it starts, builds the variant, trains a
few steps and reads ``VmHWM``. Alongside, the bytes megatronish's ZeRO holds at a step boundary
(``trainer.zero.state_bytes()`` + ``trainer.optimizer.state_bytes()``) are compared with the
ZeRO paper's per-rank formulas for fp32 training (4 bytes of params, 4 of grads and 8 of Adam
moments per parameter, no separate master copy), and each megatronish rank reports what the
planner (``megatronish.plan.estimate.make_plan``) predicts for the config it trained.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

from mish import build_run
from zero_peers import ddp_run, fsdp2_run, peer_setup

from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.multiproc import run_world

MIB = 2**20


def zero_formula(stage: int, psi: int, dp: int) -> float:
    """Bytes per rank for params + grads + Adam state (fp32: 4 + 4 + 8 bytes per parameter)."""
    return {
        0: 16 * psi,
        1: 8 * psi + 8 * psi / dp,
        2: 4 * psi + 12 * psi / dp,
        3: 16 * psi / dp,
    }[stage]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
        return True
    return False


def _libc():
    with contextlib.suppress(OSError):
        return ctypes.CDLL("libc.so.6")
    return None


def _exact_rss() -> bool:
    """Make RSS follow tensor frees: every allocation of 256 KiB or more gets its own mapping.

    glibc otherwise raises its mmap threshold after the first large free (up to 32 MiB), so the
    buffers ZeRO 3 frees and re-allocates every step would stay resident and count as peak.
    """
    libc = _libc()
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(
        libc is not None
        and libc.mallopt(m_mmap_threshold, 256 * 1024)
        and libc.mallopt(m_trim_threshold, 256 * 1024)
    )


def _trim() -> None:
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def planned(cfg, world: int) -> dict[str, int]:
    """The planner's bytes for one rank of ``cfg`` on ``world`` ranks (pp = 1: stage 0)."""
    stage = make_plan(spec_of(cfg), layout_from_config(cfg, world)).stages[0]
    s = stage.states
    return {
        "peak": stage.peak,
        "states_total": s.total,
        "params": s.params,
        "grads": s.grads,
        "optimizer": s.optimizer,
        "params_step": s.params_step,
        "grads_step": s.grads_step,
        "grads_at_peak": s.grads_at_peak,
        "activations_peak": stage.activations.peak,
        "optimizer_workspace": stage.optimizer_workspace,
    }


def _rank(rank: int, world: int, variant: str, extra: list[str], steps: int) -> dict:
    """Build ``variant`` ("zero N", "DDP", "FSDP2") in this world, train, report memory."""
    exact = _exact_rss()
    reset = _reset_peak()
    start = _status_kib("VmRSS") * 1024
    out: dict = {"reset_peak": reset, "exact_rss": exact, "rss_start": start}
    if variant.startswith("zero"):
        run = build_run([*extra, f"parallel.zero_stage={variant.split()[1]}"], rank, world)
        step = run.step
        zero = run.trainer.zero
        out["psi"] = sum(p.numel() for c in run.chunks for p in c.parameters())
    else:
        make = ddp_run if variant == "DDP" else fsdp2_run
        step, zero = make(*peer_setup(extra), rank, world, extra).step, None
    gc.collect()
    _trim()  # hand freed build-time memory (initial weight copies) back to the OS
    out["rss_built"] = _status_kib("VmRSS") * 1024
    _reset_peak()  # the peak of the training steps only
    out["losses"] = [step() for _ in range(steps)]
    out["rss_peak"] = _status_kib("VmHWM") * 1024
    if zero is not None:
        out["state"] = {**zero.state_bytes(), "optimizer": run.trainer.optimizer.state_bytes()}
        # Weight-decay and grad-norm selections are (start, end) ranges: two ints per range.
        out["masks"] = sum(16 * (len(b.decay_ranges) + len(b.norm_ranges)) for b in zero.buckets)
        out["plan"] = planned(run.cfg, world)  # after the peak is read: meta tensors only
    return out


def measure(variant: str, extra: list[str], steps: int = 2, world: int = 2) -> list[dict]:
    """Per-rank memory report of ``variant`` trained ``steps`` steps in a fresh world."""
    return run_world(_rank, world, variant, extra, steps, timeout=600, collective_timeout=300)
