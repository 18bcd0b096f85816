"""Zero-bubble schedules (ZB-H1, ZBV) as pure op lists: every op once on its rank, dependencies,
in-flight activations and the bubble proven by the event simulator; the groups the engine posts
never deadlock under NCCL's semantics and keep the simulated bubble."""

import functools
from collections import Counter

import pytest
import torch

from megatronish.model.build import chunk_ids_of_stage, holds_last_chunk, stage_of_chunk
from megatronish.pipeline.engine import PipelineShape
from megatronish.pipeline.grouping import forward_only_steps, training_steps
from megatronish.pipeline.nccl_sim import Post, Wait, run_programs
from megatronish.pipeline.ops import Op
from megatronish.pipeline.schedule import compute_order, message_order
from megatronish.pipeline.simulate import analytic_bubble, bubble_fraction, simulate
from megatronish.testing.p2p_sequences import Ran, planned_groups, planned_programs, step_program
from megatronish.testing.recording_p2p import record_engine, stub_chunks

VPP = {"zb-h1": 1, "zbv": 2}


def microbatch_counts(pp: int) -> list[int]:
    """From one microbatch to three times the pipeline's fill (2 pp for the V)."""
    return sorted({1, 2, pp - 1 or 1, pp, 2 * pp - 1, 2 * pp, 3 * pp, 6 * pp})


CONFIGS = [
    (schedule, pp, m) for schedule in VPP for pp in range(1, 9) for m in microbatch_counts(pp)
]
config = pytest.mark.parametrize(
    ("schedule", "pp", "m"), CONFIGS, ids=[f"{s}-pp{pp}-m{m}" for s, pp, m in CONFIGS]
)


@config
def test_every_chunk_runs_forward_b_and_w_once_on_its_rank(schedule, pp, m):
    vpp = VPP[schedule]
    expected = Counter((mb, c) for mb in range(m) for c in range(pp * vpp))
    for kind in ("fwd", "bwd_input", "bwd_weight"):
        seen = Counter()
        for rank in range(pp):
            ops = compute_order(pp, vpp, m, rank, schedule)
            assert {op.kind for op in ops} == {"fwd", "bwd_input", "bwd_weight"}
            assert all(stage_of_chunk(op.chunk, pp, schedule == "zbv") == rank for op in ops)
            seen.update((op.microbatch, op.chunk) for op in ops if op.kind == kind)
        assert seen == expected


@config
def test_the_first_chunks_w_follows_its_b(schedule, pp, m):
    """The engine runs the first chunk's whole backward in its B and leaves its W empty (the
    token ids take no grad): that moves no work only while the W comes right after the B."""
    ops = compute_order(pp, VPP[schedule], m, 0, schedule)
    for i, op in enumerate(ops):
        if op.kind == "bwd_input" and op.chunk == 0:
            assert ops[i + 1] == Op("bwd_weight", op.microbatch, 0), (i, ops)


@config
def test_simulation_finds_no_dependency_violation_or_deadlock(schedule, pp, m):
    vpp = VPP[schedule]
    sim = simulate(pp, vpp, m, 1.0, 2.0, schedule=schedule)  # raises on either
    for rank in range(pp):
        assert sim.busy_time[rank] == m * vpp * 3.0
        kinds = [op.kind for op, _, _ in sim.timeline[rank]]
        for mb in range(m):
            for c in chunk_ids_of_stage(rank, pp, vpp, schedule == "zbv"):
                position = {
                    op.kind: i
                    for i, (op, _, _) in enumerate(sim.timeline[rank])
                    if (op.microbatch, op.chunk) == (mb, c)
                }
                assert position["fwd"] < position["bwd_input"] < position["bwd_weight"]
        assert len(kinds) == 3 * m * vpp


@pytest.mark.parametrize("pp", range(1, 9))
def test_zb_h1_holds_no_more_activations_than_1f1b(pp):
    for m in microbatch_counts(pp):
        zb = simulate(pp, 1, m, schedule="zb-h1").max_in_flight
        plain = simulate(pp, 1, m, schedule="1f1b").max_in_flight
        assert max(zb.values()) == max(plain.values()) == min(pp, m)


@pytest.mark.parametrize(("f", "b", "w"), [(1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1)])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_bubble_is_the_papers_and_below_1f1b(f, b, w, pp):
    for m in (pp, 2 * pp, 3 * pp):
        sim = simulate(pp, 1, m, f, b + w, schedule="zb-h1", weight_time=w)
        got = max(bubble_fraction(sim, r) for r in range(pp))
        # (pp - 1)(f + b - w) idle time per rank (Qi et al. 2023, sec. 3.1)
        assert got == pytest.approx((pp - 1) * (f + b - w) / (m * (f + b + w)), rel=1e-12)
        assert got == pytest.approx(analytic_bubble(pp, 1, m, "zb-h1", f, b + w, w), rel=1e-12)
        assert got < analytic_bubble(pp, 1, m, "1f1b") or pp == 1


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
def test_zbv_balanced_bubble_is_only_the_fill_and_below_interleaved(pp):
    for m in (2 * pp, 3 * pp, 4 * pp):
        sim = simulate(pp, 2, m, 1.0, 2.0, schedule="zbv", weight_time=1.0)
        got = max(bubble_fraction(sim, r) for r in range(pp))
        assert got == pytest.approx((pp - 1) * 1.0 / (m * 2 * 3.0), rel=1e-12)
        assert got == pytest.approx(analytic_bubble(pp, 2, m, "zbv", 1.0, 2.0, 1.0), rel=1e-12)
        interleaved = simulate(pp, 2, m, 1.0, 2.0, schedule="interleaved", weight_time=1.0)
        assert got < max(bubble_fraction(interleaved, r) for r in range(pp))
        # Two chunks per rank, each at most pp microbatches ahead of its W: 1F1B's memory.
        assert max(sim.max_in_flight.values()) == 2 * pp


def test_zbv_places_the_last_chunk_beside_the_embedding():
    for pp in range(1, 9):
        placed = {c: stage_of_chunk(c, pp, True) for c in range(2 * pp)}
        assert placed[0] == placed[2 * pp - 1] == 0
        assert placed[pp - 1] == placed[pp] == pp - 1  # the turn of the V stays on one rank
        for rank in range(pp):
            assert [placed[c] for c in chunk_ids_of_stage(rank, pp, 2, True)] == [rank, rank]
        assert [holds_last_chunk(r, pp, 2, True) for r in range(pp)] == [True] + [False] * (pp - 1)


def test_the_turn_of_the_v_sends_nothing():
    for pp in (2, 4):
        order = message_order(pp, 2, 2 * pp, "zbv")
        moved = {msg for msgs in order.values() for msg in msgs}
        assert ("act", 0, pp - 1) not in moved and ("grad", 0, pp) not in moved
        assert len(moved) == 2 * pp * 2 * (2 * pp - 2)  # 2pp - 1 hand-overs, one of them local


SHAPE = (2,)


def nccl_cases(pp):
    return [(s, m) for s in VPP for m in microbatch_counts(pp)]


def recorded(pp, schedule, m, forward_only, split=None, programs=False, computes=False):
    """What the engine posts, run once per rank on stub chunks (``split``: layers per chunk;
    ``programs``: its posts and waits; ``computes``: and where each compute began)."""
    vpp = VPP[schedule]
    tokens = torch.zeros((1, 2), dtype=torch.long)
    split = split or [1] * (pp * vpp)
    return record_engine(
        pp,
        vpp,
        [(tokens, tokens)] * m,
        lambda r: stub_chunks(pp, vpp, r, split, SHAPE, schedule == "zbv"),
        PipelineShape(SHAPE),
        forward_only,
        schedule,
        programs=programs,
        computes=computes,
    )


@pytest.mark.parametrize("pp", [*range(2, 8), pytest.param(8, marks=pytest.mark.slow)])  # 8: ~4 s
def test_engine_posts_never_deadlock_and_keep_each_pairs_order(pp):
    # m from one microbatch to three times the fill, training and evaluation; an uneven split
    # of layers at the extremes (it changes no transfer).
    for schedule, m in nccl_cases(pp):
        vpp = VPP[schedule]
        uneven = [1 + c % 3 for c in range(pp * vpp)]
        splits = [None, uneven] if m in (1, 3 * pp) else [None]
        for split in splits:
            for forward_only in (False, True):
                programs = recorded(pp, schedule, m, forward_only, split, programs=True)
                report = run_programs(programs)  # raises on a deadlock or a mismatched pair
                groups = {
                    r: [e.group for e in p if isinstance(e, Post)] for r, p in programs.items()
                }
                moved = (2 * pp - 2 if schedule == "zbv" else pp - 1) * m
                assert report.messages == moved * (1 if forward_only else 2)
                if not forward_only:
                    sent = {pair: [] for pair in message_order(pp, vpp, m, schedule)}
                    for rank, rank_groups in groups.items():
                        for p2p in (p for g in rank_groups for p in g if p.kind == "send"):
                            sent[(rank, p2p.peer)].append(p2p.message)
                    assert sent == message_order(pp, vpp, m, schedule)


def posted_bubble(pp, vpp, m, schedule, times, plan_times):
    programs = planned_programs(
        training_steps, pp, vpp, m, SHAPE, times, schedule=schedule, op_times=plan_times
    )
    report = run_programs(programs)  # W between posting a group and waiting for it
    return (max(report.finish.values()) - report.busy[0]) / report.busy[0]


@pytest.mark.parametrize(("f", "b", "w"), [(1, 1, 1), (1, 1.5, 0.5), (1, 2, 1), (1.2, 1.5, 1)])
def test_posted_groups_keep_the_simulated_bubble(f, b, w):
    # W runs after its step's group is posted and before it is waited for. ZB-H1 posts like
    # 1F1B and loses nothing to NCCL's pairing; the V's groups, planned with the chunk's F/B/W
    # times, lose at most 5% of the ideal bubble (exactly nothing at these times but one).
    for pp in (2, 4, 8):
        for schedule in VPP:
            vpp = VPP[schedule]
            for m in (vpp * pp, 3 * pp):
                sim = simulate(pp, vpp, m, f, b + w, schedule=schedule, weight_time=w)
                expected = max(bubble_fraction(sim, r) for r in range(pp))
                got = posted_bubble(pp, vpp, m, schedule, (f, b, w), (f, b, w))
                assert got >= expected - 1e-12, (schedule, pp, m)
                limit = 1.0 + 1e-9 if schedule == "zb-h1" or f == 1 else 1.05
                assert got <= expected * limit, (schedule, pp, m)


def test_zbv_groups_planned_with_equal_times_stay_below_interleaved():
    for pp in (2, 4, 8):
        for m in (2 * pp, 3 * pp):
            got = posted_bubble(pp, 2, m, "zbv", (1, 1, 1), (1, 1, 1))
            assert got < analytic_bubble(pp, 2, m, "interleaved")


@pytest.mark.parametrize("schedule", list(VPP))
@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 4), (3, 7), (4, 8)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_the_engine_posts_exactly_the_planned_groups(schedule, pp, m, forward_only):
    steps_of = functools.partial(
        forward_only_steps if forward_only else training_steps, schedule=schedule
    )
    expected = planned_groups(steps_of, pp, VPP[schedule], m, SHAPE)
    assert recorded(pp, schedule, m, forward_only) == expected


def weights_in_flight(events):
    """How many W ran while a group this rank posted was not yet waited for."""
    posted = waited = hidden = 0
    for e in events:
        posted += isinstance(e, Post)
        waited += isinstance(e, Wait)
        hidden += isinstance(e, Ran) and e.name.startswith("bwd_weight") and posted > waited
    return hidden


@pytest.mark.parametrize("schedule", list(VPP))
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 7), (4, 8)])
def test_each_w_runs_while_its_steps_group_is_in_flight(schedule, pp, m):
    """A W moves no data: the engine runs it after posting its step's group and before waiting
    for it, so it fills the transfers' time. Recorded: every post, wait and compute in the
    order the engine ran them, which must be the plan's (the results are the same whenever a W
    runs, so only the order shows where it ran)."""
    vpp = VPP[schedule]
    for rank, events in recorded(pp, schedule, m, False, programs=True, computes=True).items():
        planned = step_program(training_steps(pp, vpp, m, rank, schedule), SHAPE, named=True)
        assert weights_in_flight(events) == weights_in_flight(planned) > 0, rank
        assert events == planned, rank


@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "m", "fragment"),
    [
        ("zb-h1", 2, 2, 4, "one chunk per stage"),
        ("zbv", 2, 3, 6, "two chunks per stage"),
        ("interleaved", 2, 1, 4, "needs parallel.vpp > 1"),
        ("1f1b", 2, 2, 4, "one chunk per stage"),
        ("gpipe", 2, 1, 4, "is not one of"),
    ],
)
def test_invalid_schedules_are_refused(schedule, pp, vpp, m, fragment):
    with pytest.raises(ValueError, match=fragment):
        compute_order(pp, vpp, m, 0, schedule)
