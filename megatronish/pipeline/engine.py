"""Runs a pipeline schedule's op list on this rank's model chunks.

The op list comes from :mod:`megatronish.pipeline.schedule` (a pure function of pp, vpp, the
number of microbatches and the rank). The executor keeps the input and output of every forward
until its backward, frees the data of an output once it has been sent (its backward does not
need it), and scales each microbatch loss by ``loss_scale`` so a step equals the non-pipelined
one. It can record the wall-clock span of every op for a timeline.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from megatronish.distributed.comm import irecv
from megatronish.distributed.topology import Topology
from megatronish.pipeline.no_pipeline import NO_PARAM_HOOKS
from megatronish.pipeline.p2p import Inbox, Outbox
from megatronish.pipeline.schedule import message_order, schedule_ops
from megatronish.timers import Timers


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


def _free_data(t: torch.Tensor) -> None:
    """Release an output's storage but keep its autograd node (Megatron's trick)."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` even when ``output``'s data was freed (skips the shape check)."""
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )  # fmt: skip


@dataclass
class PipelineShape:
    """What every stage agrees on without a handshake."""

    activation: tuple[int, ...]  # [s (or s/tp with sp), micro batch, hidden]
    dtype: torch.dtype = torch.float32


def forward_backward_pipeline(
    chunks: list[nn.Module],
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_scale: float,
    topo: Topology,
    vpp: int,
    shape: PipelineShape,
    autocast=contextlib.nullcontext,
    param_hooks=None,
    timeline: Timeline | None = None,
    timers: Timers | None = None,
) -> list[torch.Tensor]:
    """One step of (interleaved) 1F1B; returns the per-microbatch losses on the last stage.

    ``timers`` sums forward, backward and the waits of receives and sends over the ops.
    """
    pp, rank, m = topo.pp, topo.coords.pp, len(microbatches)
    last_chunk = pp * vpp - 1
    local = {rank + v * pp: chunk for v, chunk in enumerate(chunks)}
    inbox = Inbox(topo.pp_group, message_order(pp, vpp, m), shape.activation, shape.dtype,
                  topo.device)  # fmt: skip
    outbox = Outbox(topo.pp_group)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    grads_in: dict[tuple[int, int], torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    span = timeline.span if timeline is not None else (lambda _: contextlib.nullcontext())
    hooks = param_hooks or NO_PARAM_HOOKS
    region = (timers or Timers.off()).region

    for op in schedule_ops(pp, vpp, m, rank):
        key = (op.microbatch, op.chunk)
        name = f"{op.kind} mb{op.microbatch} c{op.chunk}"
        with span(name):
            if op.kind == "recv_act":
                with region("pp_recv_wait", "recv act mb{} chunk{}", op.microbatch, op.chunk):
                    x = inbox.get(op.peer, ("act", op.microbatch, op.chunk - 1))
                inputs[key] = x.requires_grad_(True)
            elif op.kind == "fwd":
                tokens, targets = microbatches[op.microbatch]
                x = tokens if op.chunk == 0 else inputs[key]
                hooks.gather(op.chunk // pp)
                with region("forward", "forward mb{} chunk{}", op.microbatch, op.chunk), autocast():
                    out = local[op.chunk](x, targets if op.chunk == last_chunk else None)
                hooks.release(op.chunk // pp)
                if op.chunk == last_chunk:
                    losses.append(out.detach())
                    out = out * loss_scale
                outputs[key] = out
            elif op.kind == "send_act":
                out = outputs[key]
                with region("pp_send_wait", "send act mb{} chunk{}", op.microbatch, op.chunk):
                    outbox.send(out.detach(), op.peer)
                _free_data(out)
            elif op.kind == "recv_grad":
                with region("pp_recv_wait", "recv grad mb{} chunk{}", op.microbatch, op.chunk):
                    grads_in[key] = inbox.get(op.peer, ("grad", op.microbatch, op.chunk + 1))
            elif op.kind == "bwd":
                out = outputs.pop(key)
                hooks.gather(op.chunk // pp)
                with region("backward", "backward mb{} chunk{}", op.microbatch, op.chunk):
                    if op.chunk == last_chunk:
                        out.backward()
                    else:
                        _backward_from(out, grads_in.pop(key))
                hooks.release(op.chunk // pp)
            elif op.kind == "send_grad":
                with region("pp_send_wait", "send grad mb{} chunk{}", op.microbatch, op.chunk):
                    outbox.send(inputs.pop(key).grad, op.peer)
            else:  # pragma: no cover - the schedule only emits the kinds above
                raise ValueError(f"unknown pipeline op {op}")
    with region("pp_send_wait", "send wait"):
        outbox.wait_all()
    return losses


@torch.no_grad()
def forward_only_pipeline(
    chunks: list[nn.Module],
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    topo: Topology,
    vpp: int,
    shape: PipelineShape,
    autocast=contextlib.nullcontext,
    param_hooks=None,
) -> list[torch.Tensor]:
    """Evaluation: every microbatch flows through the chunks in order; losses on the last stage."""
    pp, rank = topo.pp, topo.coords.pp
    last_chunk = pp * vpp - 1
    local = {rank + v * pp: chunk for v, chunk in enumerate(chunks)}
    outbox = Outbox(topo.pp_group)
    losses = []
    for tokens, targets in microbatches:
        for c in range(last_chunk + 1):
            if c not in local:
                continue
            if c == 0:
                x = tokens
            else:
                x = torch.empty(shape.activation, dtype=shape.dtype, device=topo.device)
                irecv(x, topo.pp_group, (c - 1) % pp).wait()
            (param_hooks or NO_PARAM_HOOKS).gather(c // pp)
            with autocast():
                out = local[c](x, targets if c == last_chunk else None)
            (param_hooks or NO_PARAM_HOOKS).release(c // pp)
            if c == last_chunk:
                losses.append(out.detach())
            else:
                outbox.send(out, (c + 1) % pp)
    outbox.wait_all()
    return losses
