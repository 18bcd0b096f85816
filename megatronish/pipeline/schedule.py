"""Pipeline schedules as pure op lists: 1F1B, interleaved 1F1B, ZB-H1 and ZBV.

The layer stack is cut into ``pp * vpp`` chunks; global chunk ``c`` lives on pipeline rank
``c % pp`` as that rank's virtual chunk ``c // pp``. Chunk 0 embeds the tokens, the last chunk
computes the loss. vpp = 1 is plain 1F1B (PipeDream-Flush, Narayanan et al. 2021, sec. 2.2.1);
vpp > 1 is Megatron-LM's interleaved 1F1B (same paper, sec. 2.2.2), which divides the bubble by
vpp at the cost of vpp times more point-to-point messages. ``zb-h1`` and ``zbv`` split each
backward into B and W (:mod:`megatronish.pipeline.zero_bubble`); ``zbv`` places the chunks in a
V (:func:`megatronish.model.build.chunk_ids_of_stage`), so a chunk's neighbour may sit on the
same rank: that hand-over is local, not a message.

Nothing here touches processes or tensors. ``schedule_ops`` places each receive just before and
each send just after its compute; :func:`megatronish.pipeline.simulate.simulate` times that
order with sends that never block (the bubble). A send on NCCL does block until the peer's
receive runs: with sends and receives posted one by one even plain 1F1B deadlocks, rank r
sending an activation while rank r+1 sends a gradient. So the executor posts them in groups,
Megatron-LM's batched isend/irecv: which transfers share a group is
:mod:`megatronish.pipeline.grouping`, and :mod:`megatronish.pipeline.nccl_sim` replays what
the executor posts under NCCL's semantics. Both keep every pair of ranks' messages in
``message_order``.
"""

from __future__ import annotations

from megatronish.config.pipeline_rules import (
    SPLIT_BACKWARD_SCHEDULES,
    V_SHAPE_SCHEDULES,
    pipeline_schedule_error,
    resolve_pipeline_schedule,
)
from megatronish.model.build import stage_of_chunk
from megatronish.pipeline.ops import INPUT_GRAD_KINDS, Op, message
from megatronish.pipeline.zero_bubble import zb_h1_order, zbv_order


def splits_backward(schedule: str) -> bool:
    """True for the schedules that run B and W as separate ops."""
    return schedule in SPLIT_BACKWARD_SCHEDULES


def v_shape(schedule: str) -> bool:
    """True for the schedule that places the chunks in a V (``zbv``)."""
    return schedule in V_SHAPE_SCHEDULES


def check_schedule(
    pp: int,
    vpp: int,
    num_microbatches: int,
    rank: int | None = None,
    schedule: str | None = None,
) -> str:
    """Raise ValueError (one line naming the fix) unless ``schedule`` (None: the default for
    vpp) runs pp / vpp / m on ``rank``; returns the schedule's name."""
    if pp < 1:
        raise ValueError(f"pp={pp} must be at least 1.")
    if vpp < 1:
        raise ValueError(f"vpp={vpp} must be at least 1; use vpp=1 for plain 1F1B.")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be at least 1.")
    if rank is not None and not 0 <= rank < pp:
        raise ValueError(f"rank={rank} must lie in [0, pp={pp}).")
    schedule = resolve_pipeline_schedule(schedule, vpp)
    if vpp > 1 and pp == 1 and schedule != "zbv":  # zbv's two legs may share one rank
        raise ValueError(
            f"vpp={vpp} needs pp > 1 (interleaving one stage gains nothing); set vpp=1."
        )
    error = pipeline_schedule_error(schedule, pp, vpp, num_microbatches)
    if error:
        raise ValueError(error + ".")
    return schedule


def num_warmup(pp: int, vpp: int, num_microbatches: int, rank: int) -> int:
    """Forwards a rank runs before its first backward.

    1F1B: rank r fills the pipe behind it with ``pp - r - 1`` forwards. Interleaved: every rank
    first runs ``(vpp - 1) * pp`` forwards so its last virtual chunk has work, then twice the
    1F1B count because each downstream hop now costs a forward *and* the backward coming back
    (Megatron-LM ``schedules.py``). Both are capped by the forwards that exist. Older Megatron
    forced all-forward-first when m == pp; newer versions (and we) only cap.
    """
    check_schedule(pp, vpp, num_microbatches, rank)
    if vpp == 1:
        return min(pp - rank - 1, num_microbatches)
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp, num_microbatches * vpp)


def _virtual_op(pp: int, vpp: int, rank: int, k: int, kind: str) -> Op:
    """The k-th forward (or backward) of a rank, as Megatron's ``get_model_chunk_id`` orders them.

    Microbatches advance in groups of pp: the group visits virtual chunks 0..vpp-1 going forward
    and vpp-1..0 going backward. With vpp = 1 this is simply microbatch k on the rank's chunk.
    """
    step_in_group = (k // pp) % vpp
    virtual = step_in_group if kind == "fwd" else vpp - 1 - step_in_group
    microbatch = (k // (pp * vpp)) * pp + k % pp
    return Op(kind, microbatch, virtual * pp + rank)


def compute_order(
    pp: int, vpp: int, num_microbatches: int, rank: int, schedule: str | None = None
) -> list[Op]:
    """The compute ops of ``rank`` in run order (1F1B and interleaved: warm-up, steady 1F1B,
    cool-down; the zero-bubble schedules: :mod:`megatronish.pipeline.zero_bubble`)."""
    schedule = check_schedule(pp, vpp, num_microbatches, rank, schedule)
    if schedule == "zb-h1":
        return zb_h1_order(pp, num_microbatches, rank)
    if schedule == "zbv":
        return zbv_order(pp, num_microbatches, rank)
    warmup = num_warmup(pp, vpp, num_microbatches, rank)
    total = num_microbatches * vpp
    fwd = lambda k: _virtual_op(pp, vpp, rank, k, "fwd")
    bwd = lambda k: _virtual_op(pp, vpp, rank, k, "bwd")
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: one forward, then one backward
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def transfers_around(
    pp: int, vpp: int, op: Op, schedule: str | None = None
) -> tuple[list[Op], list[Op]]:
    """The receives a compute ``op`` needs before it and the sends it makes after it (none for
    a neighbour chunk on the same rank, or for a W)."""
    v = v_shape(resolve_pipeline_schedule(schedule, vpp))
    last, mb, c = pp * vpp - 1, op.microbatch, op.chunk
    here = stage_of_chunk(c, pp, v)

    def peer(chunk: int) -> int | None:
        stage = stage_of_chunk(chunk, pp, v)
        return None if stage == here else stage

    if op.kind == "fwd":
        before, after = (c - 1 if c > 0 else None), (c + 1 if c < last else None)
        kinds = ("recv_act", "send_act")
    elif op.kind in INPUT_GRAD_KINDS:
        before, after = (c + 1 if c < last else None), (c - 1 if c > 0 else None)
        kinds = ("recv_grad", "send_grad")
    else:
        return [], []
    recvs = (
        [Op(kinds[0], mb, c, peer=p)]
        if before is not None and (p := peer(before)) is not None
        else []
    )
    sends = (
        [Op(kinds[1], mb, c, peer=p)]
        if after is not None and (p := peer(after)) is not None
        else []
    )
    return recvs, sends


def schedule_ops(
    pp: int, vpp: int, num_microbatches: int, rank: int, schedule: str | None = None
) -> list[Op]:
    """``compute_order`` with each receive just before, and each send just after, its compute."""
    ops: list[Op] = []
    for op in compute_order(pp, vpp, num_microbatches, rank, schedule):
        recvs, sends = transfers_around(pp, vpp, op, schedule)
        ops += [*recvs, op, *sends]
    return ops


def message_order(
    pp: int, vpp: int, num_microbatches: int, schedule: str | None = None
) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """For every ordered pair (src, dst) of distinct ranks, the messages src sends dst, in order.

    NCCL matches point-to-point calls between two ranks by order, so the receiver must post its
    receives from ``src`` in exactly this order. Pairs that exchange nothing map to ``[]``.
    """
    schedule = check_schedule(pp, vpp, num_microbatches, schedule=schedule)
    order = {(s, d): [] for s in range(pp) for d in range(pp) if s != d}
    for src in range(pp):
        for op in schedule_ops(pp, vpp, num_microbatches, src, schedule):
            if op.kind.startswith("send"):
                order[(src, op.peer)].append(message(op))
    return order
