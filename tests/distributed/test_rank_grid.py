"""RankGrid: coordinates, ranks and groups of a world laid out over named axes."""

import itertools

import pytest

from megatronish.distributed.rank_grid import RankGrid

ORDERS = ["tp-cp-dp-pp", "tp-ep-edp-pp", "pp-dp-tp", "a"]


def grids():
    for order in ORDERS:
        axes = order.split("-")
        for sizes in itertools.product([1, 2, 3], repeat=len(axes)):
            if sizes.count(1) or len(axes) < 4:  # at most 27 ranks
                yield RankGrid(order, dict(zip(axes, sizes)))


@pytest.mark.parametrize("grid", list(grids()), ids=str)
def test_the_first_axis_is_fastest_and_coords_round_trip(grid):
    axes = grid.axes
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        assert list(c) == list(axes)
        want, stride = 0, 1  # rank = c0 + n0 * (c1 + n1 * (c2 + ...))
        for a in axes:
            want += c[a] * stride
            stride *= grid.sizes[a]
        assert want == rank
        assert grid.rank(**c) == rank


@pytest.mark.parametrize("grid", list(grids()), ids=str)
def test_groups_vary_exactly_the_spanned_axes(grid):
    axes = grid.axes
    for n in range(1, len(axes) + 1):
        for spanned in itertools.combinations(axes, n):
            groups = grid.groups("-".join(reversed(spanned)))  # any order names the same groups
            assert groups == grid.groups("-".join(spanned))
            assert sorted(r for g in groups for r in g) == list(range(grid.world_size))
            size = 1
            for a in spanned:
                size *= grid.sizes[a]
            assert all(len(g) == size for g in groups)
            assert [g[0] for g in groups] == sorted(g[0] for g in groups)
            for g in groups:
                assert g == sorted(g)
                coords = [grid.coords(r) for r in g]
                for a in axes:
                    values = {c[a] for c in coords}
                    assert len(values) == (grid.sizes[a] if a in spanned else 1), (spanned, a)
                assert grid.group(g[-1], "-".join(spanned)) == g


def test_mistakes_are_named():
    grid = RankGrid("tp-dp", {"tp": 2, "dp": 3})
    with pytest.raises(ValueError, match="rank 6 is outside a world of 6 \\(tp=2 dp=3\\)"):
        grid.coords(6)
    with pytest.raises(ValueError, match="is not a point of the grid tp=2 dp=3"):
        grid.rank(tp=2, dp=0)
    with pytest.raises(ValueError, match="is not a point"):
        grid.rank(tp=0)
    with pytest.raises(ValueError, match="'dp-cp' names an axis outside 'tp-dp'"):
        grid.groups("dp-cp")
    with pytest.raises(ValueError, match="must name each axis"):
        RankGrid("tp-tp", {"tp": 2})
    with pytest.raises(ValueError, match="must name each axis"):
        RankGrid("tp", {"tp": 2, "dp": 1})
    with pytest.raises(ValueError, match="positive integers"):
        RankGrid("tp", {"tp": 0})
