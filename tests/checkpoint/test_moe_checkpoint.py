"""Mixture-of-experts checkpoints: experts stored by global expert index, saved at one
ep / tp / pp / ZeRO layout and loaded at any other, continuing the run of one process."""

import pytest

from megatronish.checkpoint.format import CheckpointError, read_metadata, resolve_step_dir
from megatronish.checkpoint.load import load_into
from megatronish.testing.compare import assert_parity
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout

STOP, END = 3, 6  # runs save at step STOP and resume to END; the LR decays over END steps
MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.router.z_loss_coef=0.001",
    f"scheduler.decay_steps={END}",
    "trainer.micro_batch_size=2",
]
_REF = {}


def reference():
    if "ref" not in _REF:
        _REF["ref"] = [train_layout(0, 1, MOE, END)]
    return _REF["ref"]


def run(world, layout, steps, load=None, save=None):
    args = ([*MOE, *layout], steps, load, save)
    if world == 1:
        return [train_layout(0, 1, *args)]
    return run_world(train_layout, world, *args, timeout=300)


@pytest.mark.parametrize(
    "first, second",
    [
        ((2, ["parallel.ep=2", "parallel.zero_stage=1"]), (1, [])),
        ((1, []), (4, ["parallel.ep=4", "parallel.zero_stage=3"])),
        (
            (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true"]),
            (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=2"]),
        ),
    ],
    ids=["ep2zero1-1", "1-ep4zero3", "ep2tp2-ep2pp2zero2"],
)
def test_experts_reshard_on_load_and_the_run_continues(tmp_path, first, second):
    (wa, a), (wb, b) = first, second
    saved = run(wa, a, STOP, save=str(tmp_path))
    resumed = run(wb, b, END, load=str(tmp_path))
    joined = losses_of(saved) + losses_of(resumed)
    norms = saved[0].grad_norms + resumed[0].grad_norms
    ref = reference()
    got = [type(ref[0])(losses=joined, grad_norms=norms, params=merge_params(resumed))]
    assert_parity(ref, got)


def test_experts_are_keyed_by_global_index(tmp_path):
    """Each ep rank writes its experts' rows of one [experts, ...] tensor per block."""
    saved = run(2, ["parallel.ep=2"], 1, save=str(tmp_path))
    meta = read_metadata(resolve_step_dir(str(tmp_path)))
    assert meta.layout["ep"] == 2
    entry = meta.tensors["model/layers.0.mlp.experts.fc1"]
    assert entry.shape == [4, 2 * 128, 64]  # 4 experts of gate|up (expert ffn 128) x hidden 64
    # rank 0: experts 0-1, rank 1: experts 2-3; the gate and the up block a piece each
    assert sorted(s.offsets[0] for s in entry.shards) == [[0, 2], [0, 2], [2, 2], [2, 2]]
    assert meta.tensors["model/layers.0.mlp.router"].shape == [4, 64]
    _check_expert_pieces(str(tmp_path), meta, merge_params(saved))


def test_routing_changes_are_refused_unless_allowed(tmp_path):
    run(1, [], 1, save=str(tmp_path))
    trainer = build_trainer(0, 1, [*MOE, "model.moe.top_k=1"], 2)
    with pytest.raises(
        CheckpointError,
        match=r"model.moe.top_k: checkpoint 2, config 1.*"
        r"allow_model_changes=\[moe.top_k\]",
    ):
        load_into(trainer.checkpoint_parts, str(tmp_path))
    allowed = [*MOE, "model.moe.top_k=1", "checkpoint.allow_model_changes=[moe.top_k]"]
    load_into(build_trainer(0, 1, allowed, 2).checkpoint_parts, str(tmp_path))
    dense = build_trainer(0, 1, [m for m in MOE if not m.startswith("model.moe")], 2)
    with pytest.raises(CheckpointError, match="model.moe.num_experts: checkpoint 4, config 0"):
        load_into(dense.checkpoint_parts, str(tmp_path))


def _check_expert_pieces(ckpt_dir, meta, gathered):
    """Every expert piece (params and Adam moments) lies at its writer's global experts: file
    ``*-rank0000r`` holds rows ``[2r, 2r + 2)`` of the stack; and the stored params, put
    together from the pieces at their offsets, are the experts gathered over ep by rank."""
    import os

    import torch
    from safetensors.torch import load_file

    step_dir = resolve_step_dir(ckpt_dir)
    files = {}
    names = [n for n in meta.tensors if ".mlp.experts." in n]
    assert len(names) == 4 * 2 * 3  # fc1, fc2 of four blocks: params, exp_avg, exp_avg_sq
    for name in names:
        entry = meta.tensors[name]
        whole = torch.full(entry.shape, float("nan"))
        for s in entry.shards:
            rank = int(s.file.split("-rank")[1].split(".")[0])
            assert s.offsets[0] == [2 * rank, 2], (name, s.file, s.offsets)
            if s.file not in files:
                files[s.file] = load_file(os.path.join(step_dir, s.file))
            piece = files[s.file][s.key]
            view = whole
            for dim, (start, length) in enumerate(s.offsets):
                view = view.narrow(dim, start, length)
            assert view.isnan().all(), (name, s.offsets)  # no piece written twice
            view.copy_(piece)
        assert not whole.isnan().any(), name  # every row of every expert written
        if name.startswith("model/"):
            assert torch.equal(whole, gathered[name.removeprefix("model/")]), name
