"""``python -m megatronish.plan [overrides] world_size=N advise=true [options]``: the advisor.

Options (besides the planner's ``device=NAME``, ``device_memory_gb`` and ``peak_tflops``):

- ``advise=true``: rank the layouts instead of planning the configured one;
- ``gpus_per_node=8``: devices per node (tp and dp groups within a node use NVLink);
- ``intra_node_gbps=450``, ``inter_node_gbps=50``: GB/s (bytes) per device and direction
  inside a node and across nodes (400 Gb/s InfiniBand per GPU = 50);
- ``latency_us=5``: per collective call or pipeline message;
- ``efficiency=0.5``: the fraction of peak FLOP/s the matmuls reach;
- ``top=10``: rows of the table;
- ``advise_out=PATH``: write the fastest layout as a ``parallel`` group file, e.g.
  ``configs/parallel/advised.yaml`` (then ``parallel=advised``).

Exit codes: 0 a layout fits, 1 none fits, 2 invalid config or options.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatronish.plan.devices import GiB, local_gpu
from megatronish.plan.step_time import Hardware


def parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(text)


ADVISE_OPTIONS = {
    "advise": parse_bool, "gpus_per_node": int, "intra_node_gbps": float,
    "inter_node_gbps": float, "latency_us": float, "efficiency": float, "top": int,
    "advise_out": str,
}  # fmt: skip
# What a value should look like, for the message about a bad one.
OPTION_HINTS = {
    "advise": "true or false, e.g. advise=true",
    "gpus_per_node": "a whole number, e.g. gpus_per_node=8",
    "top": "a whole number, e.g. top=10",
}


def unused_advise_options(options: dict) -> list[str]:
    """Advisor options given without ``advise=true`` (they would do nothing)."""
    if options.get("advise"):
        return []
    return [k for k in options if k in ADVISE_OPTIONS and k != "advise"]


def tf32_allowed(cfg) -> bool:
    """Whether the config lets fp32 matmuls use TF32 tensor cores (``trainer.tf32``)."""
    return bool(cfg.trainer.get("tf32", False))


def peak_tflops_of(options: dict, cfg) -> float | None:
    """Peak TFLOP/s per device: ``peak_tflops=T`` (or ``device=NAME``'s), else
    ``trainer.peak_tflops``, else this machine's GPU from the device table; None if unknown."""
    if options.get("peak_tflops"):
        return options["peak_tflops"]
    if cfg.trainer.peak_tflops:
        return cfg.trainer.peak_tflops
    gpu = local_gpu()
    return None if gpu is None else gpu.peak_tflops(cfg.trainer.precision, tf32_allowed(cfg))


def hardware(options: dict, peak_tflops: float) -> Hardware:
    """The model's inputs from the command line (defaults: an H100-class node)."""
    default = Hardware(peak_flops=peak_tflops * 1e12)
    return Hardware(
        peak_flops=default.peak_flops,
        efficiency=options.get("efficiency", default.efficiency),
        gpus_per_node=options.get("gpus_per_node", default.gpus_per_node),
        intra_node_bw=options.get("intra_node_gbps", default.intra_node_bw / 1e9) * 1e9,
        inter_node_bw=options.get("inter_node_gbps", default.inter_node_bw / 1e9) * 1e9,
        latency_s=options.get("latency_us", default.latency_s * 1e6) * 1e-6,
    )


def option_errors(options: dict) -> list[str]:
    errors = []
    for key in ("gpus_per_node", "top", "intra_node_gbps", "inter_node_gbps", "efficiency"):
        if key in options and options[key] <= 0:
            errors.append(f"{key}={options[key]} must be > 0")
    if options.get("efficiency", 0.5) > 1:
        errors.append(f"efficiency={options['efficiency']} is a fraction of peak: at most 1")
    if options.get("latency_us", 0) < 0:
        errors.append(f"latency_us={options['latency_us']} must be >= 0")
    return errors


def _fail(lines: list[str]) -> int:
    print("invalid config:\n" + "\n".join(f"  - {e}" for e in lines), file=sys.stderr)
    return 2


def advise_main(cfg, overrides: list[str], options: dict) -> int:
    """Run the advisor on a composed config (see the module docstring)."""
    from megatronish.plan.advice_report import advice_report
    from megatronish.plan.advised_config import write_parallel_file
    from megatronish.plan.advisor import advise
    from megatronish.plan.candidates import base_errors
    from megatronish.plan.devices import local_device_memory, runtime_bytes_for
    from megatronish.plan.layout import spec_of
    from megatronish.train import tokenizer_vocab_size

    world = cfg.world_size
    errors = option_errors(options)
    if not world:
        errors.append("advise=true needs world_size=N, the number of ranks to lay out")
    peak = peak_tflops_of(options, cfg)
    if not peak:
        errors.append(
            "advise=true needs the peak FLOP/s of a device: device=NAME (e.g. device=h100), "
            "peak_tflops=T (e.g. peak_tflops=989 for an H100 in bf16) or trainer.peak_tflops"
        )
    if "device_memory_gb" in options:  # a GPU of that size
        device_bytes, runtime = int(options["device_memory_gb"] * GiB), runtime_bytes_for("cuda")
    else:
        device_bytes, runtime = local_device_memory(cfg.trainer.device, world or 1)
        if device_bytes is None:
            errors.append(
                "this machine's memory is unknown: give device=NAME or device_memory_gb=G"
            )
    vocab = tokenizer_vocab_size(cfg.data)
    errors += base_errors(cfg, vocab)
    if errors:
        return _fail(errors)
    hw = hardware(options, peak)
    top = options.get("top", 10)
    spec = spec_of(cfg, vocab)
    advice = advise(cfg, spec, world, hw, device_bytes, runtime, top)
    if not advice.valid:
        return _fail([
            f"no layout of {world} ranks is valid for this model and batch (tp must divide the "
            f"heads and kv heads, pp*vpp the layers, and dp*micro batch the global batch "
            f"{cfg.trainer.global_batch_size}); try another world_size or global batch",
        ])  # fmt: skip
    if not advice.ranked:
        print(
            f"none of the {advice.valid} valid layouts of {world} ranks fits in "
            f"{device_bytes / GiB:.2f} GiB per device (runtime {runtime / GiB:.2f} GiB "
            f"included); the smallest needs {advice.least_peak / GiB:.2f} GiB + runtime: "
            "use more or larger devices, or a smaller micro batch / model",
            file=sys.stderr,
        )
        return 1
    print(advice_report(advice, hw, top, world, device_bytes, runtime))
    if "advise_out" in options:
        best = advice.ranked[0]
        summary = (
            f"The fastest layout that fits, by `python -m megatronish.plan ... advise=true`: "
            f"{best.time.total:.3g} s per step estimated."
        )
        path = Path(options["advise_out"])
        command = write_parallel_file(path, best.layout, overrides, summary)
        print(f"\nwrote {path}: {best.layout.describe()}\nrun it with: {command}")
    return 0
