"""Rank arithmetic: coordinates, groups and the rank map, for many grid shapes."""

import itertools

import pytest

from megatronish.distributed.rank_math import (
    Coords,
    coords_to_rank,
    group_of,
    group_ranks,
    rank_map_table,
    rank_to_coords,
)

SHAPES = [s for s in itertools.product([1, 2, 4], [1, 2, 3], [1, 2, 4]) if s[0] * s[1] * s[2] <= 32]


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_coordinates_round_trip_with_tp_fastest(tp, dp, pp):
    for rank in range(tp * dp * pp):
        c = rank_to_coords(rank, tp, dp, pp)
        assert rank == c.tp + tp * (c.dp + dp * c.pp)
        assert coords_to_rank(c, tp, dp, pp) == rank


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_groups_partition_the_world_and_vary_one_coordinate(tp, dp, pp):
    world = tp * dp * pp
    groups = group_ranks(tp, dp, pp)
    sizes = {"tp": tp, "dp": dp, "pp": pp, "mp": tp * pp, "world": world}
    for name, size in sizes.items():
        flat = sorted(r for g in groups[name] for r in g)
        assert flat == list(range(world)), name
        assert all(len(g) == size for g in groups[name]), name
    for name, fixed in {"tp": ("dp", "pp"), "dp": ("tp", "pp"), "pp": ("tp", "dp")}.items():
        for g in groups[name]:
            coords = [rank_to_coords(r, tp, dp, pp) for r in g]
            for attr in fixed:
                assert len({getattr(c, attr) for c in coords}) == 1
            assert [getattr(c, name) for c in coords] == list(range(len(g)))
    for g in groups["tp"]:
        assert g == list(range(g[0], g[0] + tp))  # consecutive ranks: one node
    for rank in range(world):
        emb = (
            group_of(rank, groups["embedding"])
            if pp == 1 or rank_to_coords(rank, tp, dp, pp).pp in (0, pp - 1)
            else None
        )
        if emb is not None:
            stages = sorted({rank_to_coords(r, tp, dp, pp).pp for r in emb})
            assert stages == sorted({0, pp - 1})


CP_SHAPES = [(1, 2, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2), (1, 4, 2, 1), (2, 2, 2, 2), (4, 2, 1, 2)]


@pytest.mark.parametrize("tp,cp,dp,pp", CP_SHAPES)
def test_cp_sits_between_tp_and_dp(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    groups = group_ranks(tp, dp, pp, cp)
    for rank in range(world):
        c = rank_to_coords(rank, tp, dp, pp, cp)
        assert rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        assert coords_to_rank(c, tp, dp, pp, cp) == rank
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
        assert sorted(r for g in groups[name] for r in g) == list(range(world)), name
        for g in groups[name]:
            assert len(g) == size, name
            coords = [rank_to_coords(r, tp, dp, pp, cp) for r in g]
            for attr in {"tp", "cp", "dp", "pp"} - varying[name]:
                assert len({getattr(c, attr) for c in coords}) == 1, (name, attr)
    for g in groups["cp"]:
        assert g == list(range(g[0], g[0] + tp * cp, tp))  # next to the tp group
    assert f"cp={cp}" in rank_map_table(tp, dp, pp, cp) and " rank | tp | cp | dp | pp" in (
        rank_map_table(tp, dp, pp, cp)
    )


def test_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="outside a world of 4"):
        rank_to_coords(4, 2, 2, 1)
    with pytest.raises(ValueError):
        coords_to_rank(Coords(2, 0, 0), 2, 1, 1)


def test_rank_map_table_lists_every_rank():
    table = rank_map_table(2, 2, 2)
    assert "tp=2 dp=2 pp=2" in table
    assert len(table.splitlines()) == 2 + 8
    assert table.splitlines()[-1].split("|") == ["    7 ", "  1 ", "  1 ", "  1"]


def test_rank_map_table_shows_expert_coordinates():
    table = rank_map_table(1, 4, 1, 1, ep=2)
    assert "ep=2" in table and " rank | tp | dp | pp | ep | edp" in table
    # dp ranks 0..3 -> (ep, edp) = (0,0), (1,0), (0,1), (1,1): ep fastest within dp
    assert [line.split("|")[-2:] for line in table.splitlines()[2:]] == [
        ["  0 ", "  0"],
        ["  1 ", "  0"],
        ["  0 ", "  1"],
        ["  1 ", "  1"],
    ]
