"""Pipeline schedules: every rank's op list, checked exhaustively and simulated all together."""

from collections import Counter

import pytest

from megatronish.pipeline.ops import DeadlockError, DependencyError, Op, message
from megatronish.pipeline.schedule import compute_order, message_order, num_warmup, schedule_ops
from megatronish.pipeline.simulate import analytic_bubble, bubble_fraction, simulate

# Plain 1F1B takes any m >= 1, including m < pp and m not a multiple of pp.
ONE_F_ONE_B = [(pp, 1, m) for pp in range(1, 5) for m in sorted({1, 2, 3, pp, 2 * pp + 1, 4 * pp})]
# Interleaving needs m % pp == 0.
INTERLEAVED = [(pp, vpp, k * pp) for pp in range(2, 5) for vpp in (2, 3) for k in (1, 2, 3, 4)]
LARGE = [(8, 1, 5), (8, 1, 16), (8, 2, 8), (8, 3, 16)]
CONFIGS = ONE_F_ONE_B + INTERLEAVED + LARGE
IDS = [f"pp{pp}-vpp{vpp}-m{m}" for pp, vpp, m in CONFIGS]
config = pytest.mark.parametrize(("pp", "vpp", "m"), CONFIGS, ids=IDS)


def megatron_warmup(pp: int, vpp: int, m: int, rank: int) -> int:
    """Megatron-LM's warm-up arithmetic, restated independently of the module."""
    if vpp == 1:
        return min(pp - rank - 1, m)
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)


def short(ops: list[Op]) -> str:
    return " ".join(f"{op.kind[0].upper()}{op.microbatch}.{op.chunk}" for op in ops)


@config
def test_every_chunk_runs_forward_and_backward_once_on_its_rank(pp, vpp, m):
    expected = Counter((mb, c) for mb in range(m) for c in range(pp * vpp))
    for kind in ("fwd", "bwd"):
        seen = Counter()
        for rank in range(pp):
            ops = compute_order(pp, vpp, m, rank)
            assert all(op.kind in ("fwd", "bwd") and op.chunk % pp == rank for op in ops)
            seen.update((op.microbatch, op.chunk) for op in ops if op.kind == kind)
        assert seen == expected


@config
def test_backward_follows_its_forward_on_the_same_rank(pp, vpp, m):
    for rank in range(pp):
        position = {
            (op.kind, op.microbatch, op.chunk): i
            for i, op in enumerate(compute_order(pp, vpp, m, rank))
        }
        for (kind, mb, c), i in position.items():
            if kind == "bwd":
                assert position[("fwd", mb, c)] < i


@config
def test_warmup_matches_megatron_formula(pp, vpp, m):
    for rank in range(pp):
        warmup = num_warmup(pp, vpp, m, rank)
        assert warmup == megatron_warmup(pp, vpp, m, rank)
        order = compute_order(pp, vpp, m, rank)
        first_bwd = next(i for i, op in enumerate(order) if op.kind == "bwd")
        # The warm-up forwards, plus the steady state's leading forward when there is a steady state.
        assert first_bwd == min(warmup + 1, m * vpp)
        assert all(op.kind == "fwd" for op in order[:warmup])


def test_interleaved_order_follows_megatron_chunk_ids():
    # pp=2, vpp=2, m=4 on rank 0 (chunks 0 and 2): microbatches advance in groups of pp, forwards
    # visit virtual chunks 0 then 1, backwards 1 then 0; warm-up 2*(2-0-1) + (2-1)*2 = 4.
    assert short(compute_order(2, 2, 4, 0)) == (
        "F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0"
    )


def test_one_f_one_b_order():
    # pp=4, m=6 on rank 1: 2 warm-up forwards, 4 steady pairs, 2 cool-down backwards.
    assert (
        short(compute_order(4, 1, 6, 1))
        == "F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4.1 B2.1 F5.1 B3.1 B4.1 B5.1"
    )


def test_schedule_ops_places_receives_before_and_sends_after_compute():
    assert short(schedule_ops(2, 2, 2, 1)[:4]) == "R0.1 F0.1 S0.1 R1.1"
    ops = schedule_ops(2, 2, 2, 1)
    assert ops[0] == Op("recv_act", 0, 1, peer=0) and ops[2] == Op("send_act", 0, 1, peer=0)
    last = schedule_ops(2, 2, 2, 1)[
        -3:
    ]  # rank 1's final backward is chunk 1, between chunks 0 and 2
    assert last == [Op("recv_grad", 1, 1, peer=0), Op("bwd", 1, 1), Op("send_grad", 1, 1, peer=0)]


@config
def test_every_send_pairs_with_one_receive_in_message_order(pp, vpp, m):
    sends, receives = Counter(), Counter()
    sent_by_pair, received_by_pair = {}, {}
    for rank in range(pp):
        for op in schedule_ops(pp, vpp, m, rank):
            if op.kind.startswith("send"):
                sends[(rank, op.peer, message(op))] += 1
                sent_by_pair.setdefault((rank, op.peer), []).append(message(op))
            elif op.kind.startswith("recv"):
                receives[(op.peer, rank, message(op))] += 1
                received_by_pair.setdefault((op.peer, rank), []).append(message(op))
    assert sends == receives and set(sends.values()) <= {1}
    # An activation and a gradient cross each of the pp*vpp - 1 chunk boundaries per microbatch.
    assert sum(sends.values()) == 2 * m * (pp * vpp - 1)
    order = message_order(pp, vpp, m)
    assert set(order) == {(s, d) for s in range(pp) for d in range(pp) if s != d}
    for pair, messages in order.items():
        assert messages == sent_by_pair.get(pair, [])
        # NCCL matches p2p by order: the receiver's own receive order already agrees.
        assert messages == received_by_pair.get(pair, [])


@config
def test_simulation_completes_and_keeps_warmup_plus_one_activations(pp, vpp, m):
    sim = simulate(pp, vpp, m)  # raises on deadlock or on any dependency violation
    for rank in range(pp):
        assert sim.busy_time[rank] == m * vpp * (1.0 + 2.0)
        assert len(sim.timeline[rank]) == 2 * m * vpp
        assert sim.max_in_flight[rank] == min(num_warmup(pp, vpp, m, rank) + 1, m * vpp)
    if vpp == 1:
        assert sim.max_in_flight[0] == min(pp, m)


@config
def test_simulated_bubble_equals_analytic(pp, vpp, m):
    # bubble = (makespan - ideal) / ideal, ideal = m*vpp*(fwd+bwd) per rank. With comm_time = 0 it
    # equals (pp-1)/(vpp*m) exactly (all integers, so float division rounds identically) on every
    # rank, for 1F1B and interleaved alike; m < pp included.
    sim = simulate(pp, vpp, m, fwd_time=1.0, bwd_time=2.0, comm_time=0.0)
    for rank in range(pp):
        assert bubble_fraction(sim, rank) == analytic_bubble(pp, vpp, m)
    # Rank 0 is the one finishing last, so its own (finish - busy) / busy is exact too; later
    # ranks finish earlier (their tail idles until rank 0 is done).
    assert sim.finish_time[0] == max(sim.finish_time.values())
    assert (sim.finish_time[0] - sim.busy_time[0]) / sim.busy_time[0] == analytic_bubble(pp, vpp, m)


@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 1.0), (1.0, 3.0), (2.0, 3.0)])
@pytest.mark.parametrize(("pp", "vpp", "m"), [(4, 1, 8), (4, 2, 8), (3, 3, 6), (2, 2, 2)])
def test_bubble_is_exact_for_any_forward_backward_ratio(pp, vpp, m, fwd, bwd):
    sim = simulate(pp, vpp, m, fwd_time=fwd, bwd_time=bwd)
    assert bubble_fraction(sim, 0) == pytest.approx(analytic_bubble(pp, vpp, m), rel=1e-12)


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (4, 2, 8)])
def test_communication_time_only_widens_the_bubble(pp, vpp, m):
    # The analytic formula ignores p2p latency; on the critical path it can only add idle time.
    assert bubble_fraction(simulate(pp, vpp, m, comm_time=0.5), 0) > analytic_bubble(pp, vpp, m)


def test_receiving_before_sending_in_a_cycle_deadlocks():
    ops = {r: schedule_ops(2, 1, 2, r) for r in range(2)}
    # Rank 0 waits for the gradient of microbatch 0 before sending its activation: rank 1 needs
    # that activation to produce the gradient.
    recv = ops[0].index(Op("recv_grad", 0, 0, peer=1))
    ops[0].insert(1, ops[0].pop(recv))
    assert ops[0][:3] == [
        Op("fwd", 0, 0),
        Op("recv_grad", 0, 0, peer=1),
        Op("send_act", 0, 0, peer=1),
    ]
    with pytest.raises(
        DeadlockError,
        match=r"rank 0 waits on Op\(kind='recv_grad'.*rank 1 waits on Op\(kind='recv_act'",
    ):
        simulate(2, 1, 2, ops=ops)


def test_interleaved_cycle_deadlocks():
    ops = {r: schedule_ops(2, 2, 2, r) for r in range(2)}
    # Rank 1 insists on chunk 3's input (from chunk 2 on rank 0) before serving chunk 1, which
    # rank 0 needs to compute chunk 2.
    first_recv_into_3 = ops[1].index(Op("recv_act", 0, 3, peer=0))
    ops[1].insert(0, ops[1].pop(first_recv_into_3))
    with pytest.raises(DeadlockError, match="rank 0 .* rank 1"):
        simulate(2, 2, 2, ops=ops)


def test_missing_receive_is_a_dependency_error():
    ops = {r: schedule_ops(2, 1, 2, r) for r in range(2)}
    ops[1].remove(Op("recv_act", 0, 1, peer=0))
    with pytest.raises(DependencyError, match="before receiving the activation of chunk 0"):
        simulate(2, 1, 2, ops=ops)


def test_backward_before_forward_is_a_dependency_error():
    ops = {r: schedule_ops(2, 1, 1, r) for r in range(2)}
    ops[1] = [
        Op("bwd", 0, 1),
        Op("send_grad", 0, 1, peer=0),
        Op("recv_act", 0, 1, peer=0),
        Op("fwd", 0, 1),
    ]
    with pytest.raises(DependencyError, match="before its forward"):
        simulate(2, 1, 1, ops=ops)


def test_wrong_peer_is_a_dependency_error():
    ops = {r: schedule_ops(3, 1, 1, r) for r in range(3)}
    ops[1][0] = Op("recv_act", 0, 1, peer=2)
    with pytest.raises(DependencyError, match="right peer"):
        simulate(3, 1, 1, ops=ops)


def test_single_stage_has_no_messages_and_no_bubble():
    assert message_order(1, 1, 3) == {}
    assert short(schedule_ops(1, 1, 3, 0)) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert bubble_fraction(simulate(1, 1, 3), 0) == 0.0


@pytest.mark.parametrize(
    ("pp", "vpp", "m", "rank", "fragment"),
    [
        (0, 1, 4, 0, "pp=0"),
        (2, 0, 4, 0, "vpp=0"),
        (2, 1, 0, 0, "num_microbatches=0"),
        (1, 2, 4, 0, "needs pp > 1"),
        (4, 2, 6, 0, "divisible by parallel.pp=4"),
        (2, 1, 4, 2, "rank=2"),
    ],
)
def test_invalid_arguments_raise_value_error(pp, vpp, m, rank, fragment):
    with pytest.raises(ValueError, match=fragment):
        compute_order(pp, vpp, m, rank)
