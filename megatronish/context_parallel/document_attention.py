"""Causal attention that stops at document boundaries, with and without context parallelism.

Query ``i`` sees key ``j`` when ``j <= i`` (positions in the whole sequence) and both tokens are
in the same document (:class:`~megatronish.context_parallel.documents.Documents` ``ids``). Under
cp the queries are this rank's two chunks and the keys the all-gathered whole sequence, as in
:func:`~megatronish.context_parallel.attention.cp_causal_attention`: the split, the K/V
all-gather and its volume are the same with documents as without; only the mask differs.

- CUDA, without attention dropout: FlexAttention with a block mask built once per microbatch
  from the document ids. Blocks outside every document are skipped and no ``[s, s]`` mask
  exists (the block mask is built by a compiled kernel too).
- CPU, cp = 1: SDPA per segment of whole documents (``Documents.segments``, host integers,
  no device read): a long document alone with plain causal attention, short neighbours
  together with their mask. The fused CPU kernel skips the blocks above the diagonal only
  without a mask, so a window-sized mask costs about twice causal attention; one call per
  document costs ~0.3 ms each (tools/bench/packed.py has the measurements).
- Otherwise (CPU under cp; CUDA with attention dropout, which FlexAttention lacks): SDPA with
  an additive ``[b, 1, queries, keys]`` mask built once per microbatch and shared by every
  layer; under cp one per local chunk, its keys ending at the chunk's end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.attention_kernel import sdpa
from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.split import chunk_ids


def document_mask(
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    query_positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive ``[b, 1, queries, keys]`` mask (0 or -inf): query ``q`` (whole-sequence
    position ``query_positions[q]``, document ``query_ids[:, q]``) sees keys ``0 ..
    position`` of its own document (``key_ids`` ``[b, keys]``). Every query sees itself."""
    keys = torch.arange(key_ids.shape[1], device=key_ids.device)
    visible = (query_ids[:, :, None] == key_ids[:, None, :]) & (
        keys[None, None, :] <= query_positions[None, :, None]
    )
    mask = torch.zeros(visible.shape, dtype=dtype, device=key_ids.device)
    return mask.masked_fill_(~visible, float("-inf")).unsqueeze(1)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents,
    cp: CPContext,
    dropout_p: float,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v within documents, for queries ``[b, heads, s/cp, d]`` and the
    whole sequence's keys and values ``[b, kv_heads, s, d]`` (the same tokens when cp = 1)."""
    if q.is_cuda and dropout_p == 0:
        return flex_document_attention(q, k, v, documents, cp)
    if not q.is_cuda and cp.size == 1 and documents.segments is not None:
        return segmented_document_attention(q, k, v, documents, dropout_p)
    return masked_document_attention(q, k, v, documents, cp, dropout_p)


def segmented_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, dropout_p: float
) -> torch.Tensor:
    """:func:`document_attention` (cp = 1) by SDPA per segment of whole documents; neighbouring
    samples with the same segments run as one batch."""
    ids, segments = documents.ids, documents.segments
    outs, row = [], 0
    while row < len(segments):
        end = row + 1
        while end < len(segments) and segments[end] == segments[row]:
            end += 1
        pieces = []
        for start, stop, several in segments[row]:
            qs, ks, vs = (t[row:end, :, start:stop] for t in (q, k, v))
            if not several:
                pieces.append(sdpa(qs, ks, vs, "causal", dropout_p=dropout_p, is_causal=True))
                continue

            def mask(rows: slice = slice(row, end), span: slice = slice(start, stop)):
                local = ids[rows, span]
                positions = torch.arange(local.shape[1], device=local.device)
                return document_mask(local, local, positions, q.dtype)

            key = ("segment", row, end, start, q.dtype, q.device)
            m = documents.derived(key, mask)
            pieces.append(sdpa(qs, ks, vs, "tensor", attn_mask=m, dropout_p=dropout_p))
        outs.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
        row = end
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def masked_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents,
    cp: CPContext,
    dropout_p: float,
) -> torch.Tensor:
    """:func:`document_attention` by SDPA with a mask (see the module docstring)."""
    ids, dtype, device = documents.ids, q.dtype, q.device
    if cp.size == 1:
        s = q.shape[2]

        def whole() -> torch.Tensor:
            return document_mask(ids, ids, torch.arange(s, device=device), dtype)

        mask = documents.derived(("mask", dtype, device), whole)
        return sdpa(q, k, v, "tensor", attn_mask=mask, dropout_p=dropout_p)
    c = q.shape[2] // 2
    outs = []
    for slot, j in enumerate(chunk_ids(cp.size, cp.group.rank)):
        keys = (j + 1) * c

        def chunk(j: int = j, keys: int = keys) -> torch.Tensor:
            rows = torch.arange(j * c, keys, device=device)
            return document_mask(ids[:, j * c : keys], ids[:, :keys], rows, dtype)

        mask = documents.derived(("mask", j, dtype, device), chunk)
        outs.append(
            sdpa(
                q[:, :, slot * c : (slot + 1) * c],
                k[:, :, :keys],
                v[:, :, :keys],
                "tensor",
                attn_mask=mask,
                dropout_p=dropout_p,
            )
        )
    return torch.cat(outs, dim=2)


def document_block_mask(
    ids: torch.Tensor, query_positions: torch.Tensor, compiled: bool = True
) -> object:
    """FlexAttention ``BlockMask`` of :func:`document_mask`'s rule (``ids`` ``[b, s]`` the whole
    sequence's documents, ``query_positions`` the local queries' whole-sequence positions).
    ``compiled``: build it with a compiled kernel (no ``[b, queries, keys]`` intermediate)."""
    from torch.nn.attention.flex_attention import create_block_mask

    query_ids = ids[:, query_positions]

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (query_ids[b, q] == ids[b, kv]) & (query_positions[q] >= kv)

    b, keys = ids.shape
    queries = query_positions.numel()
    return create_block_mask(
        same_document_causal, b, None, queries, keys, device=ids.device, _compile=compiled
    )


@functools.cache
def compiled_flex_attention() -> Callable:
    """FlexAttention compiled once per process (uncompiled it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents,
    cp: CPContext,
    compiled: bool = True,
) -> torch.Tensor:
    """:func:`document_attention` by FlexAttention (no dropout). ``compiled=False`` runs its
    eager reference (tests on CPU, where FlexAttention has forward only)."""
    device = q.device
    if cp.size > 1:
        positions = cp.positions(device)
    else:
        positions = torch.arange(q.shape[2], device=device)

    def build() -> object:
        return document_block_mask(documents.ids, positions, compiled)

    block_mask = documents.derived(("block_mask", device, compiled), build)
    if compiled:
        attend = compiled_flex_attention()
    else:
        from torch.nn.attention.flex_attention import flex_attention as attend
    return attend(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
