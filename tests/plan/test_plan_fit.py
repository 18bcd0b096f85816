"""The start-up memory check: a layout that cannot fit stops every rank before allocating,
with the changes that would fit."""

import os
import subprocess
import sys

import pytest

from megatronish.config.compose import load_config
from megatronish.distributed.launch import detect_launch
from megatronish.distributed.topology import Topology
from megatronish.plan import devices
from megatronish.plan.estimate import make_plan
from megatronish.plan.fit_check import (
    LayoutDoesNotFit,
    fitting_options,
    host_fit_error,
    memory_fit_error,
)
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import test_config as tiny_config

GiB = 2**30


@pytest.mark.slow
def test_fitting_layouts_pass_and_the_options_listed_really_fit():
    cfg = load_config(["+experiment=gpt_7b", "model.vocab_size=32000", "parallel.tp=2"])
    plan = make_plan(spec_of(cfg), layout_from_config(cfg, 8))
    runtime = devices.runtime_bytes_for("cuda")
    assert memory_fit_error(cfg, 8, 32000, plan.peak_bytes + runtime, runtime, "gpu") is None
    budget = int(plan.peak_bytes * 0.6)
    message = memory_fit_error(cfg, 8, 32000, budget, runtime, "the GPU")
    assert "does not fit" in message and "the GPU" in message
    options = fitting_options(cfg, 8, 32000, budget, runtime)
    assert options
    for overrides, peak in options:
        assert overrides in message
        new = load_config(
            ["+experiment=gpt_7b", "model.vocab_size=32000", "parallel.tp=2", *overrides.split()]
        )
        assert make_plan(spec_of(new), layout_from_config(new, 8)).peak_bytes == peak
        assert peak + runtime <= budget


def test_nothing_fits_says_so():
    cfg = tiny_config([], 1)
    message = memory_fit_error(cfg, 1, 250, 1000, 0, "a tiny device")
    assert "No combination" in message


def _check_on_every_rank(rank, world, low_rank):
    from megatronish.training.job import check_memory_fits

    if rank == low_rank:  # one host with too little free memory
        devices.available_ram_bytes = lambda meminfo=None: 64 * 2**20
    cfg = tiny_config(["model.seq_length=64"], 1)
    topo = Topology.build(tp=1, dp=world, pp=1, rank=rank)
    try:
        check_memory_fits(cfg, detect_launch(), topo, 250)
    except LayoutDoesNotFit as e:
        return str(e)
    return None


def test_every_rank_stops_when_one_rank_does_not_fit():
    messages = run_world(_check_on_every_rank, 2, 1)
    assert all(m and "does not fit" in m for m in messages), messages
    assert run_world(_check_on_every_rank, 2, -1) == [None, None]


def test_train_stops_with_the_options_instead_of_running_out_of_memory(tmp_path):
    huge = [
        "model.num_layers=48",
        "model.hidden_size=8192",
        "model.num_attention_heads=64",
        "model.seq_length=256",
        "trainer.micro_batch_size=8",
        "trainer.global_batch_size=8",
        "data.max_corpus_mb=0.5",
        "data.vocab_size=512",
        "trainer.device=cpu",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"out_dir={tmp_path / 'out'}",
    ]
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "megatronish.train", *huge],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "this layout does not fit in memory" in r.stderr
    assert "No combination" in r.stderr or "Layouts that would fit" in r.stderr
    ckpt = tmp_path / "out" / "checkpoints"  # taken for the run before the model is planned
    assert not ckpt.exists() or not [p for p in ckpt.iterdir() if p.name.startswith("step_")]


@pytest.mark.parametrize("device", ["cpu"])
def test_local_device_memory_on_cpu_shares_available_ram(device, monkeypatch):
    monkeypatch.setattr(devices, "available_ram_bytes", lambda meminfo=None: 8 * GiB)
    assert devices.local_device_memory(device, 4) == (2 * GiB, devices.RUNTIME_BYTES["cpu"])
    monkeypatch.setattr(devices, "available_ram_bytes", lambda meminfo=None: None)
    assert devices.local_device_memory(device, 4)[0] is None


def test_available_ram_reads_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert devices.available_ram_bytes(str(info)) == 2048 * 1024
    assert devices.available_ram_bytes(str(tmp_path / "missing")) is None


def test_offload_stops_before_start_when_the_host_cannot_hold_its_ranks_state():
    cfg = load_config(["+experiment=gpt_7b", "model.vocab_size=32000", "parallel.zero_stage=3"])
    assert host_fit_error(cfg, 8, 32000, 8, 2**40) is None  # offload off: nothing to check
    cfg.parallel.optimizer_offload = True
    assert host_fit_error(cfg, 8, 32000, 8, 2**40) is None
    error = host_fit_error(cfg, 8, 32000, 8, 64 * 2**30)
    # 842.5M owned elements: 4 + 4 + 2 GiB of pinned slabs (3.4, 3.4 and 1.7 GB rounded up to
    # powers of two as torch pins them) and 6.3 GiB of Adam moments
    assert error.startswith("parallel.optimizer_offload=true keeps about 16.3 GiB of host memory")
    assert "(8 rank(s) here: 130.2 GiB) but this host has 64.0 GiB available" in error
    assert "\n" not in error
