"""Reading checkpoint shards by byte range: rectangles, dtypes, ZeRO ranges, damaged files.

Small checkpoints are written here by hand (safetensors files plus their ``Metadata``), each
global tensor stored as the rectangles a tp-sharded save would write, then read back through
``ShardReader`` (and ``load._fill``) into other layouts; every result is compared with slicing
the global tensor in memory.
"""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from megatronish.checkpoint import shardfile
from megatronish.checkpoint.format import CheckpointError, Metadata, Shard, TensorEntry, crc32_of
from megatronish.checkpoint.load import _fill
from megatronish.checkpoint.pieces import Rect, flat_rects, param_rects
from megatronish.checkpoint.shard_reader import ShardReader
from megatronish.checkpoint.shardfile import StoredTensor, region_span, split_runs
from megatronish.tensor_parallel.sharding import TPShard, mark_param

# name -> (global shape, how tp splits it): a fused q|k|v weight (dim 0, three blocks), a
# row-parallel weight (dim 1) and a replicated norm.
PARAMS = {
    "qkv": ((12, 4), TPShard(0, (4, 4, 4))),
    "proj": ((3, 8), TPShard(1, (8,))),
    "norm": ((5,), None),
}


def stored_rects(shape, shard: TPShard | None, tp: int) -> list[list[list[int]]]:
    """The rectangles a save at ``tp`` writes for one tensor (one per rank and fused block)."""
    if shard is None:
        return [[[0, n] for n in shape]]
    out = []
    for rank in range(tp):
        for start, n in shard.ranges(rank, tp):
            offsets = [[0, s] for s in shape]
            offsets[shard.dim] = [start, n]
            out.append(offsets)
    return out


def write_checkpoint(step_dir, tensors: dict, tp: int, shards: dict | None = None) -> Metadata:
    """Store each global tensor of ``tensors`` as the rectangles of a save at ``tp``, spread
    over two files; ``shards`` gives each name's TPShard (default: ``PARAMS``)."""
    shards = shards if shards is not None else {n: s for n, (_, s) in PARAMS.items()}
    files: dict[str, dict[str, torch.Tensor]] = {"a.safetensors": {}, "b.safetensors": {}}
    entries = {}
    for name, full in tensors.items():
        entry = TensorEntry(list(full.shape), str(full.dtype).removeprefix("torch."))
        for i, offsets in enumerate(stored_rects(full.shape, shards.get(name), tp)):
            piece = full[tuple(slice(s, s + n) for s, n in offsets)].contiguous()
            file, key = ("a.safetensors", "b.safetensors")[i % 2], f"{name}@{i}"
            files[file][key] = piece
            entry.shards.append(Shard(file, key, offsets, crc32_of(piece)))
        entries[name] = entry
    for file, group in files.items():
        save_file(group, os.path.join(step_dir, file))
    return Metadata(1, 0, 0, {}, {}, {}, entries)


def globals_(dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=gen).to(dtype) for n, (shape, _) in PARAMS.items()}


def local_params(tp: int) -> list[tuple[str, torch.nn.Parameter]]:
    """This model's parameters as one tp rank holds them (values unused)."""
    out = []
    for name, (shape, shard) in PARAMS.items():
        local = list(shape)
        if shard is not None:
            local[shard.dim] //= tp
        out.append((name, mark_param(torch.nn.Parameter(torch.empty(local)), shard=shard)))
    return out


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
@pytest.mark.parametrize("saved_tp", [1, 2])
def test_rectangles_of_any_layout(tmp_path, saved_tp, verify):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, saved_tp)
    with ShardReader(str(tmp_path), meta, verify=verify) as reader:
        for name, t in full.items():
            assert torch.equal(reader.read(name), t), name
        # tp=4 rectangles: a quarter of each q/k/v block (rows), a quarter of proj's columns
        for tp, rank in ((4, 1), (4, 3), (2, 0)):
            for name, p in local_params(tp):
                local = torch.full(p.shape, float("nan"))
                for rect in param_rects(p, rank, tp):
                    reader.read(name, rect.offsets, out=rect.take(local))
                assert torch.equal(
                    local, p.info.shard.take(full[name], rank, tp) if p.info.shard else full[name]
                ), (name, tp, rank)
        # a rectangle cut on both dims, into a transposed (non-contiguous) destination
        cut = torch.empty(4, 3).t()
        reader.read("proj", [[0, 3], [2, 4]], out=cut)
        assert torch.equal(cut, full["proj"][:, 2:6])
        block = torch.empty(3, 5).t()
        reader.read("qkv", [[3, 5], [1, 3]], out=block)
        assert torch.equal(block, full["qkv"][3:8, 1:4])


def test_staged_rectangles_are_read_in_slabs_of_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(shardfile, "STAGING_SLAB", 40)  # two or three 4-wide fp32 rows a slab
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 1)
    with ShardReader(str(tmp_path), meta, threads=1) as reader:
        cols = torch.empty(3, 4)
        reader.read("proj", [[0, 3], [4, 4]], out=cols)
        assert torch.equal(cols, full["proj"][:, 4:])
        block = torch.empty(5, 2)
        reader.read("qkv", [[6, 5], [1, 2]], out=block)
        assert torch.equal(block, full["qkv"][6:11, 1:3])
        assert reader._stagings[0]._buf[False].numel() <= 40


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_read_many_on_several_threads(tmp_path, verify):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 2)
    requests, expect = [], []
    for tp, rank in ((2, 0), (2, 1), (4, 2)):
        for name, p in local_params(tp):
            local = torch.full(p.shape, float("nan"))
            requests += [(name, r.offsets, r.take(local)) for r in param_rects(p, rank, tp)]
            expect.append(
                (local, p.info.shard.take(full[name], rank, tp) if p.info.shard else full[name])
            )
    with ShardReader(str(tmp_path), meta, verify=verify, threads=3) as reader:
        reader.read_many(requests)
        assert len(reader._stagings) == 3
    for got, want in expect:
        assert torch.equal(got, want)


def test_split_runs_balances_bytes_in_order():
    def runs(sizes, parts):
        pieces = [SimpleNamespace(span=n, i=i) for i, n in enumerate(sizes)]
        return [[p.i for p in run] for run in split_runs(pieces, parts)]

    assert runs([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert runs([10, 80, 10], 2) == [[0, 1], [2]]
    assert runs([5], 4) == [[0]]
    assert runs([0, 0, 0], 2) == [[0], [1, 2]]
    assert runs([1] * 9, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_bf16_read_as_bf16_and_into_fp32(tmp_path):
    full = globals_(torch.bfloat16)
    meta = write_checkpoint(tmp_path, full, 2)
    with ShardReader(str(tmp_path), meta) as reader:
        got = reader.read("qkv", [[2, 7], [0, 4]])
        assert got.dtype == torch.bfloat16 and torch.equal(got, full["qkv"][2:9])
        into = torch.empty(3, 3)
        reader.read("proj", [[0, 3], [3, 3]], out=into)
        assert torch.equal(into, full["proj"][:, 3:6].float())


def test_contiguous_rectangle_is_read_straight_into_its_destination(tmp_path):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 2)
    with ShardReader(str(tmp_path), meta, threads=1) as reader:
        dest = torch.empty(6, 4)
        reader.read("qkv", [[1, 6], [0, 4]], out=dest)  # rows of two stored q blocks
        assert torch.equal(dest, full["qkv"][1:7])
        assert not reader._stagings[0]._buf, "a contiguous read went through the staging buffer"
        reader.read("proj", [[0, 3], [0, 8]])  # two column shards: staged
        assert reader._stagings[0]._buf


@pytest.mark.parametrize("lo, hi", [(0, 21), (21, 42), (5, 30), (13, 40), (27, 28)])
@pytest.mark.parametrize("saved_tp", [1, 4])
def test_zero_range_straddling_params(tmp_path, saved_tp, lo, hi):
    """``_fill`` of a bucket range whose edges cut through params, at tp=2 rank 1."""
    full = globals_()
    meta = write_checkpoint(tmp_path, full, saved_tp)
    tp, rank = 2, 1
    params = local_params(tp)
    offsets, pos = [], 0
    for _, p in params:
        offsets.append(pos)
        pos += p.numel()
    expect = torch.cat(
        [
            (p.info.shard.take(full[n], rank, tp) if p.info.shard else full[n]).reshape(-1)
            for n, p in params
        ]
    )
    bucket = SimpleNamespace(params=params, offsets=offsets)
    topo = SimpleNamespace(coords=SimpleNamespace(tp=rank), tp=tp)
    dest = torch.full((hi - lo,), float("nan"))
    with ShardReader(str(tmp_path), meta) as reader:
        _fill(_Renamed(reader), [(bucket, "model", dest, lo, hi)], topo)
    end = min(hi, pos)  # beyond the last param: bucket padding, left alone
    assert torch.equal(dest[: end - lo], expect[lo:end])
    assert dest[end - lo :].isnan().all()


class _Renamed:
    """Reads ``model/<name>`` as ``<name>`` (the hand-written checkpoint has bare names)."""

    def __init__(self, reader: ShardReader):
        self.reader = reader

    def read_many(self, requests):
        self.reader.read_many([(n.removeprefix("model/"), o, t) for n, o, t in requests])


def test_rect_meet():
    fused = Rect([[20, 4], [0, 3]], dim=0, local_start=4, length=4)  # local rows 4..7
    assert fused.meet([[0, 4], [0, 3]]) is None
    assert fused.meet([[2, 4], [0, 3]]) == ([[20, 2], [0, 3]], 2, 2)
    assert fused.meet([[5, 4], [1, 2]]) == ([[21, 3], [1, 2]], 0, 3)
    cols = Rect([[0, 10], [6, 2]], dim=1, local_start=2, length=2)  # local columns 2..3
    assert cols.meet([[3, 1], [1, 3]]) == ([[3, 1], [6, 2]], 1, 2)


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 2, 4)])
def test_flat_rects_cover_a_range_in_order(shape):
    numel = math.prod(shape)
    for lo in range(numel + 1):
        for hi in range(lo, numel + 1):
            marks = torch.zeros(shape, dtype=torch.int64)
            pos = lo
            for rect, first in flat_rects(shape, lo, hi):
                where = tuple(slice(s, s + n) for s, n in rect)
                index = torch.arange(numel).view(shape)[where].reshape(-1)
                assert first == pos and index.equal(torch.arange(pos, pos + index.numel()))
                marks[where] += 1
                pos += index.numel()
            assert pos == hi
            flat = marks.reshape(-1)
            assert flat[lo:hi].eq(1).all() and flat[:lo].eq(0).all() and flat[hi:].eq(0).all()
    assert len(flat_rects(shape, 1, numel - 1)) <= 2 * len(shape) - 1


def test_region_span():
    st = StoredTensor(torch.float32, (4, 5, 6), 0)
    assert region_span(st, (slice(1, 3), slice(0, 5), slice(0, 6))) == (30, 60)  # contiguous
    assert region_span(st, (slice(2, 3), slice(1, 3), slice(0, 6))) == (66, 12)
    assert region_span(st, (slice(0, 2), slice(0, 5), slice(2, 4))) == (2, 56)  # 20 of 56


def _damage(path: str, keep: int | None = None, flip_at: int | None = None) -> None:
    with open(path, "r+b") as f:
        if keep is not None:
            f.truncate(keep)
        if flip_at is not None:
            f.seek(flip_at)
            byte = f.read(1)
            f.seek(flip_at)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("keep", [4, 20, -8], ids=["length", "header", "data"])
def test_truncated_file_is_refused_naming_it(tmp_path, keep):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 2)
    path = tmp_path / "b.safetensors"
    _damage(str(path), keep=keep if keep > 0 else path.stat().st_size + keep)
    with ShardReader(str(tmp_path), meta) as reader, pytest.raises(CheckpointError) as err:
        for name in full:
            reader.read(name)
    assert "b.safetensors" in str(err.value) and "truncated" in str(err.value)


def test_file_cut_short_after_opening_is_refused(tmp_path):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 2)
    with ShardReader(str(tmp_path), meta) as reader:
        reader.read("norm")  # opens a.safetensors
        _damage(str(tmp_path / "a.safetensors"), keep=200)
        with pytest.raises(CheckpointError, match=r"a\.safetensors is truncated"):
            for name in full:
                reader.read(name)


def test_verify_catches_a_flipped_byte(tmp_path):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 2)
    path = tmp_path / "a.safetensors"
    _damage(str(path), flip_at=path.stat().st_size - 3)  # inside the last tensor's bytes
    with ShardReader(str(tmp_path), meta, verify=True) as reader:
        with pytest.raises(CheckpointError, match=r"checksum mismatch in a\.safetensors"):
            for name in full:
                reader.read(name)


def test_reads_into_a_parameter_that_requires_grad(tmp_path):
    full = globals_()
    meta = write_checkpoint(tmp_path, full, 2)
    p = torch.nn.Parameter(torch.empty(8, 3))  # staged: two column shards, rows 2..9
    with ShardReader(str(tmp_path), meta, threads=2) as reader:
        reader.read_many(
            [
                ("proj", [[0, 3], [0, 8]], p.t()),
                ("qkv", [[0, 12], [0, 4]], torch.nn.Parameter(torch.empty(12, 4))),
            ]
        )
    assert torch.equal(p.detach(), full["proj"].t())
