"""Model FLOPs, MFU, peak memory and throughput bookkeeping.

Model FLOPs per token (the PaLM / Chinchilla convention, used by Megatron and torchtitan for MFU):

    flops_per_token = 6 * N + 12 * L * s * h

``N`` counts the weights of every matmul (attention, MLP and output head; not the embedding
lookup, positions or norms), the factor 6 is forward (2) plus backward (4), and ``12 L s h`` is
the attention score and value products (causal masking is not discounted). Recompute is not
counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from megatronish.model.spec import ModelSpec
from megatronish.plan.devices import gpu_for_cuda_name


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in matmuls (per full model)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    mlp = (3 if spec.is_llama else 2) * h * spec.ffn_hidden_size
    return spec.num_layers * (attn + mlp) + spec.padded_vocab_size * h


def flops_per_token(spec: ModelSpec) -> float:
    """Model FLOPs per trained token (see module docstring)."""
    return 6.0 * matmul_params(spec) + 12.0 * spec.num_layers * spec.seq_length * spec.hidden_size


def count_parameters(spec: ModelSpec) -> int:
    """Total parameters of the full model (a tied head counted once)."""
    h, L = spec.hidden_size, spec.num_layers
    norm = h if spec.is_llama else 2 * h
    bias = 0
    if spec.bias:  # qkv + proj + fc1 (gate|up for llama) + fc2
        fc1 = (2 if spec.is_llama else 1) * spec.ffn_hidden_size
        bias = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + h + fc1 + h
    per_layer = matmul_params(spec) - spec.padded_vocab_size * h
    total = per_layer + L * (2 * norm + bias) + norm + spec.padded_vocab_size * h
    if not spec.tie_embeddings:
        total += spec.padded_vocab_size * h
    if not spec.is_llama:
        total += spec.max_position_embeddings * h
    return total


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
