"""What the pipeline engine posts cannot hang on NCCL: its groups, recorded, replayed in the
simulator for many layouts; the old one-op-at-a-time posting order deadlocks there."""

import pytest
import torch

from megatronish.model.build import build_chunks
from megatronish.model.parallel_context import ParallelContext
from megatronish.pipeline.engine import PipelineShape
from megatronish.pipeline.grouping import forward_only_steps, training_steps, transfers_around
from megatronish.pipeline.nccl_sim import (
    P2P,
    Compute,
    DeadlockError,
    MismatchError,
    Post,
    Wait,
    run_groups,
    run_programs,
)
from megatronish.pipeline.ops import message
from megatronish.pipeline.schedule import compute_order, message_order
from megatronish.pipeline.simulate import analytic_bubble
from megatronish.spec import ModelSpec
from megatronish.testing.p2p_sequences import (
    as_p2p,
    megatron_pairs,
    one_op_at_a_time,
    planned_groups,
    planned_programs,
    step_program,
)
from megatronish.testing.recording_p2p import record_engine, stub_chunks

SHAPE = (2, 1, 3)


def send(peer, msg, shape=SHAPE):
    return P2P("send", peer, msg, shape)


def recv(peer, msg, shape=SHAPE):
    return P2P("recv", peer, msg, shape)


def configs(pp):
    """(vpp, m) from the minimum microbatch count to 3x (interleaving needs m % pp == 0)."""
    yield from ((1, m) for m in range(1, 3 * pp + 1))
    yield from ((vpp, k * pp) for vpp in (2, 3, 4) for k in (1, 2, 3))


# -- the simulator ---------------------------------------------------------------------------
def test_a_send_waits_for_the_receive_and_completes_with_it():
    report = run_groups({0: [[send(1, "a")], [recv(1, "b")]], 1: [[recv(0, "a")], [send(0, "b")]]})
    assert report.groups == 4 and report.messages == 2


def test_two_sends_at_the_head_deadlock_and_each_stuck_group_is_named():
    groups = {0: [[send(1, "a")], [recv(1, "b")]], 1: [[send(0, "b")], [recv(0, "a")]]}
    with pytest.raises(DeadlockError) as e:
        run_groups(groups)
    assert "rank 0 waits in group 0 of 2: [send a [2, 1, 3] to rank 1 (pending)]" in str(e.value)
    assert "rank 1 waits in group 0 of 2: [send b [2, 1, 3] to rank 0 (pending)]" in str(e.value)
    # The same transfers batched into one group per rank complete.
    assert run_groups({0: [[send(1, "a"), recv(1, "b")]], 1: [[send(0, "b"), recv(0, "a")]]})


def test_a_rank_issues_its_next_group_only_when_the_current_one_completed():
    # Rank 1 receives "c" before sending "b", and rank 0 sends "c" only in its next group,
    # after its current one got "b": one op at a time this would pass, groups cannot.
    groups = {
        0: [[send(1, "a"), recv(1, "b")], [send(1, "c")]],
        1: [[recv(0, "a"), recv(0, "c")], [send(0, "b")]],
    }
    with pytest.raises(DeadlockError) as e:
        run_groups(groups)
    stuck = str(e.value)
    assert "rank 0 waits in group 0 of 2: [send a [2, 1, 3] to rank 1 (done), recv b" in stuck
    assert "recv c [2, 1, 3] from rank 0 (pending)]" in stuck
    groups[1] = [[recv(0, "a")], [send(0, "b"), recv(0, "c")]]
    assert run_groups(groups).messages == 3


def test_a_group_not_waited_for_still_holds_back_the_ranks_later_groups():
    # One stream per rank: each posts a receive ahead, then the send the peer needs; neither
    # host waits before posting both, yet each send queues behind a receive that never ends.
    programs = {
        0: [Post((recv(1, "b"),)), Post((send(1, "a"),)), Wait(0), Wait(1)],
        1: [Post((recv(0, "a"),)), Post((send(0, "b"),)), Wait(0), Wait(1)],
    }
    with pytest.raises(DeadlockError, match=r"rank 0 waits in group 0 of 2: \[recv b"):
        run_programs(programs)
    programs[1] = [Post((send(0, "b"),)), Post((recv(0, "a"),)), Wait(0), Wait(1)]
    assert run_programs(programs).messages == 2  # the receive posted after the peer's send


def test_a_rank_computes_while_its_group_is_in_flight():
    # Rank 0 posts its send and computes; rank 1 receives at 1: the send completed during the
    # compute, so waiting for it costs nothing. A group never waited for must still complete.
    programs = {
        0: [Post((send(1, "a"),)), Compute(2.0), Wait(0)],
        1: [Compute(1.0), Post((recv(0, "a"),)), Wait(0), Compute(1.0)],
    }
    report = run_programs(programs)
    assert report.finish == {0: 2.0, 1: 2.0} and report.busy == {0: 2.0, 1: 2.0}
    with pytest.raises(DeadlockError, match=r"rank 1 waits in group 0 of 1: \[recv a"):
        run_programs({0: [], 1: [Post((recv(0, "a"),))]})


def test_swapped_messages_and_wrong_shapes_are_caught():
    with pytest.raises(MismatchError, match="posted in different orders"):
        run_groups({0: [[send(1, "a"), send(1, "b")]], 1: [[recv(0, "b"), recv(0, "a")]]})
    with pytest.raises(MismatchError, match=r"\[2, 1, 3\] to rank 1 .* \[2, 1, 4\] from rank 0"):
        run_groups({0: [[send(1, "a")]], 1: [[recv(0, "a", (2, 1, 4))]]})


def test_a_peer_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="names no other rank"):
        run_groups({0: [[send(0, "a")]], 1: []})


# -- the old order, and why interleaving needs care ------------------------------------------
def test_old_order_for_pp2_m4_deadlocks_with_both_sends_at_the_head():
    seq = one_op_at_a_time(2, 1, 4, SHAPE)
    assert [str(g[0]) for g in seq[0][:3]] == [
        "send ('act', 0, 0) [2, 1, 3] to rank 1",
        "send ('act', 1, 0) [2, 1, 3] to rank 1",
        "recv ('grad', 0, 1) [2, 1, 3] from rank 1",
    ]
    assert [str(g[0]) for g in seq[1][:3]] == [
        "recv ('act', 0, 0) [2, 1, 3] from rank 0",
        "send ('grad', 0, 1) [2, 1, 3] to rank 0",
        "recv ('act', 1, 0) [2, 1, 3] from rank 0",
    ]
    with pytest.raises(DeadlockError) as e:
        run_groups(seq)
    assert "rank 0 waits in group 1 of 8: [send ('act', 1, 0) [2, 1, 3] to rank 1" in str(e.value)
    assert "rank 1 waits in group 1 of 8: [send ('grad', 0, 1) [2, 1, 3] to rank 0" in str(e.value)


def test_old_order_deadlocks_in_every_layout_with_more_than_one_microbatch():
    for pp in range(2, 9):
        for vpp, m in configs(pp):
            if m == 1:  # nothing crosses: the case that hid the problem
                run_groups(one_op_at_a_time(pp, vpp, m, SHAPE))
                continue
            with pytest.raises(DeadlockError, match=r"rank \d waits in group \d+ of \d+: \[send"):
                run_groups(one_op_at_a_time(pp, vpp, m, SHAPE))


def test_grouping_each_send_with_the_next_receives_deadlocks_interleaved():
    def per_compute(pp, vpp, m, rank):
        steps, sends = [], []
        for op in compute_order(pp, vpp, m, rank):
            recvs, after = transfers_around(pp, vpp, op)
            steps.append([as_p2p(o, SHAPE) for o in sends + recvs])
            sends = after
        return [g for g in [*steps, [as_p2p(o, SHAPE) for o in sends]] if g]

    run_groups({r: per_compute(2, 1, 4, r) for r in range(2)})  # fine for plain 1F1B
    with pytest.raises(DeadlockError, match=r"rank 0 waits .*send \('grad', 0, 2\)"):
        run_groups({r: per_compute(2, 2, 4, r) for r in range(2)})


def test_planned_groups_keep_every_message_and_each_pairs_order():
    for pp, vpp, m in [(2, 1, 4), (4, 2, 8), (3, 3, 6), (4, 1, 2)]:
        order = {pair: [] for pair in message_order(pp, vpp, m)}
        for rank, groups in planned_groups(training_steps, pp, vpp, m, SHAPE).items():
            for op in (op for g in groups for op in g if op.kind == "send"):
                order[(rank, op.peer)].append(op.message)
        assert order == message_order(pp, vpp, m)
        flat = [s.compute for s in training_steps(pp, vpp, m, 0) if s.compute]
        assert flat == compute_order(pp, vpp, m, 0)


# -- coverage: what the engine posts, recorded --------------------------------------------------
def recorded(pp, vpp, m, split, forward_only, programs=False):
    tokens = torch.zeros((1, 2), dtype=torch.long)
    return record_engine(
        pp,
        vpp,
        [(tokens, tokens)] * m,
        lambda r: stub_chunks(pp, vpp, r, split, SHAPE),
        PipelineShape(SHAPE),
        forward_only,
        programs=programs,
    )


def posts_and_waits(programs):
    return {r: [e for e in events if not isinstance(e, Compute)] for r, events in programs.items()}


@pytest.mark.parametrize(
    ("fwd", "bwd"),
    [pytest.param(1.0, 2.0, marks=pytest.mark.slow), (1.0, 1.0), (2.0, 3.0)],  # ~6 s
)
def test_planned_groups_keep_the_analytic_bubble(fwd, bwd):
    # Timed with latency-free transfers (each compute waiting for the groups it needs, every
    # rank's groups one after the other), the bubble stays (pp - 1) / (vpp * m) everywhere.
    for pp in range(2, 9):
        for vpp, m in configs(pp):
            report = run_programs(
                planned_programs(training_steps, pp, vpp, m, SHAPE, (fwd, bwd, 0))
            )
            assert report.busy[0] == m * vpp * (fwd + bwd)
            bubble = (max(report.finish.values()) - report.busy[0]) / report.busy[0]
            assert bubble == pytest.approx(analytic_bubble(pp, vpp, m), rel=1e-12)


# pp 7 and 8: ~6 and ~8 s in one process.
@pytest.mark.parametrize(
    "pp",
    [
        *range(2, 7),
        pytest.param(7, marks=pytest.mark.slow),
        pytest.param(8, marks=pytest.mark.slow),
    ],
)
def test_engine_groups_never_deadlock(pp):
    cases = 0
    for vpp, m in configs(pp):
        even = [1] * (pp * vpp)
        uneven = [1 + c % 3 for c in range(pp * vpp)]
        # The split changes no transfer; uneven splits run at the extremes of m.
        splits = [even, uneven] if m in (1 if vpp == 1 else pp, 3 * pp) else [even]
        for split in splits:
            for forward_only in (False, True):
                report = run_programs(recorded(pp, vpp, m, split, forward_only, programs=True))
                per_mb = (pp * vpp - 1) * (1 if forward_only else 2)
                assert report.messages == m * per_mb
                cases += 1
    assert cases == 2 * (3 * pp + 9) + 16


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (4, 2, 8), (3, 4, 3), (5, 1, 2)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_the_engine_posts_and_waits_exactly_as_planned(pp, vpp, m, forward_only):
    steps_of = forward_only_steps if forward_only else training_steps
    assert recorded(pp, vpp, m, [1] * (pp * vpp), forward_only) == planned_groups(
        steps_of, pp, vpp, m, SHAPE
    )
    planned = posts_and_waits(planned_programs(steps_of, pp, vpp, m, SHAPE))
    assert recorded(pp, vpp, m, [1] * (pp * vpp), forward_only, programs=True) == planned


def test_real_model_chunks_post_the_same_groups():
    pp, vpp, m, seq, micro, hidden = 2, 2, 4, 8, 2, 32
    spec = ModelSpec(
        arch="llama",
        num_layers=6,
        hidden_size=hidden,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=64,
        seq_length=seq,
        vocab_size=64,
        padded_vocab_size=128,
        max_position_embeddings=seq,
    )
    split = [1, 2, 2, 1]
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (micro, seq), generator=gen),) * 2 for _ in range(m)]
    shape = (seq, micro, hidden)
    for forward_only, steps_of in ((False, training_steps), (True, forward_only_steps)):
        real = record_engine(
            pp,
            vpp,
            batches,
            lambda r: build_chunks(spec, ParallelContext(), split, r, pp, vpp),
            PipelineShape(shape),
            forward_only,
        )
        assert run_groups(real).messages == (1 if forward_only else 2) * m * (pp * vpp - 1)
        assert real == planned_groups(steps_of, pp, vpp, m, shape)


# -- interleaved 1F1B: early receives ----------------------------------------------------------
def test_interleaved_computes_wait_only_for_the_groups_holding_their_data():
    # Each compute waits for the groups up to the one holding its input and no further, and a
    # good share of the receives is posted before an earlier compute (in flight while it runs).
    for pp, vpp, m, share in [(2, 2, 8, 0.35), (4, 2, 8, 0.3), (4, 4, 12, 0.4), (8, 2, 24, 0.3)]:
        ahead = total = 0
        for rank in range(pp):
            posted, holder = 0, {}
            for step in training_steps(pp, vpp, m, rank):
                before, posted = posted, posted + bool(step.group)
                recvs = [op for op in step.group if op.kind.startswith("recv")]
                holder.update((message(op), posted) for op in recvs)
                if step.compute is None:
                    continue
                needed, _ = transfers_around(pp, vpp, step.compute)
                assert step.ready == max((holder[message(op)] for op in needed), default=0)
                total += len(needed)
                ahead += sum(holder[message(op)] <= before for op in needed)
        assert ahead >= share * total, (pp, vpp, m, ahead, total)


def test_receives_posted_a_step_ahead_regardless_of_their_sends_hang():
    # The naive way to post early: every step's receives one step sooner, each compute waiting
    # for the group that holds them. A receive then sits ahead of the sends its data needs.
    def one_step_ahead(pp, vpp, m, rank):
        steps = training_steps(pp, vpp, m, rank, "1f1b" if vpp == 1 else "interleaved")
        kind = lambda s, k: tuple(as_p2p(op, SHAPE) for op in s.group if op.kind.startswith(k))
        events, posted, holds = [], 0, {}

        def post(group, holding):  # holding: the step whose receives the group carries
            nonlocal posted
            posted += bool(group)
            events.extend([Post(group)] if group else [])
            holds[holding] = posted

        post(kind(steps[0], "recv"), 0)
        for i, step in enumerate(steps):
            after = kind(steps[i + 1], "recv") if i + 1 < len(steps) else ()
            post(kind(step, "send") + after, i + 1)
            events += [Wait(k) for k in range(holds[i])] if step.compute else []
        return events + [Wait(k) for k in range(posted)]

    for pp, vpp, m in [(2, 1, 4), (4, 1, 8), (2, 2, 4)]:
        with pytest.raises(DeadlockError, match=r"waits in group \d+ of \d+: \[recv"):
            run_programs({r: one_step_ahead(pp, vpp, m, r) for r in range(pp)})


@pytest.mark.parametrize("times", [(1.0, 2.0, 0.0), (1.0, 1.5, 0.5), (3.0, 4.0, 2.0)])
def test_interleaved_groups_planned_with_any_chunk_times_keep_the_analytic_bubble(times):
    # The trainer plans with the model's F, B and W; whatever they are, no rank's stream waits
    # in a circle, and timed at those times the bubble is (pp - 1) / (vpp * m).
    f, b, w = times
    for pp in (2, 3, 4, 8):
        for vpp, m in ((2, pp), (3, 2 * pp), (4, 3 * pp)):
            programs = planned_programs(training_steps, pp, vpp, m, SHAPE, times, op_times=times)
            report = run_programs(programs)
            assert report.busy[0] == pytest.approx(m * vpp * (f + b + w))
            bubble = (max(report.finish.values()) - report.busy[0]) / report.busy[0]
            assert bubble == pytest.approx(analytic_bubble(pp, vpp, m), rel=1e-9)


def test_early_receives_idle_no_more_than_megatrons_pairs_when_the_plan_is_off():
    # The plan assumes equal chunks; here the last one (head and loss) takes up to 3x as long.
    # On NCCL a receive posted before its send holds back the rank's later groups, yet with
    # latency-free transfers early receives idle no more than Megatron's pairs, and as much
    # where the plan was right.
    for heavy in (1.0, 2.0, 3.0):
        for pp, vpp, m in [(2, 2, 8), (4, 2, 8), (4, 2, 16), (8, 2, 16), (4, 4, 8)]:
            weight = lambda op, h=heavy, last=pp * vpp - 1: h if op.chunk == last else 1.0
            idle = {}
            for name, steps_of in (("early", training_steps), ("pairs", megatron_pairs)):
                programs = {
                    r: step_program(steps_of(pp, vpp, m, r), SHAPE, (1.0, 2.0, 0.0), weight)
                    for r in range(pp)
                }
                report = run_programs(programs)
                idle[name] = max(report.finish.values()) - max(report.busy.values())
            assert idle["early"] <= idle["pairs"] + 1e-9, (heavy, pp, vpp, m, idle)
