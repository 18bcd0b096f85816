"""The named-GPU table: lookups by planner name and by CUDA device name, the peaks MFU uses,
and the planner's ``device=NAME`` option (pure: no processes, no GPU)."""

import re
from pathlib import Path

import pytest
import torch

from megatronish.plan import devices
from megatronish.plan.cli import main as plan_main
from megatronish.plan.cli import split_options, with_device
from megatronish.plan.devices import GPUS, UnknownDevice, gpu_for_cuda_name, gpu_named
from megatronish.training import peaks

TINY_ADVISE = ["+experiment=tiny", "world_size=2", "advise=true", "top=2"]
GPT_1B = ["+experiment=gpt_1b", "model.vocab_size=32000", "world_size=8"]


def test_the_table_holds_the_required_gpus_with_consistent_numbers():
    names = [g.name for g in GPUS]
    assert len(names) == len(set(names))
    assert {"h100", "h200", "a100", "a100-40gb"} <= set(names)
    for g in GPUS:
        assert g.bf16_tflops > g.tf32_tflops > 0 and g.fp32_tflops > 0, g.name
        assert 0 < g.usable_gib < g.memory_gb, g.name
        assert 0.5 < g.memory_tbps < 10, g.name  # TB/s, not GB/s
        assert g.fp8_tflops is None or g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, 0.02)
    h100 = gpu_named("h100")
    assert (h100.bf16_tflops, h100.fp32_tflops, h100.memory_gb) == (989.0, 67.0, 80)
    assert (h100.peak_tflops("fp8"), gpu_named("a100").fp8_tflops) == (1979.0, None)
    with pytest.raises(ValueError, match="no fp8 tensor cores"):
        gpu_named("a100").peak_tflops("fp8")
    assert gpu_named("a100-40gb").memory_gb == 40 and gpu_named("h200").memory_gb == 141
    assert (h100.memory_tbps, gpu_named("h200").memory_tbps) == (3.35, 4.8)


def test_the_docs_table_is_the_code_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| `[a-z0-9-]+`( \(`|\s\|)", line)]
    documented = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        documented[cells[0].split("`")[1]] = cells[1:]
    expected = {
        g.name: [
            g.title,
            f"{g.fp8_tflops:g}" if g.fp8_tflops else "-",
            f"{g.bf16_tflops:g}",
            f"{g.tf32_tflops:g}",
            f"{g.fp32_tflops:g}",
            f"{g.memory_gb:g} GB",
            f"{g.memory_tbps:g}",
            f"{g.usable_gib:g}",
        ]
        for g in GPUS
    }
    assert documented == expected


@pytest.mark.parametrize("text", ["h100", "H100", " h100-SXM ", "H100_SXM"])
def test_planner_names_are_case_insensitive_with_aliases(text):
    assert gpu_named(text).name == "h100"


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownDevice) as e:
        gpu_named("h900")
    assert "'h900'" in str(e.value)
    assert all(g.name in str(e.value) for g in GPUS)


@pytest.mark.parametrize(
    "cuda_name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", None),  # not an L40S
        ("NVIDIA GH200 480GB", None),  # not an H200
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_cuda_device_names_find_the_most_specific_entry(cuda_name, expected):
    gpu = gpu_for_cuda_name(cuda_name)
    assert (gpu.name if gpu else None) == expected


def test_peak_per_precision():
    a100 = gpu_named("a100")
    assert a100.peak_tflops("bf16") == 312.0
    assert a100.peak_tflops("fp32") == 19.5 and a100.peak_tflops("fp32", tf32=True) == 156.0
    with pytest.raises(ValueError, match="fp8"):
        a100.peak_tflops("fp8")


def test_mfu_peak_comes_from_the_same_table(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(peaks, "tf32_matmuls", lambda: False)
    assert peaks.device_peak_flops(cuda, "bf16", None) == 989e12
    assert peaks.device_peak_flops(cuda, "fp32", None) == 67e12
    assert peaks.device_peak_flops(cuda, "bf16", 100.0) == 100e12  # configured wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    assert peaks.device_peak_flops(cuda, "bf16", None) is None


def test_device_option_is_split_and_fills_only_what_is_not_given():
    overrides, options = split_options(["+experiment=gpt_1b", "device=H100", "peak_tflops=500"])
    assert overrides == ["+experiment=gpt_1b"]
    assert options == {"device": "H100", "peak_tflops": 500.0}
    filled, gpu = with_device(options, "bf16")
    assert gpu.name == "h100"
    assert filled["peak_tflops"] == 500.0 and filled["device_memory_gb"] == gpu.usable_gib
    assert with_device({"device": "a100"}, "fp32")[0]["peak_tflops"] == 19.5
    assert with_device({"device": "a100"}, "fp32", tf32=True)[0]["peak_tflops"] == 156.0
    assert with_device({"top": 3}, "bf16") == ({"top": 3}, None)


def test_plain_planner_with_a_named_device(capsys):
    assert plan_main([*GPT_1B, "device=h100"]) == 0
    out = capsys.readouterr().out
    assert "device h100: H100 SXM 80GB" in out and "79 GiB and 989 TFLOP/s per device" in out
    assert "device 79.00 GiB: fits" in out
    big = [*GPT_1B, "parallel.tp=1", "parallel.sp=false", "trainer.micro_batch_size=16"]
    assert plan_main([*big, "device=a100-40gb"]) == 1  # ~69 GiB per rank does not fit


def test_unknown_device_is_exit_2_listing_the_known_ones(capsys):
    assert plan_main([*GPT_1B, "device=h900"]) == 2
    err = capsys.readouterr().err
    assert "device=h900" in err and "h100, h100-pcie" in err and "a100-40gb" in err
    assert plan_main([*TINY_ADVISE, "device=tpu"]) == 2


def test_advise_with_a_named_device_uses_its_memory_and_peak(capsys, monkeypatch):
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert plan_main(TINY_ADVISE) == 2  # no peak known on a machine without a GPU
    assert "device=NAME" in capsys.readouterr().err
    assert plan_main([*TINY_ADVISE, "device=h200", "trainer.precision=bf16"]) == 0
    out = capsys.readouterr().out
    assert "device h200: H200 SXM 141GB" in out
    assert "139.00 GiB per device" in out and "989 TFLOP/s peak" in out
    assert plan_main([*TINY_ADVISE, "device=h200", "device_memory_gb=20"]) == 0
    assert "20.00 GiB per device" in capsys.readouterr().out
