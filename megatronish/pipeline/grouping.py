"""Which pipeline sends and receives are posted together, as Megatron-LM batches them.

On NCCL the point-to-point calls between two ranks run in order, and a send completes only when
the peer's matching receive runs. Posting every send and receive on its own therefore hangs once
messages outgrow NCCL's buffers: with pp=2 and 4 microbatches rank 0 posts [send act0, send
act1, recv grad0] and rank 1 [recv act0, send grad0, recv act1], so both end up with a send at
the head. Each rank therefore posts groups (one ``batch_isend_irecv``) and waits for a group as a
unit before its next compute:

* A rank's computes are cut into segments: every warm-up forward and every cool-down backward
  alone; in the steady state every forward and every backward alone for plain 1F1B (a backward
  needs the gradient of the forward just before it), every forward+backward pair for
  interleaved 1F1B.
* Between two segments there is one group: the sends of the segment before and the receives of
  the segment after. Plain 1F1B thus posts Megatron's ``send_forward_recv_backward`` and
  ``send_backward_recv_forward`` (``send_forward_recv_forward`` in warm-up); interleaved 1F1B
  posts ``send_forward_backward_recv_forward_backward`` after each steady pair, so the forward's
  output leaves after the pair's backward. Forward-only (evaluation) runs every forward alone.

Grouping each compute's sends with only the next compute's receives hangs interleaved 1F1B:
with pp=2, vpp=2, m=4 rank 0 sends grad (0, 2) in a group of its own, which rank 1 receives
only after its group sending grad (1, 3), which rank 0 receives only after that send.
``tests/pipeline/test_pipeline_nccl_sim.py`` replays what the engine posts in
:mod:`megatronish.pipeline.nccl_sim` for many layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.pipeline.schedule import Op, compute_order, num_warmup


@dataclass(frozen=True)
class Step:
    """One p2p group (sends and receives, possibly none), then one compute op (or None)."""

    group: tuple[Op, ...]
    compute: Op | None


def transfers_around(pp: int, vpp: int, op: Op) -> tuple[list[Op], list[Op]]:
    """The receives a compute ``op`` needs before it and the sends it makes after it."""
    last, mb, c = pp * vpp - 1, op.microbatch, op.chunk
    if op.kind == "fwd":
        recvs = [Op("recv_act", mb, c, peer=(c - 1) % pp)] if c > 0 else []
        sends = [Op("send_act", mb, c, peer=(c + 1) % pp)] if c < last else []
    else:
        recvs = [Op("recv_grad", mb, c, peer=(c + 1) % pp)] if c < last else []
        sends = [Op("send_grad", mb, c, peer=(c - 1) % pp)] if c > 0 else []
    return recvs, sends


def _steps(pp: int, vpp: int, segments: list[list[Op]]) -> list[Step]:
    steps: list[Step] = []
    sends: list[Op] = []
    for segment in segments:
        around = [transfers_around(pp, vpp, op) for op in segment]
        group = tuple(sends + [r for recvs, _ in around for r in recvs])
        steps.append(Step(group, segment[0]))
        steps += [Step((), op) for op in segment[1:]]
        sends = [s for _, op_sends in around for s in op_sends]
    if sends:
        steps.append(Step(tuple(sends), None))
    return steps


def training_steps(pp: int, vpp: int, num_microbatches: int, rank: int) -> list[Step]:
    """One training step of (interleaved) 1F1B on ``rank``: its groups and computes in order."""
    order = compute_order(pp, vpp, num_microbatches, rank)
    warmup = num_warmup(pp, vpp, num_microbatches, rank)
    cooldown_from = len(order) - warmup
    if vpp == 1:
        segments = [[op] for op in order]
    else:
        segments = [[op] for op in order[:warmup]]
        segments += [order[i : i + 2] for i in range(warmup, cooldown_from, 2)]
        segments += [[op] for op in order[cooldown_from:]]
    return _steps(pp, vpp, segments)


def forward_only_steps(pp: int, vpp: int, num_microbatches: int, rank: int) -> list[Step]:
    """Evaluation on ``rank``: the schedule's forwards in their order, each its own segment."""
    order = compute_order(pp, vpp, num_microbatches, rank)
    return _steps(pp, vpp, [[op] for op in order if op.kind == "fwd"])


def run_order(steps: list[Step]) -> list[Op]:
    """Every op of ``steps`` in the order the executor runs them (its timeline's order)."""
    return [op for s in steps for op in (*s.group, *((s.compute,) if s.compute else ()))]
