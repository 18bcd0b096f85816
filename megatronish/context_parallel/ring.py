"""Ring attention (``parallel.cp_comm_type=ring``): K/V blocks passed around the cp ring.

Each cp rank holds the queries, keys and values of its two load-balanced chunks
(:mod:`~megatronish.context_parallel.split`: chunks ``r`` and ``2cp - 1 - r``). At step ``i`` of
``cp`` rank ``r`` holds the K/V block of rank ``(r - i) mod cp`` (:func:`ring_owner`) and, while
it computes that block's attention, passes it on to rank ``r + 1`` and receives the next from
``r - 1`` in one batched group (:func:`step_transfers`). Which queries see which keys
(:func:`block_part`, Megatron-LM's rule for the load-balanced chunks):

- its own block (step 0): causal attention over its ``2c`` tokens (they are in order);
- an earlier rank's block: every query against that rank's first chunk only;
- a later rank's block: the second query chunk against both of its chunks.

Partial outputs are merged by their rows' log-sum-exp
(:func:`~megatronish.context_parallel.ring_kernel.merge_block`). Backward passes the K/V
blocks around again and, one step behind them, the blocks' dK/dV accumulators: the
accumulator of rank ``o``'s block gains each rank's share as it travels and reaches ``o``
after ``cp`` hops. Accumulators travel in fp32 and are rounded to the inputs' dtype once, at
home (a bf16 accumulator would be rounded at every hop). Every transfer of a step goes out in
one group posted before the step's compute and waited after it, so the transfers overlap the
attention; messages are named ``(kind, step, owner)`` the same way by both ends, and the posts
obey NCCL's order per pair (proved by :mod:`~megatronish.pipeline.nccl_sim` on the recorded
posts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.ring_kernel import (
    BlockDocuments,
    BlockOut,
    block_attention,
    block_backward,
    merge_block,
)
from megatronish.context_parallel.split import chunk_ids
from megatronish.distributed.p2p import P2PCommunicator, Transfer

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

    from megatronish.context_parallel.attention import CPContext

Masked = BlockDocuments | None  # which keys of the held block each query row sees

DIAGONAL, FIRST_KEYS, SECOND_QUERIES = "diagonal", "first_keys", "second_queries"


def ring_owner(rank: int, step: int, cp: int) -> int:
    """The cp rank whose K/V block rank ``rank`` holds at ``step``."""
    return (rank - step) % cp


def block_part(rank: int, owner: int) -> str:
    """Which queries of ``rank`` see which keys of ``owner``'s block (see the module doc)."""
    if owner == rank:
        return DIAGONAL
    return FIRST_KEYS if owner < rank else SECOND_QUERIES


def step_transfers(
    rank: int, step: int, cp: int, backward: bool
) -> list[tuple[str, int, tuple[str, int, int]]]:
    """``(kind, peer, message)`` of the group rank ``rank`` posts at ``step`` (``step == cp``:
    backward's last group, the accumulators' final hop home); messages ``(what, step, owner)``.

    Forward step ``i < cp - 1``: the held K/V block to ``rank + 1``, the next from
    ``rank - 1``. Backward adds, from step 1 on, the accumulator of the block held one step
    before to ``rank + 1`` and the one of this step's block from ``rank - 1``."""
    nxt, prev = (rank + 1) % cp, (rank - 1) % cp
    out = []
    if step < cp - 1:
        owner = ring_owner(rank, step, cp)
        out.append(("send", nxt, ("kv", step + 1, owner)))
        out.append(("recv", prev, ("kv", step + 1, ring_owner(rank, step + 1, cp))))
    if backward and step >= 1:
        out.append(("send", nxt, ("dkv", step, ring_owner(rank, step - 1, cp))))
        out.append(("recv", prev, ("dkv", step, ring_owner(rank, step, cp))))
    return out


def ring_posts(rank: int, cp: int, backward: bool) -> list[list[tuple[str, int, tuple]]]:
    """Every group rank ``rank`` posts for one attention's forward (or backward), in order."""
    steps = range(cp + 1) if backward else range(cp - 1)
    return [step_transfers(rank, i, cp, backward) for i in steps]


def _post(
    comm: P2PCommunicator, rank: int, step: int, cp: int, backward: bool, tensors: dict
) -> tuple[object, dict]:
    """Post the step's group; ``tensors``: what to send per kind; returns the work and the
    receive buffers per kind."""
    transfers, received = [], {}
    for kind, peer, message in step_transfers(rank, step, cp, backward):
        what = message[0]
        if kind == "send":
            transfers.append(Transfer("send", peer, tensors[what], message))
        else:
            received[what] = torch.empty_like(tensors[what])
            transfers.append(Transfer("recv", peer, received[what], message))
    return comm.post(transfers), received


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = x.shape[2] // 2
    return x[:, :, :c], x[:, :, c:]


def _positions(chunks: tuple[int, ...], c: int, device: torch.device) -> torch.Tensor:
    """Whole-sequence positions of ``chunks`` (of ``c`` tokens each), in order (built on the
    device: no host-to-device copy)."""
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in chunks])


def block_mask(
    documents: Documents | None, cp: CPContext, owner: int, device: torch.device
) -> Masked:
    """With packed documents, which keys of ``owner``'s block this rank's queries see (as
    :func:`block_part` cuts them; causal within a document): their documents and positions,
    built once per microbatch (the kernels build their masks from it). None without
    documents."""
    if documents is None or documents.ids is None:
        return None
    rank, size = cp.group.rank, cp.size
    part = block_part(rank, owner)

    def build() -> BlockDocuments:
        c = documents.ids.shape[1] // (2 * size)
        mine, theirs = chunk_ids(size, rank), chunk_ids(size, owner)
        queries = mine[1:] if part == SECOND_QUERIES else mine
        keys = theirs[:1] if part == FIRST_KEYS else theirs
        q_pos, k_pos = _positions(queries, c, device), _positions(keys, c, device)
        ids = documents.ids
        return BlockDocuments(ids[:, q_pos], ids[:, k_pos], q_pos, k_pos)

    return documents.derived(("ring", owner, str(device)), build)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cp: CPContext,
        documents: Documents | None,
    ) -> torch.Tensor:
        comm, rank, size = cp.communicator(), cp.group.rank, cp.size
        kv_heads = k.shape[1]
        kv = torch.cat([k, v], dim=1)  # one message per step
        out = lse = None
        for step in range(size):
            work, got = None, {}
            if step < size - 1:
                work, got = _post(comm, rank, step, size, False, {"kv": kv})
            owner = ring_owner(rank, step, size)
            masked = block_mask(documents, cp, owner, q.device)
            out, lse, extra = _merge(q, kv, kv_heads, block_part(rank, owner), out, lse, masked)
            if step == 0:  # the CUDA flash kernel's backward takes its forward's extras (and
                # whether it expanded K/V: one decision for every block of the layer)
                ctx.extra = extra
            if work is not None:
                work.wait()
                kv = got["kv"]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.documents = cp, documents
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        comm, rank, size = cp.communicator(), cp.group.rank, cp.size
        kv_heads, dout = k.shape[1], dout.contiguous()
        kv = torch.cat([k, v], dim=1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        acc = None  # the fp32 dK|dV accumulator of the block held the step before
        for step in range(size):
            work, got = _post(comm, rank, step, size, True, {"kv": kv, "dkv": acc})
            owner = ring_owner(rank, step, size)
            masked = block_mask(ctx.documents, cp, owner, q.device)
            part = block_part(rank, owner)
            dkv = _block_grads(q, kv, kv_heads, dout, out, lse, part, dq, masked, ctx.extra)
            work.wait()
            acc = dkv if step == 0 else got["dkv"].add_(dkv)
            kv = got.get("kv", kv)
        work, got = _post(comm, rank, size, size, True, {"dkv": acc})
        work.wait()
        dk, dv = got["dkv"].to(kv.dtype).split(kv_heads, dim=1)
        return dq.to(q.dtype), dk, dv, None, None


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, masked: Masked
) -> BlockOut:
    if masked is None:
        return block_attention(q, k, v, causal)
    return block_attention(q, k, v, False, documents=masked)


def _merge(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_heads: int,
    part: str,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    masked: Masked,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Merge ``part`` of the held block into the rows' output and log-sum-exp; also returns
    the block's kernel extras."""
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    if part == DIAGONAL:
        block = _attend(q, k, v, True, masked)
        return (*merge_block(out, lse, block), block.extra)
    if part == FIRST_KEYS:
        (k0, _), (v0, _) = _halves(k), _halves(v)
        block = _attend(q, k0, v0, False, masked)
        return (*merge_block(out, lse, block), block.extra)
    c = q.shape[2] // 2
    block = _attend(q[:, :, c:].contiguous(), k, v, False, masked)
    out_b, lse_b = merge_block(out[:, :, c:], lse[:, :, c:], block)
    out = torch.cat([out[:, :, :c], out_b], dim=2)
    return out, torch.cat([lse[:, :, :c], lse_b], dim=2), block.extra


def _block_grads(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_heads: int,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    part: str,
    dq: torch.Tensor,
    masked: Masked,
    extra: tuple,
) -> torch.Tensor:
    """This rank's share of the held block's dK|dV (fp32, the block's shape); adds its dQ
    share into ``dq``."""
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    kw = {"documents": masked, "extra": extra}
    causal = masked is None and part == DIAGONAL
    dkv = torch.zeros_like(kv, dtype=torch.float32)
    dk, dv = dkv[:, :kv_heads], dkv[:, kv_heads:]
    if part == DIAGONAL:
        gq, gk, gv = block_backward(dout, q, k, v, out, lse, causal, **kw)
        dq += gq
        dk += gk
        dv += gv
    elif part == FIRST_KEYS:
        c = k.shape[2] // 2
        gq, gk, gv = block_backward(dout, q, k[:, :, :c], v[:, :, :c], out, lse, False, **kw)
        dq += gq
        dk[:, :, :c] += gk
        dv[:, :, :c] += gv
    else:
        c = q.shape[2] // 2
        rows = (t[:, :, c:].contiguous() for t in (q, dout, out, lse))
        q1, dout1, out1, lse1 = rows
        gq, gk, gv = block_backward(dout1, q1, k, v, out1, lse1, False, **kw)
        dq[:, :, c:] += gq
        dk += gk
        dv += gv
    return dkv


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: CPContext,
    documents: Documents | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries ``[b, heads, s/cp, d]`` over the whole sequence,
    whose K/V ``[b, kv_heads, s/cp, d]`` (this rank's chunks) travel the cp ring; with
    ``documents`` (packed, ``ids`` set) within each query's document."""
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), cp, documents)
