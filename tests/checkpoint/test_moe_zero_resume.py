"""Resuming experts whose stacks a ZeRO range cuts (expert data parallelism edp >= 2).

A ZeRO shard of an expert bucket may end inside an ``[experts, ...]`` stack, even inside one
expert, and an ep rank's stack starts at a global expert other than 0: the loader then reads
the stack piece by piece, each to the global expert it belongs to. Every state is compared
tensor by tensor, gathered to global names here without the checkpoint code (ZeRO all-gathers
over the bucket's group, tp shards joined, ep stacks concatenated): what the run held when it
saved, what the checkpoint's files hold (assembled from their pieces at their offsets), and what
a resumed run holds right after the load, in the layout that saved and in others.
"""

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from megatronish.checkpoint.format import read_metadata
from megatronish.checkpoint.load import load_into
from megatronish.distributed.comm import all_gather_dim0, all_gather_into
from megatronish.tensor_parallel.sharding import param_info
from megatronish.testing import runs
from megatronish.testing.compare import assert_same_norms, max_relative_loss_gap, param_gaps
from megatronish.testing.multiproc import run_world

STOP, END = 3, 6  # the straight run saves at step STOP and trains on to END
# Three blocks: an expert bucket of ZeRO 1 (every block's experts) then ends inside a stack too.
MOE = [
    "model.num_layers=3",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    f"scheduler.decay_steps={END}",
]
# Saved by 2 ep ranks of 2 experts each, their ZeRO 3 shards over edp = 2 ending halfway
# through local expert 0 of fc1 (global expert 2 on ep rank 1).
SAVER = (4, ["parallel.ep=2", "parallel.zero_stage=3"])


@torch.no_grad()
def global_state(trainer) -> dict[str, torch.Tensor]:
    """``kind/name`` -> the global tensor of every param (collective): ``param`` the model's
    values, ``model`` the fp32 main params (what a checkpoint's ``model/`` holds), ``exp_avg``
    and ``exp_avg_sq`` Adam's moments."""
    zero, opt, topo = trainer.zero, trainer.optimizer, trainer.topo
    for i in range(len(trainer.chunks)):
        zero.gather(i)  # zero 3 keeps shards between steps
    out = {}
    for i, b in enumerate(zero.buckets):
        flats = {"param": b.param_flat.float()}
        shards = {"model": b.main_shard, "exp_avg": opt.exp_avg[i], "exp_avg_sq": opt.exp_avg_sq[i]}
        for kind, shard in shards.items():
            flats[kind] = shard.to(b.device)
            if zero.zero_stage.shards_optimizer_state:
                flats[kind] = torch.empty(b.numel, device=b.device)
                all_gather_into(flats[kind], shard.to(b.device).contiguous(), b.group)
        for (name, p), offset in zip(b.params, b.offsets):
            info = param_info(p)
            if info.tied_to:
                continue
            for kind, flat in flats.items():
                t = flat[offset : offset + p.numel()].view(p.shape).clone()
                if info.shard is not None and topo.tp > 1:
                    shards_ = all_gather_dim0(t.unsqueeze(0), topo.tp_group).unbind(0)
                    t = info.shard.join(list(shards_))
                if info.experts is not None:  # ep ranks hold consecutive experts
                    t = all_gather_dim0(t, topo.ep_group)
                out[f"{kind}/{name}"] = t.cpu()
    zero.release_all()
    return out


def expert_cuts(trainer) -> list[tuple[str, int, float]]:
    """``(param, first global expert, position in local experts)`` of every edge of this rank's
    ZeRO range that falls inside an expert stack (1.5: halfway through local expert 1)."""
    cuts = []
    for b in trainer.zero.buckets:
        if not b.expert:
            continue
        for edge in trainer.zero.owned_range(b):
            for (name, p), offset in zip(b.params, b.offsets):
                if offset < edge < offset + p.numel():
                    per_expert = math.prod(p.shape[1:])
                    cuts.append((name, param_info(p).experts.first, (edge - offset) / per_expert))
    return cuts


def _saving(layout, ckpt_dir):
    return [*MOE, *layout, f"checkpoint.dir={ckpt_dir}", f"checkpoint.interval={STOP}"]


def _straight(rank, world, layout, ckpt_dir):
    """Train to END, saving at STOP; returns the state gathered as the save began, the final
    state (rank 0), the losses and grad norms, and the expert cuts."""
    overrides = _saving(layout, ckpt_dir)
    trainer = runs.build_trainer(rank, world, overrides, END, saving=True)
    at_save = {}
    save = trainer.saver.save

    def gathered_then_saved(*args, **kwargs):
        at_save.update(global_state(trainer))
        return save(*args, **kwargs)

    trainer.saver.save = gathered_then_saved
    history = trainer.fit()
    final = global_state(trainer)
    keep = rank == 0
    return {
        "at_save": at_save if keep else {},
        "final": final if keep else {},
        "losses": [r.loss for r in history],
        "norms": [r.grad_norm for r in history],
        "cuts": expert_cuts(trainer),
    }


def _resumed(rank, world, layout, step_dir):
    """Load ``step_dir`` and train to END; every rank's state right after the load, the final
    state (rank 0), the losses and grad norms, and the expert cuts."""
    trainer = runs.build_trainer(rank, world, [*MOE, *layout], END, checkpoint_rng=True)
    load_into(trainer.checkpoint_parts, step_dir)
    loaded = global_state(trainer)
    history = trainer.fit()
    final = global_state(trainer)
    return {
        "loaded": loaded,
        "final": final if rank == 0 else {},
        "losses": [r.loss for r in history],
        "norms": [r.grad_norm for r in history],
        "cuts": expert_cuts(trainer),
    }


# The ranks' configs composed before they fork (they inherit them).
_straight.prepare_in_parent = lambda world, layout, ckpt_dir: runs.test_config(
    _saving(layout, ckpt_dir), END
)
_resumed.prepare_in_parent = lambda world, layout, step_dir: runs.test_config([*MOE, *layout], END)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The saver's layout trained straight to END, its checkpoint at STOP."""
    ckpt_dir = tmp_path_factory.mktemp("moe_zero_resume")
    world, layout = SAVER
    ranks = run_world(_straight, world, layout, str(ckpt_dir), timeout=300)
    return ranks, os.path.join(str(ckpt_dir), f"step_{STOP:07d}")


def assert_equal_states(want: dict, got: dict, where: str) -> None:
    assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
    wrong = [name for name, t in want.items() if not torch.equal(got[name], t)]
    assert not wrong, f"{where}: {len(wrong)} tensors differ, e.g. {wrong[:4]}"


def assert_cut_mid_expert(cuts_of_ranks: list, first_nonzero: bool) -> None:
    """Some rank's ZeRO range ends inside one expert (not at a row of the stack); with
    ``first_nonzero``, inside a stack starting beyond global expert 0."""
    cuts = [c for cuts in cuts_of_ranks for c in cuts]
    mid = [(n, first) for n, first, at in cuts if at != int(at)]
    assert mid, f"no ZeRO range ends inside an expert: {cuts}"
    if first_nonzero:
        assert any(first > 0 for _, first in mid), cuts


def test_the_checkpoint_holds_the_saved_state_at_global_experts(straight):
    """Every tensor assembled from its pieces at their offsets (each element written once)
    equals the run's state as the save began, so each expert lies at its global index."""
    ranks, step_dir = straight
    assert_cut_mid_expert([r["cuts"] for r in ranks], first_nonzero=True)
    saved = ranks[0]["at_save"]
    meta = read_metadata(step_dir)
    files, assembled = {}, {}
    for name, entry in meta.tensors.items():
        whole = torch.full(entry.shape, float("nan"))
        for shard in entry.shards:
            if shard.file not in files:
                files[shard.file] = load_file(os.path.join(step_dir, shard.file))
            view = whole
            for dim, (start, length) in enumerate(shard.offsets):
                view = view.narrow(dim, start, length)
            assert view.isnan().all(), f"{name}: {shard.offsets} written twice"
            view.copy_(files[shard.file][shard.key])
        assert not whole.isnan().any(), f"{name}: elements no shard holds"
        assembled[name] = whole
    assert_equal_states(
        {k: v for k, v in saved.items() if not k.startswith("param/")}, assembled, "files"
    )


def test_same_layout_resume_restores_every_expert_and_continues_bit_identically(straight):
    ranks, step_dir = straight
    world, layout = SAVER
    resumed = run_world(_resumed, world, layout, step_dir, timeout=300)
    saved = ranks[0]["at_save"]
    for rank, run in enumerate(resumed):
        assert_equal_states(saved, run["loaded"], f"rank {rank} after the load")
    assert resumed[0]["losses"] == ranks[0]["losses"][STOP:]
    for rank, run in enumerate(resumed):
        assert run["norms"] == ranks[rank]["norms"][STOP:], rank
    assert_equal_states(ranks[0]["final"], resumed[0]["final"], "the final state")


@pytest.mark.parametrize(
    "world, layout, first_nonzero",
    [
        # ep 2 -> 1, dp 4 -> 2, ZeRO 3 -> 1: edp 2, the moments' halves end at a global expert
        (2, ["parallel.zero_stage=1"], False),
        # ZeRO 3 -> 1 over the same ranks: the buckets span every block's experts and end
        # inside expert 2 of ep rank 1's stack
        (4, ["parallel.ep=2", "parallel.zero_stage=1"], True),
    ],
    ids=["ep1-dp2-zero1", "ep2-dp4-zero1"],
)
def test_resharded_resume_restores_every_expert(straight, world, layout, first_nonzero):
    """Another layout reads the same values (copies: bit for bit) and trains on like the
    saver's run, to parity tolerance."""
    ranks, step_dir = straight
    resumed = run_world(_resumed, world, layout, step_dir, timeout=300)
    if first_nonzero:
        assert_cut_mid_expert([r["cuts"] for r in resumed], first_nonzero=True)
    else:
        assert any(r["cuts"] for r in resumed), "no ZeRO range ends inside an expert stack"
    saved = ranks[0]["at_save"]
    for rank, run in enumerate(resumed):
        assert_equal_states(saved, run["loaded"], f"rank {rank} after the load")
    gap = max_relative_loss_gap(ranks[0]["losses"][STOP:], resumed[0]["losses"])
    assert gap < 1e-5, f"per-step loss differs by {gap:.2e} relative"
    for run in resumed:
        assert_same_norms(ranks[0]["norms"][STOP:], run["norms"])
    params = {n: t for n, t in ranks[0]["final"].items() if n.startswith("param/")}
    got = {n: t for n, t in resumed[0]["final"].items() if n.startswith("param/")}
    model_gap, worst = param_gaps(params, got)
    assert model_gap < 1e-4 and worst < 1e-3, (model_gap, worst)
