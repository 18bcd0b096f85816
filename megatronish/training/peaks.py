"""What the device can do: peak matmul FLOP/s (measured or from the device table) and memory.

MFU divides model FLOPs (:mod:`megatronish.model.flops`) by these peaks.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from megatronish.plan.devices import gpu_for_cuda_name
from megatronish.training.heap_sampler import HeapPeakSampler, heap_in_use
from megatronish.training.precision import tf32_matmuls_enabled as tf32_matmuls  # tests patch it


def measure_matmul_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 matmul FLOP/s of this process (current thread count), from a short probe."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def device_peak_flops(device: torch.device, precision: str, configured_tflops: float | None):
    """Peak FLOP/s of one device: configured, the GPU table (``plan.devices.GPUS``, by the CUDA
    device name), or a CPU probe; None for a GPU the table does not list."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        gpu = gpu_for_cuda_name(torch.cuda.get_device_name(device))
        return None if gpu is None else gpu.peak_tflops(precision, tf32_matmuls()) * 1e12
    return measure_matmul_peak()


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory held since the last :func:`reset_peak_memory` (since start if never):
    on a GPU the bytes allocated to tensors (``torch.cuda.max_memory_allocated``); on a CPU the
    process's peak resident set size (Linux's VmHWM; without /proc, ``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak at the memory held now; False where it cannot be reset (a CPU without
    Linux's ``/proc/self/clear_refs``: the peak stays the process's lifetime peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS and nothing else (proc(5))
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") is not None


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """The peaks a training run reports: :meth:`startup` once the model, ZeRO's state and any
    checkpoint are in place (the peak since the process started), then :meth:`take` at every
    progress line (the peak since the previous one); :meth:`close` when training ends.

    GPU: bytes allocated to tensors (``torch.cuda.max_memory_allocated``, reset after each).
    CPU: the start-up peak is the process's peak resident set; the steps' peaks are the most
    bytes malloc had handed out (:mod:`~megatronish.training.heap_sampler`, glibc), sampled by
    a thread only where they are printed (``sample``), else the peak resident set since the
    previous line (Linux), else the process's peak so far.
    ``meanings``: what the start-up and the step numbers are, in words.
    """

    def __init__(self, device: torch.device, sample: bool = True):
        self.device, self.sample = device, sample
        self.sampler: HeapPeakSampler | None = None
        self.meanings = ("", "")

    def startup(self) -> int:
        """The peak so far; starts measuring the steps."""
        peak = peak_memory_bytes(self.device)
        if self.device.type == "cuda":
            reset_peak_memory(self.device)
            self.meanings = (
                f"allocated to tensors on {self.device}",
                "the same, the peak since the previous line",
            )
        elif self.sample and heap_in_use() is not None:
            self.sampler = HeapPeakSampler()
            every = f"{self.sampler.min_interval_s * 1e3:g} ms"
            self.meanings = (
                "peak resident set of the process",
                "the most bytes allocated since the previous line (malloc's heap "
                f"in use, sampled every {every}; less often if the heap is "
                "fragmented)",
            )
        elif reset_peak_memory(self.device):
            self.meanings = (
                "peak resident set of the process",
                "the peak resident set since the previous line",
            )
        else:
            self.meanings = (
                "peak resident set of the process",
                "the process's peak resident set so far (no reset here)",
            )
        return peak

    def take(self) -> int:
        """The peak since the previous call (or :meth:`startup`)."""
        if self.sampler is not None:
            return self.sampler.take()
        peak = peak_memory_bytes(self.device)
        reset_peak_memory(self.device)
        return peak

    def close(self) -> None:
        """Stop the CPU sampler, if one runs."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
