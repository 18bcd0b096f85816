"""A rank that dies or runs a different schedule: the others fail within the collective timeout
with an error naming the group and the op, instead of hanging."""

import multiprocessing as mp

import pytest
import torch

from megatronish.distributed.comm import (
    CollectiveError,
    ParallelGroup,
    all_gather_into,
    all_reduce,
    describe_failure,
    irecv,
)
from megatronish.distributed.launch import LaunchEnv, init_process_group
from megatronish.distributed.topology import Topology
from megatronish.testing.multiproc import free_port, run_world
from megatronish.testing.runs import build_trainer

TIMEOUT = 2.0  # seconds: the tp / dp / pp groups of these worlds
WORLD_TIMEOUT = 3 * TIMEOUT  # the default group, where rank 1 waits: rank 0 times out first


def _error_of(fn) -> str:
    try:
        fn()
    except CollectiveError as e:
        return str(e)
    return "no error"


def _diverged(rank, world, op):
    """Rank 0 runs ``op`` on a group of both ranks; rank 1 waits in a collective of the world."""
    pp = 2 if op == "recv" else 1
    topo = Topology.build(tp=1, dp=world // pp, pp=pp, rank=rank, timeout_s=TIMEOUT)
    t = torch.ones(4)
    if rank == 1:
        return _error_of(lambda: all_reduce(torch.ones(1), topo.world_group))
    if op == "all_reduce":
        return _error_of(lambda: all_reduce(t, topo.dp_group))
    if op == "async all_reduce":
        return _error_of(lambda: all_reduce(t, topo.dp_group, async_op=True).wait())
    if op == "async all_gather":
        out = torch.empty(8)
        return _error_of(lambda: all_gather_into(out, t, topo.dp_group, async_op=True).wait())
    return _error_of(lambda: irecv(t, topo.pp_group, 1).wait())


@pytest.mark.parametrize(
    "op, expected",
    [
        ("all_reduce", "all_reduce on group dp (ranks [0, 1]) timed out after 2 s"),
        ("async all_reduce", "all_reduce on group dp (ranks [0, 1]) timed out after 2 s"),
        ("async all_gather", "all_gather on group dp (ranks [0, 1]) timed out after 2 s"),
        ("recv", "recv from rank 1 on group pp (ranks [0, 1]) timed out after 2 s"),
    ],
)
def test_a_diverged_schedule_times_out_with_the_group_and_op_named(op, expected):
    waited, other = run_world(_diverged, 2, op, collective_timeout=WORLD_TIMEOUT, timeout=60)
    assert waited.startswith(f"{expected}: a peer rank died or runs a different schedule"), waited
    assert "parallel.collective_timeout_s" in waited
    # The other rank is released too: its own wait times out or sees rank 0 leave.
    assert other.startswith("all_reduce on group world (ranks [0, 1]) "), other


def _train_until(rank, world, steps, then_wait):
    trainer = build_trainer(rank, world, [f"parallel.collective_timeout_s={TIMEOUT}"], steps=4)
    trainer.cfg.trainer.max_steps = steps[rank]
    error = _error_of(trainer.fit)
    if rank == 1 and then_wait:  # e.g. waiting for a final checkpoint save while rank 0 trains
        error = _error_of(lambda: all_reduce(torch.ones(1), trainer.topo.world_group))
    return error, trainer.state.step


def test_a_rank_that_stops_early_ends_the_others_training():
    (error, step), (_, other_step) = run_world(
        _train_until, 2, {0: 4, 1: 2}, False, collective_timeout=WORLD_TIMEOUT, timeout=60
    )
    assert other_step == 2 and step == 2  # rank 0 fails inside step 3
    # Rank 1's sockets close when it exits: rank 0 learns at once (or, if rank 1 is slow to go,
    # at its timeout); either way the message names the group and the op.
    assert error.startswith("all_reduce on group dp (ranks [0, 1]) "), error
    assert "a peer rank exited or crashed" in error or "a peer rank died" in error


def test_a_rank_waiting_elsewhere_makes_the_others_time_out():
    (error, step), (other, _) = run_world(
        _train_until, 2, {0: 4, 1: 2}, True, collective_timeout=WORLD_TIMEOUT, timeout=60
    )
    assert step == 2
    assert error.startswith("all_reduce on group dp (ranks [0, 1]) timed out after 2 s"), error
    assert other.startswith("all_reduce on group world (ranks [0, 1]) "), other


def _start_alone(port, conn):
    launch = LaunchEnv("torchrun", 0, 2, 0, "127.0.0.1", port, None)
    conn.send(_error_of(lambda: init_process_group(launch, torch.device("cpu"), TIMEOUT)))


def test_a_rank_that_never_joins_fails_the_start_up_within_the_timeout():
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    port = free_port()
    proc = ctx.Process(target=_start_alone, args=(port, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the start-up did not give up"
        error = parent.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    assert error.startswith("starting the gloo process group (rank 0 of 2, master 127.0.0.1:")
    assert "failed within 2 s: not every rank joined" in error


def test_failure_messages_name_group_op_and_cause():
    group = ParallelGroup("tp", (4, 5), 0, timeout_s=30.0)
    timed_out = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "30000ms for recv operation to complete\nframe #0: ..."
    )
    assert describe_failure(group, "all_gather", timed_out) == (
        "all_gather on group tp (ranks [4, 5]) timed out after 30 s: a peer rank died or runs a "
        "different schedule; the first error is in the other ranks' logs "
        "(parallel.collective_timeout_s sets the limit) "
        "[Timed out waiting 30000ms for recv operation to complete]"
    )
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5000")
    assert describe_failure(group, "broadcast", closed).startswith(
        "broadcast on group tp (ranks [4, 5]) failed: a peer rank exited or crashed"
    )
    other = RuntimeError("output tensor size must be equal to world_size times input size")
    assert describe_failure(group, "all_gather", other) == (
        "all_gather on group tp (ranks [4, 5]) failed: output tensor size must be equal to "
        "world_size times input size"
    )


def test_the_entry_point_exits_6_with_one_line(monkeypatch, capsys):
    import megatronish.train as entry
    from megatronish.config.compose import load_config

    def run(cfg, stop=None, launch=None):
        raise CollectiveError("all_reduce on group dp (ranks [0, 1]) timed out after 2 s: ...")

    monkeypatch.setattr(entry, "run", run)
    assert entry.main_with_config(load_config(["trainer.device=cpu"])) == entry.EXIT_COMM == 6
    err = capsys.readouterr().err
    assert err == "error: all_reduce on group dp (ranks [0, 1]) timed out after 2 s: ...\n"
