"""Start-up for NCCL: the error-handling environment set before the groups exist, and every
group described by its name (checked on gloo, which keeps the same ``group_desc``)."""

import os

import pytest
import torch
import torch.distributed as dist

from megatronish.distributed.launch import LaunchEnv, init_process_group, nccl_error_env
from megatronish.distributed.topology import Topology
from megatronish.testing.multiproc import run_world


@pytest.mark.parametrize(
    "env, added",
    [
        ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {}),  # the user's choice stays
        ({"NCCL_ASYNC_ERROR_HANDLING": "3"}, {}),  # also under torch's older name
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": ""}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
    ],
)
def test_the_nccl_error_env(env, added):
    assert nccl_error_env(env) == added


@pytest.mark.parametrize(
    "device, user, seen", [("cuda", None, "2"), ("cuda", "3", "3"), ("cpu", None, None)]
)
def test_the_env_is_set_before_the_nccl_groups_start(device, user, seen, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", user or "unset")  # restored afterwards
    if user is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    calls = []

    def start(**kwargs):
        calls.append((kwargs["backend"], os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))

    monkeypatch.setattr(dist, "init_process_group", start)
    launch = LaunchEnv("torchrun", 0, 2, 0, "127.0.0.1", 29500, None)
    init_process_group(
        launch, torch.device(device, 0) if device == "cuda" else torch.device(device), 30.0
    )
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    assert calls == [(backend, seen)]


def _descriptions(rank, world):
    described = {}
    # every group kind has two or more members once
    shapes = ((2, 1, 1, 2, 1, 1), (1, 1, 2, 2, 1, 1), (1, 2, 1, 2, 1, 1), (1, 1, 4, 1, 2, 1))
    for tp, cp, dp, pp, ep, a2a, shard in (
        *((*s, None) for s in shapes),
        (1, 4, 1, 1, 1, 2, None),
        (1, 1, 4, 1, 1, 1, 2),
    ):
        topo = Topology.build(
            tp=tp,
            dp=dp,
            pp=pp,
            rank=rank,
            timeout_s=30.0,
            cp=cp,
            ep=ep,
            cp_a2a=a2a,
            zero_shard=shard,
        )
        for name, group in topo.groups.items():
            if group.pg is not None:
                described.setdefault(name, set()).add(group.pg.group_desc)
    dist.barrier()  # rank 0 holds the store: it leaves only once every group is made
    return described


def test_every_group_is_described_by_its_name():
    """NCCL's reports carry the description: ``[PG ID 2 PG GUID 5(tp) Rank 1] ...``."""
    names = {
        n: {n} for n in ("tp", "cp", "dp", "pp", "mp", "embedding", "ep", "cp_a2a", "zero_replica")
    }
    for described in run_world(_descriptions, 4, timeout=120):
        # without cp the dp x cp group is the dp group itself (no second communicator), without
        # ep the expert-data-parallel group is the dp x cp group, and without a2a_ring the ring
        # is the cp group, and without hybrid sharding the shard group is the dp x cp group
        assert described == {
            **names,
            "dp_cp": {"dp", "dp_cp"},
            "zero_shard": {"dp", "dp_cp", "zero_shard"},
            "edp": {"dp", "dp_cp", "edp"},
            "cp_ring": {"cp", "cp_ring"},
            "world": {"default_pg"},
        }
