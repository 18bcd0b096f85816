"""What the device can do: peak matmul FLOP/s (measured or from the device table) and memory.

MFU divides model FLOPs (:mod:`megatronish.model.flops`) by these peaks.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from megatronish.plan.devices import gpu_for_cuda_name


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


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 tensor cores (torch's default: no)."""
    new_api = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    return new_api == "tf32" or torch.get_float32_matmul_precision() != "highest"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory (GPU) or peak resident set size of the process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
