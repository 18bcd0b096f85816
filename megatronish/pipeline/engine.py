"""Runs a pipeline schedule's steps on this rank's model chunks.

The steps come from :mod:`megatronish.pipeline.grouping` (pure functions of pp, vpp, the
schedule, the number of microbatches and the rank): before each compute, one group of sends and
receives is posted through a :class:`~megatronish.distributed.p2p.P2PCommunicator` (default:
batched isend/irecv on the pipeline group). Groups are waited on as units, in posting order:
by default each before the compute it precedes; with early receives (interleaved 1F1B,
:attr:`~megatronish.pipeline.grouping.Step.ready`) only once a compute needs a group's data,
so receives posted ahead complete while earlier computes run. The executor keeps the input
and output of every forward until its backward, frees the data of an output once its send is
posted (the group keeps the sent buffer until it completes; the backward does not need the
data), and scales each microbatch loss by ``loss_scale`` so a step equals the non-pipelined one.
It can record the wall-clock span of every op for a timeline.

Zero-bubble schedules split each backward: B (``bwd_input``) runs the chunk's backward with its
weight grads deferred into a :class:`~megatronish.tensor_parallel.weight_grad.WeightGradStore`
under (microbatch, chunk), and W (``bwd_weight``) runs them later, after the step's group is
posted and before it is waited for. Two neighbouring chunks on one rank (the turn of the V)
hand the activation and its gradient over in memory. The first chunk's input (token ids) takes
no gradient, so its B feeds no other stage: it runs the chunk's whole backward, with no
weight-grad store (torch's own autograd, :func:`attach_split_backward`), and its W is empty. Both
schedules run that W right after its B, so nothing is moved (as torch pipelining, which runs the
first stage's whole backward in its W).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from megatronish.config.pipeline_rules import resolve_pipeline_schedule
from megatronish.distributed.p2p import BatchedP2P, P2PCommunicator
from megatronish.distributed.timers import Timers
from megatronish.distributed.topology import Topology
from megatronish.model.build import chunk_ids_of_stage, stage_of_chunk
from megatronish.pipeline.grouping import (
    EQUAL_TIMES,
    OpTimes,
    Step,
    forward_only_steps,
    training_steps,
)
from megatronish.pipeline.microbatch import Microbatch, microbatch_parts, run_chunk
from megatronish.pipeline.no_pipeline import NO_PARAM_HOOKS, ParamHooks
from megatronish.pipeline.posting import GroupPoster, Posted
from megatronish.pipeline.schedule import splits_backward, v_shape
from megatronish.tensor_parallel.weight_grad import WeightGradStore, attach_weight_grad_store


@dataclass
class Timeline:
    """Per-op wall-clock spans of this rank: ``(name, start_s, end_s)``."""

    events: list[tuple[str, float, float]] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)

    @contextlib.contextmanager
    def span(self, name: str):
        start = time.perf_counter() - self.origin
        try:
            yield
        finally:
            self.events.append((name, start, time.perf_counter() - self.origin))

    def add(self, name: str, start: float, end: float) -> None:
        """Record an event whose ``time.perf_counter()`` start and end were taken elsewhere."""
        self.events.append((name, start - self.origin, end - self.origin))


def attach_split_backward(chunks: list[nn.Module], store: WeightGradStore | None) -> None:
    """Give the layers of every chunk but the model's first (whose whole backward runs in its B)
    ``store`` for a zero-bubble schedule's split backward; None detaches it everywhere."""
    for chunk in chunks:
        first = getattr(chunk, "first", False)
        attach_weight_grad_store(chunk, None if first else store)


def _free_data(t: torch.Tensor) -> None:
    """Release an output's storage but keep its autograd node (Megatron's trick)."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` even when ``output``'s data was freed (skips the shape check)."""
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


@dataclass
class PipelineShape:
    """What every stage agrees on without a handshake."""

    activation: tuple[int, ...]  # [s (or s/tp with sp), micro batch, hidden]
    dtype: torch.dtype = torch.float32


Key = tuple[int, int]  # (microbatch, global chunk)


def _post(
    poster: GroupPoster,
    step: Step,
    inputs: dict[Key, torch.Tensor],
    outputs: dict[Key, torch.Tensor],
    grads_in: dict[Key, torch.Tensor],
    shape: PipelineShape,
    device: torch.device,
) -> Posted | None:
    """Post ``step``'s group: sent outputs lose their data, receive buffers land in the dicts."""
    tensors, sent_outputs = [], []
    for op in step.group:
        key = (op.microbatch, op.chunk)
        if op.kind == "send_act":
            sent_outputs.append(outputs[key])
            tensors.append(outputs[key].detach())
        elif op.kind == "send_grad":
            tensors.append(inputs.pop(key).grad)
        else:
            buf = torch.empty(shape.activation, dtype=shape.dtype, device=device)
            (inputs if op.kind == "recv_act" else grads_in)[key] = buf
            tensors.append(buf)
    posted = poster.post(step.group, tensors)
    for out in sent_outputs:
        _free_data(out)
    return posted


def forward_backward_pipeline(
    chunks: list[nn.Module],
    microbatches: list[Microbatch],
    *,
    loss_scale: float,
    topo: Topology,
    vpp: int,
    shape: PipelineShape,
    param_hooks: ParamHooks | None = None,
    timeline: Timeline | None = None,
    timers: Timers | None = None,
    comm: P2PCommunicator | None = None,
    schedule: str | None = None,
    weight_grads: WeightGradStore | None = None,
    op_times: OpTimes = EQUAL_TIMES,
) -> list[torch.Tensor]:
    """One step of ``schedule`` (None: 1F1B, or interleaved 1F1B for vpp > 1); returns the
    per-microbatch losses on the rank that holds the last chunk.

    ``timers`` sums forward, backward and the p2p waits (see :mod:`~.posting`). ``comm`` posts
    the p2p groups (default: :class:`~megatronish.distributed.p2p.BatchedP2P` on the pipeline
    group). A zero-bubble schedule needs ``weight_grads``, the store the chunks' layers were
    given (:func:`attach_split_backward`);
    ``op_times`` plans its groups (:func:`~megatronish.pipeline.grouping.training_steps`).
    """
    pp, rank, m = topo.pp, topo.coords.pp, len(microbatches)
    schedule = resolve_pipeline_schedule(schedule, vpp)
    if splits_backward(schedule) and weight_grads is None:
        raise ValueError(f"the {schedule} schedule needs the chunks' WeightGradStore")
    v = v_shape(schedule)
    last_chunk = pp * vpp - 1
    ids = chunk_ids_of_stage(rank, pp, vpp, v)
    local = dict(zip(ids, chunks, strict=True))
    virtual = {c: i for i, c in enumerate(ids)}
    record = timeline.add if timeline is not None else None
    poster = GroupPoster(comm or BatchedP2P(topo.pp_group), record, timers)
    inputs: dict[Key, torch.Tensor] = {}
    outputs: dict[Key, torch.Tensor] = {}
    grads_in: dict[Key, torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    span = timeline.span if timeline is not None else (lambda _: contextlib.nullcontext())
    hooks = param_hooks or NO_PARAM_HOOKS
    region = (timers or Timers.off()).region
    here = lambda chunk: 0 <= chunk <= last_chunk and stage_of_chunk(chunk, pp, v) == rank

    def forward(mb: int, c: int) -> None:
        tokens, targets, documents = microbatch_parts(microbatches[mb])
        if c == 0:
            x = tokens
        elif here(c - 1):  # the turn of the V: the previous chunk's output, in memory
            x = inputs[(mb, c)] = outputs[(mb, c - 1)].detach().requires_grad_(True)
        else:
            x = inputs[(mb, c)].requires_grad_(True)
        with region("forward", "forward mb{} chunk{}", mb, c):
            out = run_chunk(local[c], x, targets if c == last_chunk else None, documents)
        hooks.after_compute(virtual[c], "fwd")
        if c == last_chunk:
            losses.append(out.detach())
            out = out * loss_scale
        outputs[(mb, c)] = out

    def backward(mb: int, c: int, deferred: bool) -> None:
        out = outputs.pop((mb, c))
        store = weight_grads.deferring((mb, c)) if deferred else contextlib.nullcontext()
        with region("backward", "backward mb{} chunk{}", mb, c), store:
            if c == last_chunk:
                out.backward()
            else:
                _backward_from(out, grads_in.pop((mb, c)))
        if c > 0 and here(c - 1):  # hand the input's gradient to the previous chunk
            grads_in[(mb, c - 1)] = inputs.pop((mb, c)).grad
        hooks.after_compute(virtual[c], "bwd")

    def weight(mb: int, c: int) -> None:
        with span(f"bwd_weight mb{mb} c{c}"):
            if c > 0:  # the first chunk's B ran its whole backward
                with region("backward", "weight grads mb{} chunk{}", mb, c):
                    weight_grads.run((mb, c))
            hooks.after_compute(virtual[c], "bwd")

    in_flight: deque[Posted] = deque()  # posted groups not yet waited for, oldest first
    completed = 0  # groups waited for
    for step in training_steps(pp, vpp, m, rank, schedule, op_times):
        posted = _post(poster, step, inputs, outputs, grads_in, shape, topo.device)
        if posted is not None:
            in_flight.append(posted)
        for op in step.weights:  # W needs nothing in flight: it fills the transfer's time
            weight(op.microbatch, op.chunk)
        op = step.compute
        if op is not None:  # its first params gather while the p2p group completes
            hooks.prefetch(virtual[op.chunk], "fwd" if op.kind == "fwd" else "bwd")
        need = completed + len(in_flight) if step.ready is None else step.ready
        quiet = not step.weights  # nothing ran since this step's group was posted
        while completed < need:  # in posting order, as NCCL completes a rank's groups
            group = in_flight.popleft()
            poster.wait(group, since=None if group is posted and quiet else time.perf_counter())
            completed, quiet = completed + 1, False
        if op is None:
            continue
        with span(f"{op.kind} mb{op.microbatch} c{op.chunk}"):
            if op.kind == "fwd":
                forward(op.microbatch, op.chunk)
            else:
                deferred = op.kind == "bwd_input" and op.chunk > 0
                backward(op.microbatch, op.chunk, deferred=deferred)
    while in_flight:  # sends no later compute waited for
        poster.wait(in_flight.popleft(), since=time.perf_counter())
    return losses


@torch.no_grad()
def forward_only_pipeline(
    chunks: list[nn.Module],
    microbatches: list[Microbatch],
    *,
    topo: Topology,
    vpp: int,
    shape: PipelineShape,
    param_hooks: ParamHooks | None = None,
    comm: P2PCommunicator | None = None,
    schedule: str | None = None,
) -> list[torch.Tensor]:
    """Evaluation: the schedule's forwards in order, no backward; losses where the last chunk
    is."""
    pp, rank = topo.pp, topo.coords.pp
    schedule = resolve_pipeline_schedule(schedule, vpp)
    v = v_shape(schedule)
    last_chunk = pp * vpp - 1
    ids = chunk_ids_of_stage(rank, pp, vpp, v)
    local = dict(zip(ids, chunks, strict=True))
    virtual = {c: i for i, c in enumerate(ids)}
    poster = GroupPoster(comm or BatchedP2P(topo.pp_group))
    hooks = param_hooks or NO_PARAM_HOOKS
    inputs: dict[Key, torch.Tensor] = {}
    outputs: dict[Key, torch.Tensor] = {}
    losses = []
    for step in forward_only_steps(pp, vpp, len(microbatches), rank, schedule):
        posted = _post(poster, step, inputs, outputs, {}, shape, topo.device)
        if step.compute is not None:
            hooks.prefetch(virtual[step.compute.chunk], "fwd")
        poster.wait(posted)
        for op in step.group:
            if op.kind == "send_act":
                del outputs[(op.microbatch, op.chunk)]
        op = step.compute
        if op is None:
            continue
        tokens, targets, documents = microbatch_parts(microbatches[op.microbatch])
        if op.chunk == 0:
            x = tokens
        elif stage_of_chunk(op.chunk - 1, pp, v) == rank:  # the turn of the V
            x = outputs.pop((op.microbatch, op.chunk - 1))
        else:
            x = inputs.pop((op.microbatch, op.chunk))
        out = run_chunk(local[op.chunk], x, targets if op.chunk == last_chunk else None, documents)
        hooks.after_compute(virtual[op.chunk], "fwd")
        if op.chunk == last_chunk:
            losses.append(out.detach())
        else:
            outputs[(op.microbatch, op.chunk)] = out
    return losses
