"""One block of ring attention: queries against one block of keys, with the rows' log-sum-exp,
and that block's backward given the whole row's output and log-sum-exp.

Ring attention sees a query's keys a block at a time; each block's partial output is merged by
its log-sum-exp (:func:`merge_block`). In backward a block's share of the gradients is exactly
the fused kernel's backward run with the *merged* output and log-sum-exp: the softmax of the
whole row is ``exp(scores - lse)`` whichever block the scores come from.

Kernels, by device and dtype (:func:`block_kernel`):

- ``cpu_flash``: ATen's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), which
  returns the log-sum-exp and takes grouped kv heads as they are.
- ``cuda_flash``: the CUDA flash kernel for bf16/fp16 and head dims up to 256 (K/V expanded to
  the query heads, their grads summed back to the kv heads), without masks.
- ``math``: the same in plain matmuls (a ``[queries, keys]`` score block is materialised), for
  what the fused kernels do not take (fp32 on CUDA, document masks on CUDA); and the
  reference the tests hold the fused ones to.

No dropout: ring attention refuses ``model.attention_dropout > 0`` (config validation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockOut:
    """A block's output ``[b, heads, queries, d]`` and its rows' log-sum-exp ``[b, heads,
    queries]`` (fp32); ``extra``: what the CUDA flash kernel's backward needs of its forward."""

    out: torch.Tensor
    lse: torch.Tensor
    extra: tuple = ()


def block_kernel(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool = False) -> str:
    """Which kernel a block of this device, dtype and head width (``masked``: with a document
    mask) runs (see the module doc)."""
    if device_type == "cpu":
        return "cpu_flash"
    half = dtype in (torch.bfloat16, torch.float16)
    if device_type == "cuda" and half and head_dim <= 256 and not masked:
        return "cuda_flash"
    return "math"


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


def _math_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """fp32 scores ``[b, kv_heads, group, queries, keys]``, causal from the top left, plus the
    additive ``mask`` ``[b, 1, queries, keys]``."""
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(_grouped(q, k.shape[1]).float(), k.float().unsqueeze(2).transpose(-1, -2))
    scores = scores * scale
    if causal:
        sq, sk = scores.shape[-2:]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if mask is not None:
        scores = scores + mask.float().unsqueeze(2)
    return scores


def math_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> BlockOut:
    """:func:`block_attention` in plain matmuls (fp32 scores)."""
    scores = _math_scores(q, k, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float().unsqueeze(2))
    b, heads, s, d = q.shape
    return BlockOut(out.reshape(b, heads, s, d).to(q.dtype), lse.reshape(b, heads, s))


def math_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` in plain matmuls."""
    kv_heads, scale = k.shape[1], q.shape[-1] ** -0.5
    scores = _math_scores(q, k, causal, mask)
    p = torch.exp(scores - _grouped(lse.unsqueeze(-1), kv_heads))
    do = _grouped(dout.float(), kv_heads)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(dim=2)
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
    delta = (do * _grouped(out.float(), kv_heads)).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.float().unsqueeze(2)).reshape(q.shape)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.float(), kv_heads)).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> BlockOut:
    """softmax(q k^T / sqrt(d)) v of ``q`` ``[b, heads, sq, d]`` against one block ``k``, ``v``
    ``[b, kv_heads, sk, d]`` (``causal``: query ``i`` sees keys ``<= i``, a square diagonal
    block; ``mask``: an additive ``[b, 1, sq, sk]`` mask instead, which the CUDA flash kernel
    does not take), with the rows' log-sum-exp. A row that sees no key of the block must be
    given :func:`unseen_rows` treatment by the caller (the kernels disagree on it)."""
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1], mask is not None)
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask
        )
        return BlockOut(out, lse)
    if kernel == "cuda_flash":
        heads = q.shape[1]
        out, lse, *extra = aten._scaled_dot_product_flash_attention(
            q, _expand(k, heads), _expand(v, heads), 0.0, causal
        )
        return BlockOut(out, lse, tuple(extra))
    return math_block_attention(q, k, v, causal, mask)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of ``(dq, dk, dv)``, with ``out`` and ``lse`` those of the whole row
    (every block merged); ``extra``: the block's :class:`BlockOut` ``extra``; ``mask``: as
    the forward's."""
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1], mask is not None)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask
        )
    if kernel == "cuda_flash":
        heads, kv_heads = q.shape[1], k.shape[1]
        cum_q, cum_k, _, _, seed, offset, _ = extra
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            _expand(k, heads),
            _expand(v, heads),
            out,
            lse,
            cum_q,
            cum_k,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
        )
        return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
    return math_block_backward(dout, q, k, v, out, lse, causal, mask)


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
