"""How much page-locked host memory torch takes for a pinned tensor.

``torch.empty(..., pin_memory=True)`` and ``Tensor.pin_memory()`` go through torch's caching
host allocator (``aten/src/ATen/core/CachingHostAllocator.h``, ``CachingHostAllocatorImpl::
allocate``), which rounds every request up to the next power of two
(``c10::llvm::PowerOf2Ceil``: the block sizes index its free lists) and keeps freed blocks
cached for the rest of the process. Neither ``pinned_use_cuda_host_register`` (``malloc`` and
``cudaHostRegister`` of the rounded size instead of ``cudaHostAlloc``) nor
``pinned_use_background_threads`` (a thread that recycles freed blocks) changes a block's
size. torch 2.13 also reads ``pinned_max_round_threshold_mb`` and ``pinned_max_cached_size_mb``
(``PYTORCH_ALLOC_CONF``, unset by default): a request above either is pinned at its own size.
The plan assumes torch's defaults, so with those options a run pins at most what it planned.

So a run pins few, large blocks (one slab per kind, sliced per bucket) whose rounding the
planner adds up with :func:`pinned_block_bytes`, the rule both sides import.
"""

from __future__ import annotations


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's caching host allocator pins for a request of ``nbytes`` (its default
    settings): the next power of two, none for an empty request."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()
