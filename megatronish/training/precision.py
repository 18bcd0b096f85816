"""Training precision: the dtype names of the config and the TF32 switch for fp32 matmuls.

``trainer.precision=bf16`` is Megatron-LM's recipe: bf16 params and activations, fp32 main
params, grads and Adam moments (see :mod:`megatronish.optim.zero`). ``trainer.tf32`` lets fp32
matmuls and convolutions on CUDA use TF32 tensor cores (10-bit mantissa inputs, fp32
accumulation); it changes nothing on a CPU.
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fp32_matmul_setting(device_type: str, tf32: bool) -> str | None:
    """The cuBLAS / cuDNN fp32 precision to set: ``tf32``, ``ieee``, or None off CUDA."""
    if device_type != "cuda":
        return None
    return "tf32" if tf32 else "ieee"


def apply_fp32_matmul_setting(device: torch.device, tf32: bool) -> str | None:
    """Set the process's CUDA fp32 matmul and convolution precision; returns what was set."""
    setting = fp32_matmul_setting(device.type, tf32)
    if setting is not None:
        torch.backends.cuda.matmul.fp32_precision = setting
        torch.backends.cudnn.conv.fp32_precision = setting
    return setting
