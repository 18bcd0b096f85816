"""Training precision: the dtype names of the config and the TF32 switch for fp32 matmuls.

``trainer.precision=bf16`` is Megatron-LM's recipe: bf16 params and activations, fp32 main
params, grads and Adam moments (see :mod:`megatronish.data_parallel.zero`). ``trainer.tf32`` lets
fp32 matmuls and convolutions on CUDA use TF32 tensor cores (10-bit mantissa inputs, fp32
accumulation); it changes nothing on a CPU.

torch has two generations of TF32 switches. Every supported torch (2.6 on) has the legacy ones,
``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``; torch 2.9 added
``fp32_precision`` ("tf32" / "ieee") per backend and op. From 2.9 on the two are one state read
through two views, and a legacy reader (``torch.get_float32_matmul_precision()``,
``matmul.allow_tf32``, both read by torch.compile) raises "mix of the legacy and new APIs" when
only the new view was written. So the setting goes through the legacy switches (which write
both views) and then, where it exists, through the new one, and every reader agrees.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fp32_matmul_setting(device_type: str, tf32: bool) -> str | None:
    """The cuBLAS / cuDNN fp32 precision to set: ``tf32``, ``ieee``, or None off CUDA."""
    if device_type != "cuda":
        return None
    return "tf32" if tf32 else "ieee"


def has_fp32_precision_api(backends=None) -> bool:
    """Whether this torch has the per-op ``fp32_precision`` switches (torch >= 2.9)."""
    backends = torch.backends if backends is None else backends
    try:
        return isinstance(backends.cuda.matmul.fp32_precision, str)
    except AttributeError:  # torch < 2.9: "Unknown attribute fp32_precision"
        return False


def set_fp32_precision(setting: str, backends=None) -> None:
    """Write ``setting`` ("tf32" or "ieee") for CUDA matmuls and convolutions through every
    API generation ``backends`` (``torch.backends``) has, leaving their readers in agreement."""
    backends = torch.backends if backends is None else backends
    allow = setting == "tf32"
    backends.cuda.matmul.allow_tf32 = allow  # torch >= 2.9: writes the new view too
    backends.cudnn.allow_tf32 = allow
    if has_fp32_precision_api(backends):
        backends.cuda.matmul.fp32_precision = setting
        backends.cudnn.conv.fp32_precision = setting


def tf32_matmuls_enabled(backends=None) -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 tensor cores, read through the newest API
    ``backends`` has (never a legacy reader another library's setting could make raise)."""
    backends = torch.backends if backends is None else backends
    if not has_fp32_precision_api(backends):
        return bool(backends.cuda.matmul.allow_tf32)
    # "none" inherits: matmul -> all of CUDA -> every backend (torch's resolution order).
    for value in (
        backends.cuda.matmul.fp32_precision,
        backends.cudnn.fp32_precision,
        backends.fp32_precision,
    ):
        if value != "none":
            return value == "tf32"
    return False


def apply_fp32_matmul_setting(device: torch.device, tf32: bool) -> str | None:
    """Set the process's CUDA fp32 matmul and convolution precision; returns what was set."""
    setting = fp32_matmul_setting(device.type, tf32)
    if setting is not None:
        set_fp32_precision(setting)
    return setting


_OUR_WORKSPACE_CONFIG = None  # the CUBLAS_WORKSPACE_CONFIG value this module set, if any


def apply_deterministic(deterministic: bool) -> None:
    """``trainer.deterministic``: torch's deterministic algorithms on or off.

    On: torch picks deterministic kernels where it has them (flash attention's deterministic
    backward, index_add without atomics; cuDNN attention is not admitted) and an op without one
    raises, naming itself; cuBLAS gets a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, unless
    set already: read when its handle is made, so call this before the first GPU matmul); and
    ``torch.utils.deterministic.fill_uninitialized_memory`` is turned off (as the GPU check's
    resume section does): it would NaN-fill every new ``torch.empty`` (the head's placeholder
    grads, pipeline receive buffers, ZeRO 3's flat buffers, checkpoint host buffers) on every
    step, which only matters to code that reads memory before writing it. Off: torch's
    defaults again (the workspace variable removed if this module set it).
    """
    global _OUR_WORKSPACE_CONFIG
    if deterministic and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = _OUR_WORKSPACE_CONFIG = ":4096:8"
    elif not deterministic and _OUR_WORKSPACE_CONFIG is not None:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") == _OUR_WORKSPACE_CONFIG:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        _OUR_WORKSPACE_CONFIG = None
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        # Only on a change: every call imports torch._inductor's config (torch._dynamo, ~800
        # modules, seconds of start-up on every rank).
        torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = not deterministic  # torch's default
