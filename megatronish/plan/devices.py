"""How much memory a rank may use on this machine, and what the runtime itself takes."""

from __future__ import annotations

import torch

GiB = 2**30
# Memory a process holds besides tensors: CUDA context, cuBLAS workspaces and NCCL buffers on a
# GPU; the interpreter and torch's libraries on a CPU.
RUNTIME_BYTES = {"cuda": int(1.5 * GiB), "cpu": int(0.6 * GiB)}


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
