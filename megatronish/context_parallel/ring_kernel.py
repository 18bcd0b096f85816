"""One block of ring attention: queries against one block of keys, with the rows' log-sum-exp,
and that block's backward given the whole row's output and log-sum-exp.

Ring attention sees a query's keys a block at a time; each block's partial output is merged by
its log-sum-exp (:func:`merge_block`). In backward a block's share of the gradients is exactly
the fused kernel's backward run with the *merged* output and log-sum-exp: the softmax of the
whole row is ``exp(scores - lse)`` whichever block the scores come from.

Kernels, by device and dtype (:func:`block_kernel`):

- ``cpu_flash``: ATen's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), which
  returns the log-sum-exp and takes grouped kv heads as they are; with packed documents an
  additive ``[b, 1, queries, keys]`` mask (:meth:`BlockDocuments.additive`).
- ``cuda_flash``: the CUDA flash kernel for bf16/fp16 and head dims up to 256, without masks.
  Grouped K/V go in as they are where SDPA's own rule runs flash on them so
  (:func:`flash_expands_kv`, as torch's ``causal_lower_right`` hands grouped K/V to this op
  once ``can_use_flash_attention`` admits them), else copied to the query heads and their grads
  summed back.
- ``math``: the same in plain fp32 matmuls, for what the fused kernels do not take (fp32 on
  CUDA, document masks on CUDA); and the reference the tests hold the fused ones to. It runs
  ``rows`` queries at a time (:func:`math_tile_rows`), so what it allocates beyond its inputs
  and outputs is two fp32 score tiles of at most :data:`MATH_TILE_BYTES` each (the forward's
  scores and logsumexp's temporary, the backward's probabilities and their gradient), plus,
  with documents, a tile's visibility built from the document ids
  (:meth:`BlockDocuments.visible`): no ``[queries, keys]`` mask exists. The planner counts the
  same (:func:`~megatronish.plan.context_parallel.ring_workspace`).

No dropout: ring attention refuses ``model.attention_dropout > 0`` (config validation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatronish.context_parallel.attention_kernel import kernel_for

aten = torch.ops.aten
MATH_TILE_BYTES = 1 << 28  # the most one fp32 score tile of the math kernel holds (256 MiB)


@dataclass(frozen=True)
class BlockOut:
    """A block's output ``[b, heads, queries, d]`` and its rows' log-sum-exp ``[b, heads,
    queries]`` (fp32); ``extra``: what the CUDA flash kernel's backward needs of its forward
    (its extras, then whether K/V were expanded)."""

    out: torch.Tensor
    lse: torch.Tensor
    extra: tuple = ()


@dataclass(eq=False)
class BlockDocuments:
    """Which keys of a block each query row sees with packed documents: key ``j`` when it is in
    the row's document and not after it (whole-sequence positions). ``query_ids`` ``[b,
    queries]``, ``key_ids`` ``[b, keys]``: the tokens' documents; ``query_positions``
    ``[queries]``, ``key_positions`` ``[keys]``: their positions in the sequence."""

    query_ids: torch.Tensor
    key_ids: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    _additive: dict = field(default_factory=dict, repr=False)

    def visible(self, rows: slice = slice(None)) -> torch.Tensor:
        """``[b, 1, len(rows), keys]`` bool: which keys the query rows ``rows`` see."""
        ids, positions = self.query_ids[:, rows], self.query_positions[rows]
        same = ids[:, :, None] == self.key_ids[:, None, :]
        return (same & (self.key_positions[None, None, :] <= positions[None, :, None])).unsqueeze(1)

    def additive(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The additive ``[b, 1, queries, keys]`` mask (0 or -inf) the CPU kernel takes and
        which rows see any key (``[b, 1, queries]``), built once per dtype."""
        if dtype not in self._additive:
            visible = self.visible()
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            mask.masked_fill_(~visible, float("-inf"))
            self._additive[dtype] = (mask, visible.any(dim=-1))
        return self._additive[dtype]


def block_kernel(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool = False) -> str:
    """Which kernel a block of this device, dtype and head width (``masked``: with a document
    mask) runs (see the module doc)."""
    if device_type == "cpu":
        return "cpu_flash"
    half = dtype in (torch.bfloat16, torch.float16)
    if device_type == "cuda" and half and head_dim <= 256 and not masked:
        return "cuda_flash"
    return "math"


def flash_expands_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the CUDA flash kernel gets K/V copied to the query heads: grouped K/V where
    SDPA's rule (:func:`~.attention_kernel.kernel_for`, torch's own checks on CUDA, asked as
    for training) would not run flash on them as they are (an ``SDPAParams`` without
    ``enable_gqa``, flash turned off); never when the heads are equal."""
    if k.shape[1] == q.shape[1]:
        return False
    with torch.enable_grad():
        kernel = kernel_for(q, k, v, "causal", is_causal=True)
    return kernel.name != "flash" or kernel.expand_kv


def math_tile_rows(
    batch: int, heads: int, queries: int, keys: int, tile_bytes: int | None = None
) -> int:
    """Query rows the math kernel takes at a time: the most whose fp32 scores ``[batch, heads,
    rows, keys]`` fit ``tile_bytes`` (:data:`MATH_TILE_BYTES`), at least one, at most all."""
    budget = MATH_TILE_BYTES if tile_bytes is None else tile_bytes
    return max(1, min(queries, budget // max(1, batch * heads * keys * 4)))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Grads of K/V expanded to the query heads, summed back to the kv heads."""
    b, heads, s, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, s, d).sum(dim=2)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, heads, s, d = q.shape
    return q.view(b, kv_heads, heads // kv_heads, s, d)


def _tiles(q: torch.Tensor, k: torch.Tensor, tile_bytes: int | None) -> list[slice]:
    b, heads, sq, _ = q.shape
    rows = math_tile_rows(b, heads, sq, k.shape[2], tile_bytes)
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _tile_scores(
    q: torch.Tensor,
    k32: torch.Tensor,
    rows: slice,
    causal: bool,
    mask: torch.Tensor | None,
    documents: BlockDocuments | None,
) -> torch.Tensor:
    """fp32 scores ``[b, kv_heads, group, rows, keys]`` of the query rows ``rows`` (``k32``:
    the fp32 keys ``[b, kv_heads, 1, keys, d]``), hidden keys at -inf: causal from the top left,
    the additive ``mask`` ``[b, 1, queries, keys]``, or the ``documents``' rule."""
    scores = torch.matmul(_grouped(q[:, :, rows], k32.shape[1]).float(), k32.transpose(-1, -2))
    scores.mul_(q.shape[-1] ** -0.5)
    if causal:
        sk = scores.shape[-1]
        hidden = torch.ones(rows.stop - rows.start, sk, dtype=torch.bool, device=q.device)
        scores.masked_fill_(hidden.triu_(1 + rows.start), float("-inf"))
    if mask is not None:
        scores.add_(mask[:, :, rows].unsqueeze(2))
    if documents is not None:
        scores.masked_fill_(~documents.visible(rows).unsqueeze(2), float("-inf"))
    return scores


def math_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    documents: BlockDocuments | None = None,
    tile_bytes: int | None = None,
) -> BlockOut:
    """:func:`block_attention` in plain matmuls (fp32 scores, :func:`math_tile_rows` query rows
    at a time). A row that sees no key gets output 0 and log-sum-exp -inf."""
    b, heads, sq, d = q.shape
    kv_heads = k.shape[1]
    k32, v32 = k.float().unsqueeze(2), v.float().unsqueeze(2)
    out = torch.empty(b, kv_heads, heads // kv_heads, sq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, kv_heads, heads // kv_heads, sq, dtype=torch.float32, device=q.device)
    for rows in _tiles(q, k, tile_bytes):
        scores = _tile_scores(q, k32, rows, causal, mask, documents)
        tile_lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(tile_lse.unsqueeze(-1)).exp_()  # nan in rows that see nothing
        tile_out = torch.matmul(probs, v32)
        del scores, probs
        unseen = torch.isneginf(tile_lse)
        out[..., rows, :] = tile_out.masked_fill_(unseen.unsqueeze(-1), 0.0)
        lse[..., rows] = tile_lse
    return BlockOut(out.view(b, heads, sq, d), lse.view(b, heads, sq))


def math_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    documents: BlockDocuments | None = None,
    tile_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` in plain matmuls, tiled as :func:`math_block_attention` (dK and
    dV summed over the tiles in fp32)."""
    kv_heads, scale = k.shape[1], q.shape[-1] ** -0.5
    k32, v32 = k.float().unsqueeze(2), v.float().unsqueeze(2)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows in _tiles(q, k, tile_bytes):
        probs = _tile_scores(q, k32, rows, causal, mask, documents)
        probs.sub_(_grouped(lse[:, :, rows].unsqueeze(-1), kv_heads)).exp_()
        do = _grouped(dout[:, :, rows].float(), kv_heads)
        dv += torch.matmul(probs.transpose(-1, -2), do).sum(dim=2)
        delta = (do * _grouped(out[:, :, rows].float(), kv_heads)).sum(dim=-1, keepdim=True)
        ds = torch.matmul(do, v32.transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
        del probs
        tile_q = _grouped(q[:, :, rows].float(), kv_heads)
        dq[:, :, rows] = torch.matmul(ds, k32).flatten(1, 2)
        dk += torch.matmul(ds.transpose(-1, -2), tile_q).sum(dim=2)
        del ds
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    documents: BlockDocuments | None = None,
) -> BlockOut:
    """softmax(q k^T / sqrt(d)) v of ``q`` ``[b, heads, sq, d]`` against one block ``k``, ``v``
    ``[b, kv_heads, sk, d]`` (``causal``: query ``i`` sees keys ``<= i``, a square diagonal
    block; ``mask``: an additive ``[b, 1, sq, sk]`` mask instead, which the CUDA flash kernel
    does not take; ``documents``: packed documents' rule instead, rows that see none of the
    block's keys given output 0 and log-sum-exp -inf), with the rows' log-sum-exp. With a
    ``mask``, a row that sees no key of the block must be given :func:`unseen_rows` treatment
    by the caller (the kernels disagree on it)."""
    masked = mask is not None or documents is not None
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1], masked)
    if kernel == "cpu_flash":
        seen = None
        if documents is not None:
            mask, seen = documents.additive(q.dtype)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask
        )
        return BlockOut(out, lse) if seen is None else unseen_rows(BlockOut(out, lse), seen)
    if kernel == "cuda_flash":
        heads, expand = q.shape[1], flash_expands_kv(q, k, v)
        if expand:
            k, v = _expand(k, heads), _expand(v, heads)
        out, lse, *extra = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return BlockOut(out, lse, (*extra, expand))
    return math_block_attention(q, k, v, causal, mask, documents)


def unseen_rows(block: BlockOut, seen: torch.Tensor) -> BlockOut:
    """``block`` with the rows that see none of its keys (``seen`` ``[b, 1, sq]`` False) at
    output 0 and log-sum-exp -inf, so merging them changes nothing."""
    return BlockOut(
        block.out.masked_fill(~seen.unsqueeze(-1), 0.0),
        block.lse.masked_fill(~seen, float("-inf")),
        block.extra,
    )


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    extra: tuple = (),
    mask: torch.Tensor | None = None,
    documents: BlockDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of ``(dq, dk, dv)``, with ``out`` and ``lse`` those of the whole row
    (every block merged); ``extra``: the block's :class:`BlockOut` ``extra``; ``mask``,
    ``documents``: as the forward's."""
    masked = mask is not None or documents is not None
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1], masked)
    if kernel == "cpu_flash":
        if documents is not None:
            mask = documents.additive(q.dtype)[0]
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask
        )
    if kernel == "cuda_flash":
        heads, kv_heads = q.shape[1], k.shape[1]
        cum_q, cum_k, _, _, seed, offset, _, expand = extra
        if expand:
            k, v = _expand(k, heads), _expand(v, heads)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset
        )
        return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
    return math_block_backward(dout, q, k, v, out, lse, causal, mask, documents)


def merge_block(
    out: torch.Tensor | None, lse: torch.Tensor | None, block: BlockOut
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 output and log-sum-exp of rows that saw ``(out, lse)``'s keys and then
    ``block``'s (None: no keys yet)."""
    new_out, new_lse = block.out.float(), block.lse.float()
    if out is None:
        return new_out, new_lse
    merged = torch.logaddexp(lse, new_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + new_out * torch.exp(
        new_lse - merged
    ).unsqueeze(-1)
    return out, merged
