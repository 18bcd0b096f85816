"""Command line of the planner (see ``megatronish/plan/__main__.py``)."""

from __future__ import annotations

import sys

from megatronish.config.validate import config_errors
from megatronish.plan.advise_cli import (
    ADVISE_OPTIONS,
    OPTION_HINTS,
    peak_tflops_of,
    tf32_allowed,
    unused_advise_options,
)
from megatronish.plan.devices import GPUModel, UnknownDevice, gpu_named

PLAN_OPTIONS = {"device_memory_gb": float, "peak_tflops": float, "step_time_s": float,
                "device": str, **ADVISE_OPTIONS}  # fmt: skip


def split_options(argv: list[str]) -> tuple[list[str], dict[str, float]]:
    """Hydra overrides and the planner's own ``key=value`` options."""
    overrides, options = [], {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in PLAN_OPTIONS:
            try:
                options[key] = PLAN_OPTIONS[key](value)
            except ValueError:
                hint = OPTION_HINTS.get(key, f"a number, e.g. {key}=80")
                raise SystemExit(f"{arg}: expected {hint}") from None
        else:
            overrides.append(arg)
    return overrides, options


def with_device(options: dict, precision: str, tf32: bool = False) -> tuple[dict, GPUModel | None]:
    """``options`` with ``device_memory_gb`` and ``peak_tflops`` (for ``precision``; ``tf32``:
    fp32 matmuls may use TF32) taken from ``device=NAME`` where not given explicitly, and the
    named GPU. Raises :class:`~megatronish.plan.devices.UnknownDevice`."""
    if "device" not in options:
        return options, None
    gpu = gpu_named(options["device"])
    filled = {"device_memory_gb": gpu.usable_gib, "peak_tflops": gpu.peak_tflops(precision, tf32)}
    return {**filled, **options}, gpu


def device_line(gpu: GPUModel, options: dict) -> str:
    """What ``device=NAME`` stands for, and the values the plan uses."""
    return (
        f"device {gpu.name}: {gpu.title} (datasheet: {gpu.memory_gb:g} GB, dense TFLOP/s "
        f"{gpu.bf16_tflops:g} bf16, {gpu.tf32_tflops:g} tf32, {gpu.fp32_tflops:g} fp32); "
        f"planning with {options['device_memory_gb']:g} GiB and {options['peak_tflops']:g} "
        "TFLOP/s per device"
    )


def main(argv: list[str]) -> int:
    from megatronish.config.cli_errors import composition_error_reason
    from megatronish.config.compose import load_config
    from megatronish.plan.devices import local_device_memory, runtime_bytes_for
    from megatronish.plan.estimate import make_plan
    from megatronish.plan.layout import layout_from_config, spec_of
    from megatronish.plan.report import plan_report

    overrides, options = split_options(argv)
    try:
        cfg = load_config(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types; one line out
        print(f"invalid config: {composition_error_reason(e)}", file=sys.stderr)
        return 2
    if unused := unused_advise_options(options):
        print(f"{', '.join(unused)}: options of the advisor; add advise=true", file=sys.stderr)
        return 2
    try:
        options, gpu = with_device(options, cfg.trainer.precision, tf32_allowed(cfg))
    except UnknownDevice as e:
        print(f"invalid option device={options['device']}: {e}", file=sys.stderr)
        return 2
    if gpu is not None:
        print(device_line(gpu, options))
    if options.get("advise"):
        from megatronish.plan.advise_cli import advise_main

        return advise_main(cfg, overrides, options)
    p = cfg.parallel
    world = cfg.world_size or p.tp * p.pp * (p.dp or 1)
    errors = config_errors(cfg, world)
    if errors:
        print("invalid config:\n" + "\n".join(f"  - {e}" for e in errors), file=sys.stderr)
        return 2
    from megatronish.train import tokenizer_vocab_size

    spec = spec_of(cfg, tokenizer_vocab_size(cfg.data))
    layout = layout_from_config(cfg, world)
    plan = make_plan(spec, layout)
    if "device_memory_gb" in options:  # a GPU of that size
        device_bytes = int(options["device_memory_gb"] * 2**30)
        runtime = runtime_bytes_for("cuda")
    else:
        device_bytes, runtime = local_device_memory(cfg.trainer.device, world)
    peak = peak_tflops_of(options, cfg)
    print(
        plan_report(
            plan,
            device_bytes=device_bytes,
            runtime_bytes=runtime,
            peak_flops=peak * 1e12 if peak else None,
            step_time_s=options.get("step_time_s"),
        )
    )
    return 0 if device_bytes is None or plan.fits(device_bytes, runtime) else 1
