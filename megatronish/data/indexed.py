"""Megatron-compatible indexed dataset files (MMIDIDX): a ``.bin`` of tokens and an ``.idx`` index.

``.idx`` layout (all little endian), identical to Megatron-LM's ``indexed_dataset.py``::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version (1)
    <B        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
              8 uint16)
    <Q        number of sequences S
    <Q        number of document-index entries D (= documents + 1)
    int32[S]  sequence lengths (in tokens)
    int64[S]  sequence byte offsets into the .bin
    int64[D]  document index: document d spans sequences [doc[d], doc[d + 1])

The ``.bin`` holds the sequences back to back. The writer stores one sequence per document.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from collections.abc import Sequence
from types import TracebackType

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

_PREPROCESS_HINT = "create it with tools/preprocess_data.py (see --help)"


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's numeric code for ``dtype``."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"dtype {dt} has no MMIDIDX code; use one of {sorted(map(str, _CODE_OF))}")
    return _CODE_OF[dt]


def dtype_for_vocab(vocab_size: int) -> type[np.number]:
    """Smallest token dtype for ``vocab_size`` (Megatron's rule): uint16 below 65500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def index_header(dtype: np.dtype | type, num_sequences: int, num_documents: int) -> bytes:
    """The fixed 34-byte ``.idx`` header for ``num_documents`` documents."""
    return (
        MAGIC
        + struct.pack("<Q", VERSION)
        + struct.pack("<B", dtype_code(dtype))
        + struct.pack("<Q", num_sequences)
        + struct.pack("<Q", num_documents + 1)
    )


class IndexedDatasetWriter:
    """Streams documents into ``prefix.bin`` and writes ``prefix.idx`` on :meth:`finalize`.

    Both files are written under temporary names in the target directory and renamed into
    place at the end, so readers never see a half-written dataset.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type) -> None:
        self.prefix = os.path.expanduser(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validate early
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._tag = uuid.uuid4().hex[:12]
        self._tmp_bin = f"{self.prefix}.bin.{self._tag}.tmp"
        self._bin = open(self._tmp_bin, "xb")  # closed in finalize() / abort()
        self._lengths: list[np.ndarray] = []
        self._finalized = False
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (stored as one sequence)."""
        arr = np.asarray(tokens)
        self.add_documents(arr.reshape(-1), [arr.size])

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append many documents at once: ``tokens`` is their concatenation, ``lengths`` sizes."""
        if self._finalized:
            raise RuntimeError(f"writer for {self.prefix} is already finalized")
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        tokens = np.asarray(tokens).reshape(-1)
        if int(lengths.sum()) != tokens.size or (lengths < 0).any():
            raise ValueError(f"lengths sum to {lengths.sum()} but got {tokens.size} tokens")
        if self._limits is not None and tokens.size and tokens.dtype != self.dtype:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < self._limits.min or hi > self._limits.max:
                raise ValueError(
                    f"token ids in [{lo}, {hi}] do not fit {self.dtype} for {self.prefix}.bin; "
                    "use a wider dtype (see dtype_for_vocab)"
                )
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(lengths)

    def finalize(self) -> None:
        """Write the index and atomically move both files to ``prefix.bin`` / ``prefix.idx``;
        on a failure (a full disk) neither is published and the temporary files are removed."""
        if self._finalized:
            return
        try:
            self._publish()
        except BaseException:
            self.abort()
            raise

    def _publish(self) -> None:
        self._bin.close()
        self._finalized = True
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document is longer than 2**31-1 tokens; split it")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.arange(lengths.size + 1, dtype=np.int64)
        tmp_idx = f"{self.prefix}.idx.{self._tag}.tmp"
        with open(tmp_idx, "xb") as f:
            f.write(index_header(self.dtype, lengths.size, lengths.size))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(doc_index.tobytes())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")

    def abort(self) -> None:
        """Drop the partial output (called automatically when a ``with`` block raises)."""
        self._finalized = True
        with contextlib.suppress(OSError):  # closing flushes, which fails again on a full disk
            self._bin.close()
        for path in (self._tmp_bin, f"{self.prefix}.idx.{self._tag}.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only memory-mapped view of ``prefix.bin`` / ``prefix.idx``; item ``i`` is sequence i."""

    def __init__(self, prefix: str) -> None:
        self.prefix = os.path.expanduser(prefix)
        self.bin_path = self.prefix + ".bin"
        self.idx_path = self.prefix + ".idx"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"indexed dataset file {path} does not exist; {_PREPROCESS_HINT} "
                    f"(pass the path prefix without .bin/.idx)"
                )
        self._read_index()
        self._open_bin()

    def _read_index(self) -> None:
        with open(self.idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC[: len(header)]:
            raise ValueError(
                f"{self.idx_path} is not an MMIDIDX index (bad magic bytes "
                f"{header[: len(MAGIC)]!r}); it is corrupt or another format, {_PREPROCESS_HINT}"
            )
        if len(header) < HEADER_SIZE:
            raise ValueError(
                f"{self.idx_path} is truncated: {len(header)} bytes, shorter than the "
                f"{HEADER_SIZE}-byte header; {_PREPROCESS_HINT}"
            )
        (version,) = struct.unpack_from("<Q", header, 9)
        (code,) = struct.unpack_from("<B", header, 17)
        n_seq, n_doc = struct.unpack_from("<QQ", header, 18)
        if version != VERSION:
            raise ValueError(f"{self.idx_path}: unsupported MMIDIDX version {version} (expected 1)")
        if code not in DTYPE_CODES:
            raise ValueError(f"{self.idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
        actual = os.path.getsize(self.idx_path)
        if actual not in (expected, expected + n_seq):  # + n_seq: optional int8 sequence modes
            raise ValueError(
                f"{self.idx_path} is truncated or corrupt: header promises {expected} bytes, "
                f"file has {actual}; {_PREPROCESS_HINT}"
            )
        idx = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        off += 4 * n_seq
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off)
        self._check_tables(n_seq)
        self._token_offsets = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self._token_offsets[1:])
        if not np.array_equal(self.pointers, self._token_offsets[:-1] * self.dtype.itemsize):
            raise ValueError(self._pointer_problem())

    def _pointer_problem(self) -> str:
        """Why the byte pointers disagree with the sequence lengths and the dtype."""
        offsets = self._token_offsets[:-1]
        for size in sorted({np.dtype(t).itemsize for t in DTYPE_CODES.values()}):
            if size != self.dtype.itemsize and np.array_equal(self.pointers, offsets * size):
                return (
                    f"{self.idx_path}: its header's dtype byte says {self.dtype} "
                    f"({self.dtype.itemsize} bytes per token) but its pointers are "
                    f"{size} bytes per token: the header does not match {self.bin_path} "
                    "(edited or damaged); regenerate both with tools/preprocess_data.py"
                )
        return (
            f"{self.idx_path}: sequences are not stored contiguously in {self.bin_path}; "
            "only contiguous MMIDIDX files are supported"
        )

    def _check_tables(self, n_seq: int) -> None:
        """Refuse an index whose tables contradict each other (a damaged or edited file)."""
        doc = self.document_indices
        problem = None
        if (self.sizes < 0).any():
            problem = f"a negative sequence length ({int(self.sizes.min())})"
        elif doc.size == 0 or doc[0] != 0 or doc[-1] != n_seq:
            ends = f"[{doc[0]}, ..., {doc[-1]}]" if doc.size else "empty"
            problem = f"a document index {ends} that does not span sequences 0..{n_seq}"
        elif (doc[1:] < doc[:-1]).any():
            problem = "a document index that goes backwards"
        if problem:
            raise ValueError(f"{self.idx_path} is corrupt: it has {problem}; {_PREPROCESS_HINT}")

    def _open_bin(self) -> None:
        expected = int(self._token_offsets[-1]) * self.dtype.itemsize
        actual = os.path.getsize(self.bin_path)
        if actual != expected:
            raise ValueError(
                f"{self.bin_path} has {actual} bytes but {self.idx_path} describes "
                f"{len(self)} sequences totalling {expected} bytes ({self.dtype}); the .bin is "
                f"truncated or does not belong to this .idx. Regenerate both with "
                f"tools/preprocess_data.py"
            )
        if expected == 0:
            self.tokens = np.zeros(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(self.bin_path, mode="r", dtype=self.dtype)

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}  # reopen the mmaps instead of pickling the data

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in the ``.bin``."""
        return int(self._token_offsets[-1])

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end if length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({n} sequences)")
        i %= n
        start = int(self._token_offsets[i])
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"range [{offset}, {offset + length}) outside sequence {i} ({size})")
        return np.asarray(self.tokens[start + offset : start + offset + length])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))

    def document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Per document: (first token position in the .bin, length in tokens), both int64."""
        di = self.document_indices
        starts = self._token_offsets[di[:-1]]
        return starts, self._token_offsets[di[1:]] - starts
