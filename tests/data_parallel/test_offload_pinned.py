"""Optimizer offload's pinned host memory: one slab per kind, sliced per bucket, and the planner's
host bytes equal torch's pinned-allocator rule applied to what offload asks for."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatronish.data_parallel import offload
from megatronish.data_parallel.pinned_memory import pinned_block_bytes
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.testing.runs import test_config as tiny_config

REQUESTS: list[tuple[int, torch.dtype, bool]] = []  # (numel, dtype, pinned) per host slab


@pytest.fixture
def recorded(monkeypatch):
    """Every host slab offload asks for, recorded (and taken unpinned: CPU has no pinned
    allocator). Forked ranks inherit the patch and return their own records."""
    real = offload._host_empty

    def record(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        REQUESTS.append((numel, dtype, pin))
        return real(numel, dtype, False)

    monkeypatch.setattr(offload, "_host_empty", record)
    REQUESTS.clear()
    yield
    REQUESTS.clear()


def test_pinned_block_bytes_is_the_next_power_of_two():
    sizes = [0, 1, 2, 3, 4095, 4096, 4097, 3 * 2**30, 2**33, 2**33 + 1, 10**12]
    expected = [0, 1, 2, 4, 4096, 4096, 8192, 2**32, 2**33, 2**34, 2**40]
    assert [pinned_block_bytes(n) for n in sizes] == expected


def test_the_rule_is_the_one_in_torchs_caching_host_allocator():
    """The installed torch's allocator still rounds each request with ``PowerOf2Ceil`` unless an
    opt-in threshold (unset by default) says otherwise: a torch that changes the rule fails
    here, not in a user's host memory."""
    header = Path(torch.__file__).parent / "include/ATen/core/CachingHostAllocator.h"
    if not header.exists():
        pytest.skip(f"torch {torch.__version__} ships without its C++ headers")
    source = header.read_text()
    assert "c10::llvm::PowerOf2Ceil(size)" in source
    assert "allocate_host_memory(roundSize, &ptr)" in source  # the rounded size is pinned
    if "pinned_max_round_threshold()" in source:  # torch 2.13: opt-in, unlimited by default
        config = header.parents[2] / "c10/core/AllocatorConfig.h"
        text = config.read_text()
        for name in ("pinned_max_round_threshold_", "pinned_max_cached_size_"):
            assert f"size_t {name}{{std::numeric_limits<size_t>::max()}};" in text


def _offload_requests(rank, world, overrides):
    trainer = build_trainer(rank, world, overrides, 1)
    held = trainer.zero.state_bytes()
    held["optimizer"] = trainer.optimizer.state_bytes()
    return list(REQUESTS), held, len(trainer.zero.buckets)


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.zero_stage=1", "trainer.precision=bf16", "parallel.bucket_size_mb=0.05"],
        ["parallel.zero_stage=3"],
    ],
    ids=["zero1-bf16-small-buckets", "zero3-fp32"],
)
def test_offload_pins_one_slab_per_kind_and_the_plan_is_what_torch_pins(layout, recorded):
    overrides = [*layout, "parallel.optimizer_offload=true"]
    cfg = tiny_config(overrides, 1)
    states = make_plan(spec_of(cfg), layout_from_config(cfg, 2)).stages[0].states
    requests, held, buckets = run_world(_offload_requests, 2, overrides)[0]
    bf16 = "trainer.precision=bf16" in layout
    assert buckets > 1  # several buckets, sliced out of each slab
    kinds = [torch.float32, torch.float32] + ([torch.bfloat16] if bf16 else [])
    assert [(n, dtype) for n, dtype, _ in requests] == [(states.owned_numel, t) for t in kinds]
    assert not any(pin for _, _, pin in requests)  # CPU: pageable, nothing rounds it
    asked = [n * dtype.itemsize for n, dtype, _ in requests]
    assert held["host"] == sum(asked)
    pinned = sum(pinned_block_bytes(b) for b in asked)  # what a GPU rank pins for them
    assert pinned > sum(asked)  # the tiny model's slabs are no powers of two: rounding shows
    assert states.host == pinned + held["optimizer"]  # the Adam moments: pageable, exact


def test_on_a_gpu_the_slabs_are_pinned_and_counted_as_torch_rounds_them(recorded):
    """Buckets on a CUDA device (only their ``device`` is read; no GPU needed): offload asks for
    pinned slabs, sliced per bucket in order, and reports the rounded bytes."""
    values = [torch.arange(n, dtype=torch.float32) for n in (3, 5, 7)]
    cuda = torch.device("cuda")
    buckets = [SimpleNamespace(device=cuda, main_shard=v) for v in values]
    owned = [(0, 3), (3, 8), (8, 15)]
    host = offload.OptimizerOffload(buckets, owned, torch.bfloat16, offload.ImmediateTransfers())
    assert [(n, dtype, pin) for n, dtype, pin in REQUESTS] == [
        (15, torch.float32, True),
        (15, torch.float32, True),
        (15, torch.bfloat16, True),
    ]
    assert host.host_bytes() == 64 + 64 + 32  # 60, 60 and 30 bytes asked for
    for b, v in zip(buckets, values):
        assert torch.equal(b.main_shard, v)  # the initial values, now in the main slab
        assert b.main_shard.untyped_storage().data_ptr() == host.slabs["main"].data_ptr()
    assert [host.grads[id(b)].numel() for b in buckets] == [3, 5, 7]
