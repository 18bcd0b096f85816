"""The planner's own ``key=value`` options (not training-config keys), for its ``--help`` and
docs/config.md; the defaults are read from the code that applies them."""

from __future__ import annotations

from megatronish.config.option_docs import OptionDoc
from megatronish.plan.devices import known_device_names
from megatronish.plan.step_time import Hardware

DEFAULT_TOP = 10  # rows of the advisor's table
_HW = Hardware(peak_flops=0.0)

PLAN_OPTION_DOCS = (
    OptionDoc(
        "world_size",
        "int",
        "tp * cp * pp * (parallel.dp or 1)",
        "ranks to plan for (a training-config key)",
        "N",
    ),
    OptionDoc(
        "device",
        "str",
        "",
        f"a GPU of the table ({', '.join(known_device_names())}): its memory and peak "
        "for device_memory_gb and peak_tflops unless those are given",
        "NAME",
    ),
    OptionDoc(
        "device_memory_gb",
        "float",
        "this machine's GPU, or its available RAM / ranks",
        "GiB per device to check the plan against",
        "G",
    ),
    OptionDoc(
        "peak_tflops",
        "float",
        "trainer.peak_tflops, else this machine's GPU",
        "dense TFLOP/s per device, for the MFU lines",
        "T",
    ),
    OptionDoc("step_time_s", "float", "", "report the MFU a step of S seconds would mean", "S"),
    OptionDoc(
        "advise",
        "bool",
        "false",
        "rank every valid layout of the model on world_size ranks that fits, by an "
        'estimated step time (docs/performance.md, "Choosing a layout")',
        "true",
    ),
)

ADVISOR_OPTION_DOCS = (
    OptionDoc(
        "gpus_per_node",
        "int",
        f"{_HW.gpus_per_node}",
        "devices per node (tp and dp groups within a node use NVLink)",
    ),
    OptionDoc(
        "intra_node_gbps",
        "float",
        f"{_HW.intra_node_bw / 1e9:g}",
        "GB/s per device and direction inside a node",
    ),
    OptionDoc(
        "inter_node_gbps",
        "float",
        f"{_HW.inter_node_bw / 1e9:g}",
        "GB/s per device and direction across nodes (400 Gb/s InfiniBand per GPU = 50)",
    ),
    OptionDoc(
        "network_gbps",
        "float",
        f"{_HW.inter_node_bw * 8 / 1e9:g} (device=NAME: its class's)",
        "the same as Gb/s of the link per GPU (100 for 100 Gb/s Ethernet, 400 for NDR "
        "InfiniBand); not with inter_node_gbps",
    ),
    OptionDoc(
        "latency_us",
        "float",
        f"{_HW.latency_s * 1e6:g}",
        "microseconds per collective call or pipeline message",
    ),
    OptionDoc(
        "efficiency",
        "float",
        f"{_HW.efficiency:g}",
        "the fraction of peak FLOP/s large matmuls reach (smaller ones less: "
        "megatronish/plan/matmul_efficiency.py)",
    ),
    OptionDoc(
        "memory_gbps",
        "float",
        f"{_HW.memory_bw / 1e9:g}",
        "memory bandwidth per device in GB/s, which limits small matmuls (device=NAME: "
        "its datasheet's)",
    ),
    OptionDoc("top", "int", f"{DEFAULT_TOP}", "rows of the table"),
    OptionDoc(
        "advise_out",
        "path",
        "",
        "write the fastest layout as a parallel group file, e.g. "
        "configs/parallel/advised.yaml (then parallel=advised)",
        "PATH",
    ),
)
