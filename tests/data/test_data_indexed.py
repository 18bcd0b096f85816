"""MMIDIDX .bin/.idx writer and reader: round trips, exact Megatron layout, clear errors."""

import os
import struct

import numpy as np
import pytest

from megatronish.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab

DOCS = [[5, 6, 7], [], [1], list(range(100, 140)), [65000, 0, 3]]


def _write(prefix, docs, dtype):
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    prefix = _write(tmp_path / "ds", DOCS, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(DOCS)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(d) for d in DOCS]
    assert ds.num_tokens == sum(map(len, DOCS))
    for i, d in enumerate(DOCS):
        assert ds[i].tolist() == d
        assert ds[i].dtype == np.dtype(dtype)
    assert ds.get(3, offset=5, length=4).tolist() == [105, 106, 107, 108]
    assert ds.get(3, offset=38).tolist() == [138, 139]
    assert ds[-1].tolist() == DOCS[-1]
    with pytest.raises(IndexError):
        ds[len(DOCS)]
    assert os.path.getsize(prefix + ".bin") == ds.num_tokens * np.dtype(dtype).itemsize
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_add_documents_batched_equals_one_by_one(tmp_path):
    a = IndexedDataset(_write(tmp_path / "a", DOCS, np.int32))
    with IndexedDatasetWriter(str(tmp_path / "b"), np.int32) as w:
        w.add_documents(np.concatenate([np.array(d, np.int64) for d in DOCS]), list(map(len, DOCS)))
    b = IndexedDataset(str(tmp_path / "b"))
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    assert all(np.array_equal(a[i], b[i]) for i in range(len(DOCS)))


def test_idx_bytes_match_megatron_layout(tmp_path):
    _write(tmp_path / "ds", DOCS, np.uint16)
    lengths = [len(d) for d in DOCS]
    pointers = [2 * sum(lengths[:i]) for i in range(len(lengths))]
    expected = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    expected += struct.pack("<Q", len(DOCS)) + struct.pack("<Q", len(DOCS) + 1)
    expected += struct.pack(f"<{len(DOCS)}i", *lengths)
    expected += struct.pack(f"<{len(DOCS)}q", *pointers)
    expected += struct.pack(f"<{len(DOCS) + 1}q", *range(len(DOCS) + 1))
    assert (tmp_path / "ds.idx").read_bytes() == expected
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack(
        f"<{sum(lengths)}H", *[t for d in DOCS for t in d]
    )
    _write(tmp_path / "i", DOCS, np.int32)
    assert (tmp_path / "i.idx").read_bytes()[17] == 4  # Megatron's int32 code


def test_dtype_for_vocab():
    assert dtype_for_vocab(4096) is np.uint16
    assert dtype_for_vocab(65499) is np.uint16
    assert dtype_for_vocab(65500) is np.int32
    assert dtype_for_vocab(128_000) is np.int32


def test_token_out_of_dtype_range_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        _write(tmp_path / "ds", [[70000]], np.uint16)
    assert not list(tmp_path.iterdir())  # aborted writer leaves nothing behind


def test_truncated_bin_names_both_files_and_sizes(tmp_path):
    prefix = _write(tmp_path / "ds", DOCS, np.uint16)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    assert prefix + ".bin" in msg and prefix + ".idx" in msg
    assert str(size) in msg and str(size - 2) in msg


def test_bad_magic(tmp_path):
    prefix = _write(tmp_path / "ds", DOCS, np.uint16)
    data = bytearray((tmp_path / "ds.idx").read_bytes())
    data[:4] = b"NOPE"
    (tmp_path / "ds.idx").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(prefix)


def test_dtype_byte_that_does_not_match_the_bin_says_so(tmp_path):
    prefix = _write(tmp_path / "ds", DOCS, np.uint16)
    data = bytearray((tmp_path / "ds.idx").read_bytes())
    assert data[17] == 8  # after the 9-byte magic and the 8-byte version: uint16
    data[17] = 4  # int32
    (tmp_path / "ds.idx").write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    message = str(err.value)
    assert "header's dtype byte says int32 (4 bytes per token)" in message
    assert "its pointers are 2 bytes per token" in message and "preprocess_data.py" in message
    assert "contiguously" not in message


def test_truncated_idx(tmp_path):
    prefix = _write(tmp_path / "ds", DOCS, np.uint16)
    data = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file_names_path(tmp_path, missing):
    prefix = _write(tmp_path / "ds", DOCS, np.uint16)
    os.unlink(prefix + missing)
    with pytest.raises(FileNotFoundError) as err:
        IndexedDataset(prefix)
    assert prefix + missing in str(err.value)
    assert "preprocess_data.py" in str(err.value)
