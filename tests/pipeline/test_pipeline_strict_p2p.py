"""Strict p2p on CPU: a send completes only once the peer received it, as on NCCL. The batched
engine runs under it with the results of plain gloo; the old one-op-at-a-time order hangs."""

import time

import pytest
import torch

from megatronish.distributed.p2p import BatchedP2P, Transfer
from megatronish.distributed.topology import Topology
from megatronish.pipeline.engine import (
    forward_backward_pipeline,
    forward_only_pipeline,
)
from megatronish.pipeline.grouping import training_steps
from megatronish.pipeline.nccl_sim import P2P
from megatronish.testing.multiproc import WorldError, run_world
from megatronish.testing.p2p_sequences import one_op_at_a_time, planned_groups
from megatronish.testing.runs import build_trainer
from megatronish.testing.strict_p2p import StrictP2P
from megatronish.testing.tiny_pipeline import SHAPE as ENGINE_SHAPE
from megatronish.testing.tiny_pipeline import tiny_batches, tiny_chunks

SHAPE = (4, 2, 8)
TIMEOUT_S = 3.0  # the pipeline group's collective timeout where a test expects a hang


def code(message) -> float:
    kind, mb, chunk = message
    return float(("act", "grad").index(kind) * 10_000 + mb * 100 + chunk)


def fill(op: P2P) -> float:
    return code(op.message) if op.kind == "send" else -1.0  # a receive must overwrite it


def _replay(rank, world, groups, strict, timeout_s=30.0, wait_sends=True):
    """Post ``groups[rank]`` (simulator entries) for real; the codes of what each receive got.

    ``wait_sends=False`` waits for a group of sends only at the end, as the engine did before
    batching (its receives it waited for at once)."""
    topo = Topology.build(tp=1, dp=1, pp=world, rank=rank, timeout_s=timeout_s)
    comm = (StrictP2P if strict else BatchedP2P)(topo.pp_group)
    got, unwaited = [], []
    for group in groups[rank]:
        transfers = [
            Transfer(op.kind, op.peer, torch.full(op.shape, fill(op)), op.message) for op in group
        ]
        work = comm.post(transfers)
        if wait_sends or any(t.kind == "recv" for t in transfers):
            work.wait()
        else:
            unwaited.append(work)
        got += [(t.message, t.tensor.flatten()[0].item()) for t in transfers if t.kind == "recv"]
    for work in unwaited:
        work.wait()
    return got


def delivered_intact(results) -> bool:
    return all(value == code(msg) for got in results for msg, value in got)


def assert_hung(error: WorldError, pp: int) -> None:
    """Every rank stuck in a p2p group, none finished. The rank whose timeout fires first exits;
    on a loaded machine a peer may see its connection close before its own timeout fires."""
    assert set(error.errors) == set(range(pp)), error
    group = f"on group pp (ranks {list(range(pp))})"
    for why in error.errors.values():
        assert "CollectiveError" in why and "p2p group [" in why and group in why, why
        assert "timed out" in why or "a peer rank exited or crashed" in why, why
    assert any("timed out" in why for why in error.errors.values()), error


def test_old_posting_runs_on_plain_gloo():
    groups = one_op_at_a_time(2, 1, 4, SHAPE)
    assert delivered_intact(run_world(_replay, 2, groups, False, wait_sends=False, timeout=30))


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (2, 2, 4)])
def test_old_posting_hangs_under_strict_mode(pp, vpp, m):
    start = time.monotonic()
    with pytest.raises(WorldError) as e:
        run_world(
            _replay,
            pp,
            one_op_at_a_time(pp, vpp, m, SHAPE),
            True,
            TIMEOUT_S,
            wait_sends=False,
            timeout=30,
        )
    assert time.monotonic() - start < TIMEOUT_S + 15
    assert_hung(e.value, pp)
    assert "p2p group [send" in e.value.errors[0]  # rank 0 is stuck in a send


def test_a_gloo_send_waits_for_the_receive_so_the_old_order_waited_op_by_op_hangs():
    with pytest.raises(WorldError) as e:
        run_world(_replay, 2, one_op_at_a_time(2, 1, 4, SHAPE), False, TIMEOUT_S, timeout=30)
    assert_hung(e.value, 2)


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (2, 2, 4), (4, 1, 6), (4, 2, 8)])
def test_planned_groups_complete_under_strict_mode(pp, vpp, m):
    assert delivered_intact(
        run_world(_replay, pp, planned_groups(training_steps, pp, vpp, m, SHAPE), True, timeout=60)
    )


def test_strict_mode_catches_a_swapped_pair():
    a, b = ("act", 0, 0), ("act", 1, 0)
    groups = {
        0: [[P2P("send", 1, a, (2,)), P2P("send", 1, b, (2,))]],
        1: [[P2P("recv", 0, b, (2,)), P2P("recv", 0, a, (2,))]],
    }
    (got,) = run_world(_replay, 2, groups, False, timeout=30)[1:]
    assert got == [(b, code(a)), (a, code(b))]  # plain gloo swaps the tensors silently
    with pytest.raises(WorldError, match=r"rank 1 received \('act', 0, 0\) as \('act', 1, 0\)"):
        run_world(_replay, 2, groups, True, timeout=30)


def _engine_step(rank, world, vpp, strict, layers=4, m=4):
    topo = Topology.build(tp=1, dp=1, pp=world, rank=rank, timeout_s=30)
    chunks = tiny_chunks(rank, world, vpp, layers)
    batches, shape = tiny_batches(m), ENGINE_SHAPE
    comm = (StrictP2P if strict else BatchedP2P)(topo.pp_group)
    losses = forward_backward_pipeline(
        chunks, batches, loss_scale=1 / m, topo=topo, vpp=vpp, shape=shape, comm=comm
    )
    grads = {f"{i}.{n}": p.grad for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    evals = forward_only_pipeline(chunks, batches, topo=topo, vpp=vpp, shape=shape, comm=comm)
    return losses, grads, evals, topo.stats.summary()


@pytest.mark.parametrize(("world", "vpp"), [(2, 1), (2, 2), (4, 1)])
def test_engine_under_strict_mode_equals_plain_mode(world, vpp):
    plain = run_world(_engine_step, world, vpp, False, timeout=60)
    strict = run_world(_engine_step, world, vpp, True, timeout=60)
    for (losses, grads, evals, stats), (s_losses, s_grads, s_evals, s_stats) in zip(plain, strict):
        assert torch.equal(
            torch.stack(losses or [torch.zeros(())]), torch.stack(s_losses or [torch.zeros(())])
        )
        assert grads.keys() == s_grads.keys()
        assert all(torch.equal(grads[k], s_grads[k]) for k in grads)
        assert [e.item() for e in evals] == [e.item() for e in s_evals]
        assert stats == s_stats  # acknowledgements are not pipeline traffic
    assert len(plain[-1][0]) == 4 and len(plain[-1][2]) == 4  # the last stage holds the losses
    assert torch.allclose(torch.stack(plain[-1][0]), torch.stack(plain[-1][2]))  # eval = forward


def _trainer_posts_through(rank, world):
    made = []

    def factory(group):
        made.append(group.name)
        return BatchedP2P(group)

    trainer = build_trainer(rank, world, ["parallel.pp=2", "trainer.eval_iters=1"], 1, p2p=factory)
    trainer.valid_data = trainer.train_data
    trainer.train_step()
    trainer.evaluate()
    return made


def test_the_trainer_posts_pipeline_p2p_through_its_factory():
    for made in run_world(_trainer_posts_through, 2):
        assert made == ["pp", "pp"]  # the training step and the evaluation
