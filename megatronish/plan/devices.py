"""What a device offers: the named-GPU table (peak FLOP/s, memory), how much memory a rank may
use on this machine, and what the runtime itself takes.

:data:`GPUS` is the one table of GPU models: ``training.peaks.device_peak_flops`` finds the running
GPU in it by its CUDA name, the planner by the name given as ``device=NAME``. FLOP/s are the
dense tensor-core peaks of the vendor datasheets (half the "with sparsity" figures); ``fp32``
is the non-tensor-core rate (what fp32 matmuls run at unless TF32 is allowed). The memory
bandwidth feeds the advisor's matmul efficiency (:mod:`megatronish.plan.matmul_efficiency`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

GiB = 2**30
# Memory a process holds besides tensors: CUDA context, cuBLAS workspaces and NCCL buffers on a
# GPU; the interpreter and torch's libraries on a CPU.
RUNTIME_BYTES = {"cuda": int(1.5 * GiB), "cpu": int(0.6 * GiB)}


@dataclass(frozen=True)
class GPUModel:
    """One GPU model's datasheet numbers and the words its CUDA device name contains."""

    name: str  # the planner's device=NAME
    title: str  # the product as its datasheet names it
    bf16_tflops: float  # dense; fp16 is the same
    tf32_tflops: float  # dense
    fp32_tflops: float  # without tensor cores
    memory_gb: float  # on the datasheet
    usable_gib: float  # the device's total memory as CUDA reports it, rounded down
    memory_tbps: float  # memory bandwidth on the datasheet, TB/s (the matmul efficiency model)
    words: tuple[str, ...]  # all appear in torch.cuda.get_device_name() (lower case)
    aliases: tuple[str, ...] = ()
    # Gb/s per GPU across nodes in the usual cluster of this class: one 400 Gb/s NDR NIC per
    # H100/H200/B200 (DGX/HGX), 200 Gb/s HDR per A100, 100 Gb/s Ethernet for PCIe/NVL and L40S
    network_gbps: float = 400.0
    fp8_tflops: float | None = None  # dense; None: no fp8 tensor cores (before Hopper / Ada)

    def peak_tflops(self, precision: str, tf32: bool = False) -> float:
        """Dense peak for ``precision`` (``fp8``, ``bf16``, ``fp16``, ``fp32`` or ``tf32``; see
        :func:`peak_precision`); ``tf32``: fp32 matmuls may use TF32 tensor cores."""
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise ValueError(f"the {self.title} has no fp8 tensor cores (trainer.fp8)")
            return self.fp8_tflops
        if precision in ("bf16", "fp16"):
            return self.bf16_tflops
        if precision == "tf32" or (precision == "fp32" and tf32):
            return self.tf32_tflops
        if precision == "fp32":
            return self.fp32_tflops
        raise ValueError(f"no peak for precision {precision!r}: fp8, bf16, fp16, fp32 or tf32")


def peak_precision(precision: str, fp8: str | None) -> str:
    """The precision whose peak MFU counts against: ``fp8`` when ``trainer.fp8`` is on (most
    GEMM FLOPs run there), else ``trainer.precision``."""
    return "fp8" if fp8 else precision


# Vendor datasheets, dense (no sparsity); memory bandwidth of the SXM board where a product
# comes in several (the A100 80GB PCIe has 1.935 TB/s). usable_gib: CUDA reports a little less
# total memory than the datasheet size (ECC and driver reservations); these are that figure
# rounded down to a whole GiB, to plan against.
GPUS: tuple[GPUModel, ...] = (
    GPUModel(
        "h100",
        "H100 SXM 80GB",
        989.0,
        494.5,
        67.0,
        80,
        79.0,
        3.35,
        ("h100",),
        ("h100-sxm",),
        fp8_tflops=1979.0,
    ),
    GPUModel(
        "h100-pcie",
        "H100 PCIe 80GB",
        756.0,
        378.0,
        51.0,
        80,
        79.0,
        2.0,
        ("h100", "pcie"),
        (),
        100,
        fp8_tflops=1513.0,
    ),
    GPUModel(
        "h100-nvl",
        "H100 NVL 94GB",
        835.5,
        417.5,
        60.0,
        94,
        93.0,
        3.9,
        ("h100", "nvl"),
        (),
        100,
        fp8_tflops=1671.0,
    ),
    GPUModel(
        "h200",
        "H200 SXM 141GB",
        989.0,
        494.5,
        67.0,
        141,
        139.0,
        4.8,
        ("h200",),
        ("h200-sxm",),
        fp8_tflops=1979.0,
    ),
    GPUModel(
        "h200-nvl",
        "H200 NVL 141GB",
        835.5,
        417.5,
        60.0,
        141,
        139.0,
        4.8,
        ("h200", "nvl"),
        (),
        100,
        fp8_tflops=1671.0,
    ),
    GPUModel(
        "a100", "A100 80GB", 312.0, 156.0, 19.5, 80, 79.0, 2.039, ("a100",), ("a100-80gb",), 200
    ),
    GPUModel(
        "a100-40gb", "A100 40GB", 312.0, 156.0, 19.5, 40, 39.0, 1.555, ("a100", "40gb"), (), 200
    ),
    GPUModel(
        "b200",
        "B200 (HGX) 180GB",
        2250.0,
        1100.0,
        75.0,
        180,
        178.0,
        8.0,
        ("b200",),
        fp8_tflops=4500.0,
    ),
    GPUModel("l40s", "L40S 48GB", 362.0, 183.0, 91.6, 48, 44.0, 0.864, ("l40s",), (), 100, 733.0),
)


class UnknownDevice(ValueError):
    """A ``device=NAME`` that is not in :data:`GPUS`."""


def known_device_names() -> list[str]:
    return [g.name for g in GPUS]


def gpu_named(name: str) -> GPUModel:
    """The table's GPU called ``name`` (case-insensitive; ``_`` for ``-`` and aliases work)."""
    key = name.strip().lower().replace("_", "-")
    for gpu in GPUS:
        if key == gpu.name or key in gpu.aliases:
            return gpu
    known = ", ".join(known_device_names())
    raise UnknownDevice(f"unknown device {name!r}; known devices: {known}")


def gpu_for_cuda_name(cuda_name: str) -> GPUModel | None:
    """The table's GPU for a CUDA device name (``NVIDIA H100 80GB HBM3``,
    ``NVIDIA A100-SXM4-40GB``...): the entry with the most words, all in the name; None if none."""
    words = set(re.findall(r"[a-z0-9]+", cuda_name.lower()))
    found = [g for g in GPUS if all(w in words for w in g.words)]
    return max(found, key=lambda g: len(g.words)) if found else None


def local_gpu() -> GPUModel | None:
    """The table's entry for this machine's current GPU (None without one, or if not listed)."""
    if not torch.cuda.is_available():
        return None
    return gpu_for_cuda_name(torch.cuda.get_device_name())


def runtime_bytes_for(device_type: str) -> int:
    return RUNTIME_BYTES["cuda" if device_type == "cuda" else "cpu"]


def available_ram_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of the host (Linux), or None when it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_device_memory(device: str, local_ranks: int) -> tuple[int | None, int]:
    """``(bytes one rank may use or None when unknown, runtime bytes)`` for ``trainer.device``
    (``auto``, ``cuda``, ``cuda:N`` or ``cpu``) on this machine.

    A GPU rank has its device; CPU ranks share the host's available RAM.
    """
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = torch.device(device).index if ":" in device else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, RUNTIME_BYTES["cuda"]
    ram = available_ram_bytes()
    return (None if ram is None else ram // max(local_ranks, 1)), RUNTIME_BYTES["cpu"]
