"""ZeRO 0-3 over dp 2 and 4, and inside the 8-rank 3D layout, with clipping active."""

import pytest

from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import train_layout

CLIP = ["optimizer.grad_clip=0.3"]  # below the grad norms of these runs: clipping is active
REFERENCE: dict[str, list] = {}


def reference(arch):
    if arch not in REFERENCE:
        REFERENCE[arch] = [train_layout(0, 1, [*CLIP, f"model.arch={arch}"])]
    return REFERENCE[arch]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_dp_matches_serial(stage, dp):
    ref = reference("llama")
    got = run_world(train_layout, dp, [*CLIP, f"parallel.zero_stage={stage}"])
    assert_parity(ref, got)
    assert min(ref[0].grad_norms) > 0.3  # clipping really happened every step


# The 3D layout at ZeRO 0 is test_pp_parity's 3D case. gpt2 (embedding and head tied across
# the first and last stage) runs every sharding stage; llama the one that shards the most.
ZERO_3D = [("gpt2", 1), ("gpt2", 2), ("gpt2", 3), ("llama", 3)]


@pytest.mark.parametrize("arch,stage", ZERO_3D)
def test_zero_in_3d_layout_matches_serial(arch, stage):
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.sp=true"]
    got = run_world(
        train_layout,
        8,
        [*CLIP, f"model.arch={arch}", f"parallel.zero_stage={stage}", *layout],
        timeout=300,
    )
    assert_parity(reference(arch), got)  # with every rank's global grad norm


def test_zero3_keep_gathered_matches_serial():
    got = run_world(
        train_layout, 2, [*CLIP, "parallel.zero_stage=3", "parallel.zero3_keep_gathered=true"]
    )
    assert_parity(reference("llama"), got)
