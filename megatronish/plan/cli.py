"""Command line of the planner (see ``megatronish/plan/__main__.py``)."""

from __future__ import annotations

import sys

from megatronish.config.validate import config_errors
from megatronish.plan.advise_cli import ADVISE_OPTIONS, OPTION_HINTS, unused_advise_options

PLAN_OPTIONS = {"device_memory_gb": float, "peak_tflops": float, "step_time_s": float,
                **ADVISE_OPTIONS}  # fmt: skip


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
    peak = options.get("peak_tflops") or cfg.trainer.peak_tflops
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
