"""The job's rank layout: coordinates, named groups and the rank map, for many grid shapes."""

import itertools

import pytest

from megatronish.config.schema import ParallelConfig
from megatronish.distributed.parallel_grid import GROUP_NAMES, ParallelGrid, rank_map_table

SHAPES = [s for s in itertools.product([1, 2, 4], [1, 2, 3], [1, 2, 4]) if s[0] * s[1] * s[2] <= 32]


def group_of(rank, groups):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_coordinates_round_trip_with_tp_fastest(tp, dp, pp):
    grid = ParallelGrid.of(tp=tp, dp=dp, pp=pp)
    for rank in range(tp * dp * pp):
        c = grid.coords(rank)
        assert rank == c.tp + tp * (c.dp + dp * c.pp)
        assert grid.dense.rank(**vars(c)) == rank


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_groups_partition_the_world_and_vary_one_coordinate(tp, dp, pp):
    world = tp * dp * pp
    grid = ParallelGrid.of(tp=tp, dp=dp, pp=pp)
    sizes = {"tp": tp, "dp": dp, "pp": pp, "mp": tp * pp, "world": world}
    for name, size in sizes.items():
        flat = sorted(r for g in grid.groups(name) for r in g)
        assert flat == list(range(world)), name
        assert all(len(g) == size for g in grid.groups(name)), name
    for name, fixed in {"tp": ("dp", "pp"), "dp": ("tp", "pp"), "pp": ("tp", "dp")}.items():
        for g in grid.groups(name):
            coords = [grid.coords(r) for r in g]
            for attr in fixed:
                assert len({getattr(c, attr) for c in coords}) == 1
            assert [getattr(c, name) for c in coords] == list(range(len(g)))
    for g in grid.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))  # consecutive ranks: one node
    for rank in range(world):
        emb = (
            group_of(rank, grid.groups("embedding"))
            if pp == 1 or grid.coords(rank).pp in (0, pp - 1)
            else None
        )
        if emb is not None:
            stages = sorted({grid.coords(r).pp for r in emb})
            assert stages == sorted({0, pp - 1})


CP_SHAPES = [(1, 2, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2), (1, 4, 2, 1), (2, 2, 2, 2), (4, 2, 1, 2)]


@pytest.mark.parametrize("tp,cp,dp,pp", CP_SHAPES)
def test_cp_sits_between_tp_and_dp(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    grid = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp)
    for rank in range(world):
        c = grid.coords(rank)
        assert rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        assert grid.dense.rank(**vars(c)) == rank
    sizes = {"tp": tp, "cp": cp, "dp": dp, "dp_cp": dp * cp, "pp": pp, "mp": tp * pp}
    varying = {
        "tp": {"tp"},
        "cp": {"cp"},
        "dp": {"dp"},
        "dp_cp": {"dp", "cp"},
        "pp": {"pp"},
        "mp": {"tp", "pp"},
    }
    for name, size in sizes.items():
        assert sorted(r for g in grid.groups(name) for r in g) == list(range(world)), name
        for g in grid.groups(name):
            assert len(g) == size, name
            coords = [grid.coords(r) for r in g]
            for attr in {"tp", "cp", "dp", "pp"} - varying[name]:
                assert len({getattr(c, attr) for c in coords}) == 1, (name, attr)
    for g in grid.groups("cp"):
        assert g == list(range(g[0], g[0] + tp * cp, tp))  # next to the tp group
    assert f"cp={cp}" in rank_map_table(grid) and " rank | tp | cp | dp | pp" in (
        rank_map_table(grid)
    )


def test_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="outside a world of 4"):
        ParallelGrid.of(tp=2, dp=2).coords(4)
    with pytest.raises(ValueError):
        ParallelGrid.of(tp=2).dense.rank(tp=2, cp=0, dp=0, pp=0)
    with pytest.raises(ValueError, match="ep=3 must divide dp \\* cp = 2 \\* 2"):
        ParallelGrid.of(dp=2, cp=2, ep=3)
    with pytest.raises(
        ValueError,
        match="no group .dp-cp.: the groups are tp, cp, cp_a2a, cp_ring, dp, dp_cp, zero_shard",
    ):
        ParallelGrid.of().groups("dp-cp")


def test_rank_map_table_lists_every_rank():
    table = rank_map_table(ParallelGrid.of(tp=2, dp=2, pp=2))
    assert "tp=2 dp=2 pp=2" in table
    assert len(table.splitlines()) == 2 + 8
    assert table.splitlines()[-1].split("|") == ["    7 ", "  1 ", "  1 ", "  1"]


def test_rank_map_table_shows_expert_coordinates():
    table = rank_map_table(ParallelGrid.of(dp=4, ep=2))
    assert "ep=2" in table and " rank | tp | dp | pp | ep | edp" in table
    # dp ranks 0..3 -> (ep, edp) = (0,0), (1,0), (0,1), (1,1): ep fastest within dp
    assert [line.split("|")[-2:] for line in table.splitlines()[2:]] == [
        ["  0 ", "  0"],
        ["  1 ", "  0"],
        ["  0 ", "  1"],
        ["  1 ", "  1"],
    ]


def brute_force(tp, cp, dp, pp, ep, a2a=1, shard=None):
    """Every named group, enumerated from the layout's definition: ``rank = t + tp * (c + cp *
    (d + dp * p))``; experts split ``i = c + cp * d``, ep fastest (ep rank ``i % ep``); cp rank
    ``c = j + a2a * g``: a2a groups share ``g``, rings share ``j``; dp rank ``d = s + shard *
    r``: ZeRO shard groups (with every cp rank) share ``r``, their replicas ``s`` and ``c``."""
    shard = shard or dp
    what_a_group_shares = {  # (t, c, d, p, ep rank, edp rank) -> the group's key
        "tp": lambda t, c, d, p, e, f: (c, d, p),
        "cp": lambda t, c, d, p, e, f: (t, d, p),
        "cp_a2a": lambda t, c, d, p, e, f: (t, c // a2a, d, p),
        "cp_ring": lambda t, c, d, p, e, f: (t, c % a2a, d, p),
        "dp": lambda t, c, d, p, e, f: (t, c, p),
        "dp_cp": lambda t, c, d, p, e, f: (t, p),
        "zero_shard": lambda t, c, d, p, e, f: (t, p, d // shard),
        "zero_replica": lambda t, c, d, p, e, f: (t, c, d % shard, p),
        "ep": lambda t, c, d, p, e, f: (t, p, f),
        "edp": lambda t, c, d, p, e, f: (t, p, e),
        "pp": lambda t, c, d, p, e, f: (t, c, d),
        "mp": lambda t, c, d, p, e, f: (c, d),
        # the first and last stage (middle stages hold no copy of the embedding)
        "embedding": lambda t, c, d, p, e, f: (t, c, d) if p in (0, pp - 1) else None,
        "world": lambda t, c, d, p, e, f: (),
    }
    out = {}
    for name, key in what_a_group_shares.items():
        groups = {}
        for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
            rank = t + tp * (c + cp * (d + dp * p))
            i = c + cp * d
            if (k := key(t, c, d, p, i % ep, i // ep)) is not None:
                groups.setdefault(k, []).append(rank)
        out[name] = sorted(sorted(g) for g in groups.values())
    return out


ALL_SHAPES = [
    (tp, cp, dp, pp, ep)
    for tp, cp, dp, pp in itertools.product([1, 2, 3], [1, 2], [1, 2, 3, 4], [1, 2, 3])
    for ep in (1, 2, 3, 4, 8)
    if (dp * cp) % ep == 0 and tp * cp * dp * pp <= 48
]


@pytest.mark.parametrize("tp,cp,dp,pp,ep", ALL_SHAPES)
def test_every_group_matches_the_layout_enumerated(tp, cp, dp, pp, ep):
    grid = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    want = brute_force(tp, cp, dp, pp, ep)
    for name in GROUP_NAMES:
        got = grid.groups(name)
        assert got == sorted(got), name  # groups in order of their first rank
        assert all(g == sorted(g) for g in got), name  # each ascending
        assert got == want[name], name
    for rank in range(tp * cp * dp * pp):
        e = grid.expert.coords(rank)
        assert grid.expert.rank(**e) == rank
        assert e["ep"] == group_of(rank, grid.groups("ep")).index(rank)
        assert e["edp"] == group_of(rank, grid.groups("edp")).index(rank)


# The groups as the layout has always made them (printed once from the previous rank
# arithmetic): the order ranks take within dp x cp for ep and edp is part of checkpoints and
# of every rank's experts, so it must not drift.
REFERENCE = {
    (1, 2, 2, 2, 2): {
        "tp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "mp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "world": [[0, 1, 2, 3, 4, 5, 6, 7]],
    },
    (2, 1, 4, 1, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "mp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "embedding": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "world": [[0, 1, 2, 3, 4, 5, 6, 7]],
    },
}


@pytest.mark.parametrize("shape", list(REFERENCE))
def test_groups_are_the_ones_the_layout_always_made(shape):
    tp, cp, dp, pp, ep = shape
    grid = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    assert {name: grid.groups(name) for name in REFERENCE[shape]} == REFERENCE[shape]


@pytest.mark.parametrize("tp,cp,dp,pp,a2a", [(1, 4, 1, 1, 2), (2, 4, 2, 1, 2), (2, 8, 1, 2, 4)])
def test_a2a_ring_cuts_each_cp_group_into_a2a_groups_and_rings(tp, cp, dp, pp, a2a):
    """Consecutive cp ranks exchange heads; the ranks at the same place in each a2a group form
    a ring, ordered by their group; every other group is as without the cut."""
    grid = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp, cp_a2a=a2a)
    want = brute_force(tp, cp, dp, pp, 1, a2a)
    assert {n: grid.groups(n) for n in GROUP_NAMES} == want
    for g in grid.groups("cp_a2a"):
        assert g == list(range(g[0], g[0] + tp * a2a, tp))  # consecutive cp ranks
    assert grid.size("cp_a2a") == a2a and grid.size("cp_ring") == cp // a2a
    assert grid.communicator("cp_a2a") == "cp_a2a" and grid.communicator("cp_ring") == "cp_ring"
    assert "cp_a2a | cp_ring" in rank_map_table(grid)
    plain = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp)
    assert plain.communicator("cp_ring") == "cp"  # one group of a2a_size 1: the cp ranks
    assert "cp_a2a" not in rank_map_table(plain)
    with pytest.raises(ValueError, match="cp_a2a=3 must divide cp = 4"):
        ParallelGrid.of(cp=4, cp_a2a=3)


@pytest.mark.parametrize(
    "tp,cp,dp,pp,ep,shard",
    [(1, 1, 4, 1, 1, 2), (2, 2, 4, 2, 2, 2), (1, 2, 6, 1, 3, 3), (2, 2, 2, 1, 1, 1)],
)
def test_hybrid_sharding_cuts_each_dp_cp_group_into_shard_groups_and_replicas(
    tp, cp, dp, pp, ep, shard
):
    """A shard group is cp x zero_shard_size consecutive ranks of a dp x cp group, in the order
    of dp x cp (so a rank's shard is its place there, cp fastest); the replicas are the ranks
    at the same place in every shard group; every other group is as without the cut."""
    grid = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, zero_shard=shard)
    want = brute_force(tp, cp, dp, pp, ep, shard=shard)
    assert {n: grid.groups(n) for n in GROUP_NAMES} == want
    for g in grid.groups("zero_shard"):
        assert g == list(range(g[0], g[0] + tp * cp * shard, tp))  # consecutive: a node
    assert grid.size("dp_shard") == shard and grid.size("dp_replica") == dp // shard
    assert grid.communicator("zero_shard") == "zero_shard"
    assert grid.communicator("zero_replica") == "zero_replica"
    assert "dp_shard | dp_replica" in rank_map_table(grid)
    plain = ParallelGrid.of(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    assert plain.communicator("zero_shard") == plain.communicator("dp_cp")  # no new group
    assert plain.groups("zero_shard") == plain.groups("dp_cp")
    assert "dp_shard" not in rank_map_table(plain)
    with pytest.raises(ValueError, match="zero_shard=4 must divide dp = 6"):
        ParallelGrid.of(dp=6, zero_shard=4)


@pytest.mark.parametrize(
    "parallel, world, degrees",
    [
        (ParallelConfig(), 1, dict(tp=1, cp=1, dp=1, pp=1, ep=1, edp=1)),
        (ParallelConfig(tp=2, pp=2), 8, dict(tp=2, cp=1, dp=2, pp=2, ep=1, edp=2)),
        (ParallelConfig(tp=2, cp=2, ep=4), 16, dict(tp=2, cp=2, dp=4, pp=1, ep=4, edp=2)),
        (ParallelConfig(dp=3, ep=3), 3, dict(tp=1, cp=1, dp=3, pp=1, ep=3, edp=1)),
        (
            ParallelConfig(cp=4, cp_comm_type="a2a_ring", cp_a2a_size=2),
            8,
            dict(tp=1, cp=4, dp=2, cp_a2a=2, cp_ring=2),
        ),
        (
            ParallelConfig(cp=2, zero_stage=1, zero_shard_size=2),
            16,
            dict(cp=2, dp=8, dp_shard=2, dp_replica=4),
        ),
    ],
)
def test_the_grid_of_a_config(parallel, world, degrees):
    """``parallel.dp: null`` takes what the world leaves."""
    grid = ParallelGrid.from_config(parallel, world)
    assert {axis: grid.size(axis) for axis in degrees} == degrees
    assert grid.world_size == world


@pytest.mark.parametrize(
    "cp,ep,dp_cp,edp",
    [(1, 1, "dp", "dp"), (2, 1, "dp_cp", "dp_cp"), (1, 2, "dp", "edp"), (2, 2, "dp_cp", "edp")],
)
def test_a_group_on_the_same_ranks_as_another_shares_its_communicator(cp, ep, dp_cp, edp):
    grid = ParallelGrid.of(tp=2, cp=cp, dp=4, pp=2, ep=ep)
    assert grid.communicator("dp_cp") == dp_cp
    assert grid.communicator("edp") == edp
    for name in ("dp_cp", "edp"):
        shared = grid.communicator(name)
        assert sorted(grid.groups(name)) == sorted(grid.groups(shared))
    assert all(grid.communicator(n) == n for n in ("tp", "cp", "dp", "ep", "pp"))
