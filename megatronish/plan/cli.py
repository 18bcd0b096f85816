"""``python -m megatronish.plan [+experiment=NAME] [key=value ...] [world_size=N] [options]``.

Takes the same overrides as ``megatronish.train`` (every key: docs/config.md) and prints, without
allocating anything, what every rank of the layout will hold and do: parameters, bytes of
params, grads, optimizer state and activations, FLOPs, communication per group and the pipeline
bubble. Its own options (not training keys, listed below and in docs/config.md) give the ranks,
the device to fit and a step time to rate; ``advise=true`` ranks every valid layout that fits
instead and can write the fastest as a ``parallel`` group file (docs/performance.md, "Choosing a
layout"). For a mixture-of-experts model the plan also prints active and total parameters, the
experts each rank holds (and their share of its states) and the all-to-all volume
(docs/planning.md).

Exit codes: 0 fits (or no memory given), 1 does not fit, 2 invalid config or option (one line
on stderr per problem; a key or option given twice is one); with ``advise=true``: 0 a layout
fits, 1 none fits, 2 invalid config or options.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from megatronish.config.cli_errors import repeated_keys_reason
from megatronish.config.compose import parse_bool
from megatronish.config.option_docs import help_text, options_help
from megatronish.config.schema import TrainConfig
from megatronish.config.validate import ConfigError
from megatronish.config.value_rules import config_notes
from megatronish.plan.devices import GiB, GPUModel, UnknownDevice, gpu_named, local_gpu
from megatronish.plan.option_docs import ADVISOR_OPTION_DOCS, DEFAULT_TOP, PLAN_OPTION_DOCS
from megatronish.plan.step_time import Hardware

ADVISE_OPTIONS = {
    "advise": parse_bool,
    "gpus_per_node": int,
    "intra_node_gbps": float,
    "inter_node_gbps": float,
    "network_gbps": float,
    "latency_us": float,
    "efficiency": float,
    "memory_gbps": float,
    "top": int,
    "advise_out": str,
}
# What a value should look like, for the message about a bad one.
OPTION_HINTS = {
    "advise": "true or false, e.g. advise=true",
    "gpus_per_node": "a whole number, e.g. gpus_per_node=8",
    "top": "a whole number, e.g. top=10",
    "device_memory_gb": "GiB per device, e.g. device_memory_gb=80",
    "peak_tflops": "TFLOP/s per device, e.g. peak_tflops=989",
    "step_time_s": "seconds per step, e.g. step_time_s=8",
    "efficiency": "a fraction of peak, e.g. efficiency=0.5",
    "latency_us": "microseconds, e.g. latency_us=5",
    "memory_gbps": "GB/s of memory bandwidth per device, e.g. memory_gbps=3350",
    "network_gbps": "Gb/s per GPU across nodes, e.g. network_gbps=100 (Ethernet)",
}
# Options that must be > 0 (all numeric options must be finite).
POSITIVE = (
    "device_memory_gb",
    "peak_tflops",
    "step_time_s",
    "gpus_per_node",
    "top",
    "intra_node_gbps",
    "inter_node_gbps",
    "network_gbps",
    "efficiency",
    "memory_gbps",
)


class OptionError(ValueError):
    """A planner option (``key=value``) that is not a value of its type."""


def unused_advise_options(options: dict) -> list[str]:
    """Advisor options given without ``advise=true`` (they would do nothing)."""
    if options.get("advise"):
        return []
    return [k for k in options if k in ADVISE_OPTIONS and k != "advise"]


def tf32_allowed(cfg: TrainConfig) -> bool:
    """Whether the config lets fp32 matmuls use TF32 tensor cores (``trainer.tf32``)."""
    return bool(cfg.trainer.get("tf32", False))


def peak_tflops_of(options: dict, cfg: TrainConfig) -> float | None:
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
    inter_node = default.inter_node_bw
    if "network_gbps" in options:  # bits per second of the link
        inter_node = options["network_gbps"] * 1e9 / 8
    return Hardware(
        peak_flops=default.peak_flops,
        efficiency=options.get("efficiency", default.efficiency),
        memory_bw=options.get("memory_gbps", default.memory_bw / 1e9) * 1e9,
        gpus_per_node=options.get("gpus_per_node", default.gpus_per_node),
        intra_node_bw=options.get("intra_node_gbps", default.intra_node_bw / 1e9) * 1e9,
        inter_node_bw=options.get("inter_node_gbps", inter_node / 1e9) * 1e9,
        latency_s=options.get("latency_us", default.latency_s * 1e6) * 1e-6,
    )


def _hint(key: str) -> str:
    return OPTION_HINTS.get(key, f"a number, e.g. {key}=80")


def option_errors(options: dict) -> list[str]:
    """Every planner option value that cannot be planned with (empty: all usable)."""
    errors = []
    for key, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{key}={value} is not a finite number; give {_hint(key)}")
        elif key in POSITIVE and value <= 0:
            errors.append(f"{key}={value} must be > 0; give {_hint(key)}")
    if options.get("efficiency", 0.5) > 1:
        errors.append(f"efficiency={options['efficiency']} is a fraction of peak: at most 1")
    if "network_gbps" in options and "inter_node_gbps" in options:
        errors.append(
            f"network_gbps={options['network_gbps']:g} and inter_node_gbps="
            f"{options['inter_node_gbps']:g} both set the inter-node bandwidth (Gb/s of the link, "
            "GB/s per direction): give one"
        )
    if options.get("latency_us", 0) < 0:
        errors.append(f"latency_us={options['latency_us']} must be >= 0")
    out = options.get("advise_out")
    if out is not None and (not out.strip() or Path(out).is_dir()):
        errors.append(f"advise_out={out!r} must name a file, e.g. configs/parallel/advised.yaml")
    return errors


def _fail(lines: list[str]) -> int:
    print(ConfigError(lines), file=sys.stderr)
    return 2


def _refuse_options(lines: list[str]) -> int:
    print(str(ConfigError(lines)).replace("invalid config", "invalid option", 1), file=sys.stderr)
    return 2


def advise_main(cfg: TrainConfig, overrides: list[str], options: dict) -> int:
    """Run the advisor on a composed config (see the module docstring)."""
    from megatronish.plan.advisor import advise
    from megatronish.plan.candidates import base_errors
    from megatronish.plan.devices import local_device_memory, runtime_bytes_for
    from megatronish.plan.layout import spec_of
    from megatronish.plan.report import advice_report, write_parallel_file
    from megatronish.plan.vocab import VocabError, planned_vocab

    world = cfg.world_size
    errors = []
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
    errors += base_errors(cfg)
    if errors:
        return _fail(errors)
    try:
        vocab = planned_vocab(cfg)
    except VocabError as e:
        return _fail([str(e)])
    if errors := base_errors(cfg, vocab.tokenizer or vocab.size):
        return _fail(errors)
    hw = hardware(options, peak)
    top = options.get("top", DEFAULT_TOP)
    spec = spec_of(cfg, vocab.size)
    advice = advise(cfg, spec, world, hw, device_bytes, runtime, top)
    if not advice.valid:
        return _fail(
            [
                f"no layout of {world} ranks is valid for this model and batch (tp must divide the "
                f"heads and divide or be divided by the kv heads, pp*vpp the layers, and "
                f"dp*micro batch the global batch {cfg.trainer.global_batch_size}); try another "
                f"world_size or global batch",
            ]
        )
    if not advice.ranked:
        print(
            f"none of the {advice.valid} valid layouts of {world} ranks fits in "
            f"{device_bytes / GiB:.2f} GiB per device (runtime {runtime / GiB:.2f} GiB "
            f"included); the smallest needs {advice.least_peak / GiB:.2f} GiB + runtime: "
            "use more or larger devices, or a smaller micro batch / model",
            file=sys.stderr,
        )
        return 1
    print(advice_report(advice, hw, top, world, device_bytes, runtime, vocab))
    if "advise_out" in options:
        best = advice.ranked[0]
        summary = (
            f"The fastest layout that fits, by `python -m megatronish.plan ... advise=true`: "
            f"{best.time.total:.3g} s per step estimated."
        )
        path = Path(options["advise_out"])
        try:
            command = write_parallel_file(path, best.layout, overrides, summary)
        except OSError as e:
            return _refuse_options(
                [f"advise_out={path}: cannot write it ({e.strerror or e}); choose a writable path"]
            )
        print(f"\nwrote {path}: {best.layout.describe()}\nrun it with: {command}")
    return 0


PLAN_OPTIONS = {
    "device_memory_gb": float,
    "peak_tflops": float,
    "step_time_s": float,
    "device": str,
    **ADVISE_OPTIONS,
}


def split_options(argv: list[str]) -> tuple[list[str], dict[str, float]]:
    """Hydra overrides and the planner's own ``key=value`` options; raises
    :class:`OptionError` for an option value that is not of its type."""
    overrides, options = [], {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in PLAN_OPTIONS:
            try:
                options[key] = PLAN_OPTIONS[key](value)
            except ValueError:
                raise OptionError(f"{arg}: expected {_hint(key)}") from None
        else:
            overrides.append(arg)
    return overrides, options


def world_size_errors(cfg: TrainConfig) -> list[str]:
    """``world_size=N`` given but not a number of ranks."""
    if cfg.world_size is not None and cfg.world_size < 1:
        return [f"world_size={cfg.world_size} must be >= 1 (the number of ranks to plan for)"]
    return []


def with_device(options: dict, precision: str, tf32: bool = False) -> tuple[dict, GPUModel | None]:
    """``options`` with ``device_memory_gb``, ``peak_tflops`` (for ``precision``; ``tf32``:
    fp32 matmuls may use TF32), ``memory_gbps`` and ``network_gbps`` (unless the inter-node
    bandwidth is given as ``inter_node_gbps``) taken from ``device=NAME`` where not given
    explicitly, and the named GPU. Raises :class:`~megatronish.plan.devices.UnknownDevice`."""
    if "device" not in options:
        return options, None
    gpu = gpu_named(options["device"])
    filled = {
        "device_memory_gb": gpu.usable_gib,
        "peak_tflops": gpu.peak_tflops(precision, tf32),
        "memory_gbps": gpu.memory_tbps * 1e3,
    }
    if "inter_node_gbps" not in options:
        filled["network_gbps"] = gpu.network_gbps
    return {**filled, **options}, gpu


def fp8_peak(gpu: GPUModel) -> str:
    return "" if gpu.fp8_tflops is None else f", {gpu.fp8_tflops:g} fp8"


def device_line(gpu: GPUModel, options: dict) -> str:
    """What ``device=NAME`` stands for, and the values the plan uses."""
    return (
        f"device {gpu.name}: {gpu.title} (datasheet: {gpu.memory_gb:g} GB at "
        f"{gpu.memory_tbps:g} TB/s, dense TFLOP/s {gpu.bf16_tflops:g} bf16, "
        f"{gpu.tf32_tflops:g} tf32, {gpu.fp32_tflops:g} fp32{fp8_peak(gpu)}); "
        f"planning with {options['device_memory_gb']:g} GiB and {options['peak_tflops']:g} "
        "TFLOP/s per device"
    )


def _parse(argv: list[str]) -> tuple[object, list[str], dict] | int:
    """``(config, overrides, options)`` of the command line, or the exit code after saying why
    it cannot be planned."""
    from megatronish.config.cli_errors import composition_error_reason
    from megatronish.config.compose import load_config

    try:
        overrides, options = split_options(argv)
    except OptionError as e:
        return _refuse_options([str(e)])
    if (repeated := repeated_keys_reason([a for a in argv if a not in overrides])) is not None:
        return _refuse_options([repeated])
    if (repeated := repeated_keys_reason(overrides)) is not None:
        return _fail([repeated])
    if errors := option_errors(options):
        return _refuse_options(errors)
    try:
        cfg = load_config(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types; one line out
        print(f"invalid config: {composition_error_reason(e, PLAN_OPTIONS)}", file=sys.stderr)
        return 2
    if errors := world_size_errors(cfg):
        return _fail(errors)
    if unused := unused_advise_options(options):
        print(f"{', '.join(unused)}: options of the advisor; add advise=true", file=sys.stderr)
        return 2
    return cfg, overrides, options


EXAMPLES = (
    "python -m megatronish.plan +experiment=gpt_7b model.vocab_size=32000 world_size=64 "
    "parallel.tp=4 parallel.pp=2 device=h100 step_time_s=8",
    "python -m megatronish.plan +experiment=gpt_1b model.vocab_size=32000 world_size=8 "
    "device=h200 advise=true advise_out=configs/parallel/advised.yaml",
)


def plan_help() -> str:
    """What ``--help`` prints: the module docstring, every option, examples."""
    sections = [
        options_help(
            "Options (key=value; any other key=value overrides the training config):",
            PLAN_OPTION_DOCS,
        ),
        options_help(
            "Advisor options (with advise=true; device, device_memory_gb and "
            "peak_tflops apply too):",
            ADVISOR_OPTION_DOCS,
        ),
    ]
    return help_text(__doc__, sections, EXAMPLES)


def main(argv: list[str]) -> int:
    """Plan (or advise); returns the exit code (see the module docstring)."""
    from megatronish.plan.devices import local_device_memory, runtime_bytes_for
    from megatronish.plan.estimate import make_plan
    from megatronish.plan.layout import layout_from_config, spec_of
    from megatronish.plan.report import plan_report
    from megatronish.plan.rules import planning_errors

    if any(a in ("-h", "--help", "help") for a in argv):
        print(plan_help(), end="")
        return 0
    parsed = _parse(argv)
    if isinstance(parsed, int):
        return parsed
    cfg, overrides, options = parsed
    try:
        options, gpu = with_device(options, cfg.trainer.precision, tf32_allowed(cfg))
    except UnknownDevice as e:
        print(f"invalid option device={options['device']}: {e}", file=sys.stderr)
        return 2
    if gpu is not None:
        print(device_line(gpu, options))
    if options.get("advise"):
        return advise_main(cfg, overrides, options)
    p = cfg.parallel
    world = cfg.world_size or p.tp * p.cp * p.pp * (p.dp or 1)
    errors, vocab = planning_errors(cfg, world)
    if errors:
        return _fail(errors)
    for note in config_notes(cfg):  # as the trainer says them at start-up
        print(f"note: {note}")
    spec = spec_of(cfg, vocab.size)
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
            vocab=vocab,
            device_bytes=device_bytes,
            runtime_bytes=runtime,
            peak_flops=peak * 1e12 if peak else None,
            step_time_s=options.get("step_time_s"),
        )
    )
    return 0 if device_bytes is None or plan.fits(device_bytes, runtime) else 1
