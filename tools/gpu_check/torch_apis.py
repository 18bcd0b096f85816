"""The torch APIs the GPU check and megatronish's CUDA paths call, with the first torch release
that has each in the form we call it (``tests/tools/test_torch_apis.py`` holds the list to the
installed torch, the pyproject floor and the GPU machine's torch).

Read from the sources and type stubs of torch's released wheels 2.6.0 to 2.12.0
(``torch/_C/_VariableFunctions.pyi``, the operator schemas in ``libtorch_cpu``, the Python
modules) and the installed 2.13. ``since`` (2, 6) means "in 2.6, the oldest release read": most
of these are older. ``params``: the parameter names our calls rely on, by keyword or by position.
``detector``: what decides, on the torch at hand, whether (or how) the API is called, as
``module:attribute``; None where the path calls it whenever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_MACHINE_TORCH = (2, 11)  # /work/shared/PLATFORM.md: the air-gapped GPU node's torch
OLDEST_READ = (2, 6)


@dataclass(frozen=True)
class TorchAPI:
    name: str  # dotted from ``torch``; ``torch.ops.aten.op.overload`` for an operator overload
    since: tuple[int, int]
    where: str  # who calls it
    params: tuple[str, ...] = ()
    detector: str | None = None


VARLEN = "gpu_check.documents:varlen_call"
GROUPED = "megatronish.moe.grouped_mm:use_grouped_mm"
FUSED_RMS = "megatronish.model.rms_norm:fused_backward_on"

APIS = (
    # -- the check (tools/gpu_check) ----------------------------------------------------------
    TorchAPI("torch.nn.attention.varlen.varlen_attn", (2, 10), "documents", detector=VARLEN),
    TorchAPI(
        "torch.nn.attention.varlen.varlen_attn",
        (2, 11),
        "documents: causal as window_size=(-1, 0)",
        ("window_size",),
        VARLEN,
    ),
    TorchAPI(
        "torch.nn.attention.varlen.varlen_attn",
        (2, 12),
        "documents: grouped K/V heads",
        ("enable_gqa",),
        VARLEN,
    ),
    TorchAPI("torch.nn.attention.sdpa_kernel", (2, 6), "flash, resume", ("backends",)),
    TorchAPI("torch.nn.attention.SDPBackend.FLASH_ATTENTION", (2, 6), "flash"),
    TorchAPI("torch.nn.attention.SDPBackend.MATH", (2, 6), "resume"),
    TorchAPI("torch.profiler.profile", (2, 6), "flash", ("activities",)),
    TorchAPI("torch.profiler.ProfilerActivity.CUDA", (2, 6), "flash"),
    TorchAPI("torch.cuda.set_sync_debug_mode", (2, 6), "syncs", ("debug_mode",)),
    TorchAPI("torch.use_deterministic_algorithms", (2, 6), "resume", ("warn_only",)),
    TorchAPI("torch.is_deterministic_algorithms_warn_only_enabled", (2, 6), "resume"),
    TorchAPI("torch.utils.deterministic.fill_uninitialized_memory", (2, 6), "resume, trainer"),
    TorchAPI("torch.cuda.max_memory_allocated", (2, 6), "memory, recompute, moe_experts"),
    TorchAPI("torch.cuda.reset_peak_memory_stats", (2, 6), "every section's release"),
    TorchAPI("torch.cuda.memory_allocated", (2, 6), "memory, moe_experts"),
    TorchAPI("torch.cuda.empty_cache", (2, 6), "every section's release"),
    TorchAPI("torch.cuda.synchronize", (2, 6), "timings", ("device",)),
    TorchAPI("torch.cuda.get_device_properties", (2, 6), "report, sizing"),
    TorchAPI("torch.cuda.get_device_name", (2, 6), "peak table"),
    TorchAPI("torch.backends.cudnn.version", (2, 6), "report"),
    # -- attention on CUDA (megatronish/context_parallel, testing/reference_gpt) ---------------
    TorchAPI(
        "torch.nn.functional.scaled_dot_product_attention",
        (2, 6),
        "attention_kernel.sdpa, the reference",
        ("attn_mask", "dropout_p", "is_causal", "enable_gqa"),
    ),
    TorchAPI(
        "torch.nn.attention.flex_attention.flex_attention",
        (2, 6),
        "document_attention (CUDA)",
        ("block_mask", "enable_gqa"),
    ),
    TorchAPI(
        "torch.nn.attention.flex_attention.create_block_mask",
        (2, 6),
        "document_attention (CUDA)",
        ("mask_mod", "B", "H", "Q_LEN", "KV_LEN", "device", "_compile"),
    ),
    TorchAPI("torch.nn.attention.bias.causal_lower_right", (2, 6), "context_parallel.attention"),
    TorchAPI(
        "torch.backends.cuda.SDPAParams",
        (2, 6),
        "attention_kernel: seven arguments (enable_gqa last), six where TypeError",
        detector="megatronish.context_parallel.attention_kernel:torch_checks",
    ),
    TorchAPI("torch.backends.cuda.can_use_flash_attention", (2, 6), "attention_kernel"),
    TorchAPI("torch.backends.cuda.can_use_efficient_attention", (2, 6), "attention_kernel"),
    TorchAPI(
        "torch.ops.aten._scaled_dot_product_flash_attention.default",
        (2, 6),
        "ring_kernel (CUDA flash block): 9 outputs",
        ("query", "key", "value", "dropout_p", "is_causal"),
    ),
    TorchAPI(
        "torch.ops.aten._scaled_dot_product_flash_attention_backward.default",
        (2, 6),
        "ring_kernel (CUDA flash block)",
        ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"),
    ),
    # -- fp8, grouped GEMMs, norms, the optimizer ----------------------------------------------
    TorchAPI("torch.float8_e4m3fn", (2, 6), "tensor_parallel.fp8"),
    TorchAPI("torch.float8_e5m2", (2, 6), "tensor_parallel.fp8"),
    TorchAPI(
        "torch.ops.aten._scaled_mm.default",
        (2, 6),
        "tensor_parallel.fp8, moe.fp8_grouped",
        ("scale_a", "scale_b", "out_dtype"),
    ),
    TorchAPI(
        "torch.ops.aten._scaled_grouped_mm.default",
        (2, 7),
        "moe.fp8_grouped (trainer.fp8 with MoE experts)",
        ("scale_a", "scale_b", "offs", "out_dtype"),
    ),
    TorchAPI("torch.ops.aten._grouped_mm.default", (2, 8), "moe.grouped_mm", ("offs",), GROUPED),
    TorchAPI(
        "torch.ops.aten.mm.dtype",
        (2, 8),
        "model.linear_cross_entropy: fp32 output",
        ("out_dtype",),
        "megatronish.model.linear_cross_entropy:HAS_FP32_OUTPUT_MM",
    ),
    TorchAPI(
        "torch.ops.aten._fused_rms_norm.default",
        (2, 9),
        "model.rms_norm: normalized_shape a list",
        ("normalized_shape", "weight", "eps"),
        FUSED_RMS,
    ),
    TorchAPI(
        "torch.ops.aten._fused_rms_norm_backward.default",
        (2, 9),
        "model.rms_norm",
        ("rstd", "output_mask"),
        FUSED_RMS,
    ),
    TorchAPI("torch.nn.functional.rms_norm", (2, 6), "model.rms_norm", ("eps",)),
    TorchAPI(
        "torch.ops.aten._fused_adamw_.default",
        (2, 6),
        "optim.sharded_adamw",
        ("lr", "beta1", "beta2", "weight_decay", "eps", "amsgrad", "maximize"),
    ),
    TorchAPI(
        "torch.backends.cuda.matmul.fp32_precision",
        (2, 9),
        "training.precision",
        detector="megatronish.training.precision:has_fp32_precision_api",
    ),
    TorchAPI("torch.get_autocast_dtype", (2, 6), "model.linear_cross_entropy"),
    # -- torch.compile and dynamo ---------------------------------------------------------------
    TorchAPI(
        "torch.compile",
        (2, 6),
        "model.compile, flex attention",
        ("fullgraph", "backend", "dynamic"),
    ),
    TorchAPI("torch.nn.Module.compile", (2, 6), "the compiled reference"),
    TorchAPI("torch._dynamo.exc.Unsupported", (2, 6), "model.compile"),
    TorchAPI(
        "torch._dynamo.config.fail_on_recompile_limit_hit",
        (2, 7),
        "model.compile (trainer.compile): 2.6 names it fail_on_cache_limit_hit",
    ),
    TorchAPI(
        "torch._dynamo.assume_constant_result",
        (2, 6),
        "attention_kernel sets the _dynamo_marked_constant it sets",
        ("fn",),
    ),
    TorchAPI(
        "torch._compile._disable_dynamo", (2, 6), "distributed.comm, moe.fp8_grouped", ("fn",)
    ),
    TorchAPI("torch.compiler.is_compiling", (2, 6), "attention_kernel, distributed.comm"),
    # -- CUDA streams, events and RNG (checkpoint host copies, the RNG tracker) -----------------
    TorchAPI("torch.cuda.Stream", (2, 6), "checkpoint.host_copies", ("device",)),
    TorchAPI("torch.cuda.stream", (2, 6), "checkpoint.host_copies", ("stream",)),
    TorchAPI("torch.cuda.Event", (2, 6), "checkpoint.host_copies", ("blocking",)),
    TorchAPI(
        "torch.cuda.current_stream",
        (2, 6),
        "checkpoint.host_copies, data_parallel.offload",
        ("device",),
    ),
    TorchAPI("torch.cuda.get_rng_state", (2, 6), "tensor_parallel.random", ("device",)),
    TorchAPI("torch.cuda.set_rng_state", (2, 6), "tensor_parallel.random", ("new_state", "device")),
    TorchAPI("torch.cuda.get_device_capability", (2, 6), "moe, fp8, attention_kernel"),
)
# Paths that call an API newer than the pyproject floor without a detector: a torch between the
# floor and ``since`` fails there (tests/tools/test_torch_apis.py keeps this exact).
# (None since the floor is 2.7: torch._scaled_grouped_mm and fail_on_recompile_limit_hit arrived
# there.)
FLOOR_GAPS: dict[str, str] = {}
