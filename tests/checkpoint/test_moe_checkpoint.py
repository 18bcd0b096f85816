"""Mixture-of-experts checkpoints: experts stored by global expert index, saved at one
ep / tp / pp / ZeRO layout and loaded at any other, continuing the run of one process."""

from dataclasses import replace

import pytest
import torch

from megatronish.checkpoint.format import CheckpointError, read_metadata, resolve_step_dir
from megatronish.checkpoint.load import load_into
from megatronish.generate.session import load_model
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


# -- the expert biases of aux-loss-free balancing -------------------------------------------
BALANCED = [*MOE, "model.moe.router.score=sigmoid", "model.moe.router.bias_update_rate=0.01"]


def test_expert_biases_are_saved_once_and_resume_in_another_layout(tmp_path):
    """Saved whole by one rank per stage, read by every rank of another layout: the resumed run
    tracks one uninterrupted process and ends with its biases bit for bit."""
    layout = ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true"]
    saved = run_world(train_layout, 4, [*BALANCED, *layout], STOP, None, str(tmp_path))
    meta = read_metadata(resolve_step_dir(str(tmp_path)))
    biases = sorted(n for n in meta.tensors if n.startswith("buffer/"))
    assert biases == [f"buffer/layers.{i}.mlp.expert_bias" for i in range(4)]
    assert all(len(meta.tensors[n].shards) == 1 for n in biases)
    resumed = train_layout(0, 1, BALANCED, END, load=str(tmp_path))
    straight = train_layout(0, 1, BALANCED, END)
    joined = losses_of(saved) + resumed.losses
    norms = saved[0].grad_norms + resumed.grad_norms
    got = [type(straight)(losses=joined, grad_norms=norms, params=resumed.params)]
    assert_parity([straight], got)
    assert resumed.buffers.keys() == straight.buffers.keys()
    for name, bias in straight.buffers.items():
        assert torch.equal(resumed.buffers[name], bias), name


def test_same_layout_resume_with_expert_biases_is_bit_identical(tmp_path):
    saved = train_layout(0, 1, BALANCED, STOP, save=str(tmp_path))
    resumed = train_layout(0, 1, BALANCED, END, load=str(tmp_path))
    straight = train_layout(0, 1, BALANCED, END)
    assert saved.losses + resumed.losses == straight.losses
    assert all(torch.equal(resumed.params[n], p) for n, p in straight.params.items())
    assert all(torch.equal(resumed.buffers[n], b) for n, b in straight.buffers.items())
    model = load_model(str(tmp_path)).model  # generation routes with the saved biases too
    for name, bias in model.named_buffers():
        assert torch.equal(bias, saved.buffers[name]), name


def test_expert_bias_changes_on_load(tmp_path):
    """A checkpoint with biases does not load into a model without them (its routing would
    change unseen); a run that turns the bias on starts it from zero, and says so."""
    train_layout(0, 1, BALANCED, 2, save=str(tmp_path / "biased"))
    plain = build_trainer(0, 1, [*MOE, "model.moe.router.score=sigmoid"], 3)
    with pytest.raises(CheckpointError, match=r"not in this model: buffer/layers.0.mlp.expert_b"):
        load_into(plain.checkpoint_parts, str(tmp_path / "biased"))
    with pytest.raises(CheckpointError, match="set model.moe.router.bias_update_rate"):
        load_into(plain.checkpoint_parts, str(tmp_path / "biased"))
    train_layout(0, 1, [*MOE, "model.moe.router.score=sigmoid"], 2, save=str(tmp_path / "plain"))
    biased = build_trainer(0, 1, BALANCED, 3)
    for layer in biased.moe_layers:
        layer.expert_bias.fill_(1.0)
    lines = []
    load_into(replace(biased.checkpoint_parts, log=lines.append), str(tmp_path / "plain"))
    assert all(not layer.expert_bias.any() for layer in biased.moe_layers)
    assert len(lines) == 1 and "holds no layers.0.mlp.expert_bias" in lines[0], lines
    assert "starting from zero" in lines[0]
