"""Layout-independent initialisation: the same seed gives the same global weights for every tp/pp.

Each parameter's full (global) tensor is drawn from a generator seeded by the run seed and the
parameter's global name; the rank keeps its tensor-parallel slice. A tied head on the last
pipeline stage is drawn from its embedding's name, so both copies start equal.

A chunk built with its parameters on the meta device (ZeRO 3,
:func:`~megatronish.model.build.build_chunks` with ``deferred=True``) carries a
:class:`DeferredInit`; ZeRO then draws each parameter on its own, when it fills the rank's shard
of the parameter's bucket, with the same values.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from megatronish.tensor_parallel.sharding import global_shape, param_info


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for parameter ``name``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def initial_value(
    name: str, p: nn.Parameter, seed: int, tp_rank: int, tp_size: int, device: torch.device
) -> torch.Tensor:
    """This rank's part (tp slice, experts) of parameter ``name``'s initial global tensor, fp32
    on ``device``: a view of the global tensor of this one parameter where the slice is a
    contiguous part of it, else a copy made while the global tensor is alive (fused blocks), or
    a strided view that a flat reader copies (a column slice)."""
    info = param_info(p)
    if info.init == "ones":
        return torch.ones(p.shape, device=device)
    if info.init == "zeros":
        return torch.zeros(p.shape, device=device)
    gen = torch.Generator(device=device).manual_seed(param_seed(seed, info.tied_to or name))
    full = torch.empty(global_shape(p, tp_size), device=device, dtype=torch.float32)
    full.normal_(0.0, info.std, generator=gen)
    if info.experts is not None:  # this rank's experts of the global stack
        full = info.experts.take(full, p.shape[0])
    return full if info.shard is None else info.shard.take(full, tp_rank, tp_size)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    """Fill every parameter of ``module`` (named by global names) in place; meta ones are left
    for a :class:`DeferredInit`."""
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        kind = param_info(p).init
        if kind == "ones":
            p.fill_(1.0)
        elif kind == "zeros":
            p.zero_()
        else:
            p.copy_(initial_value(name, p, seed, tp_rank, tp_size, p.device))


@dataclass(frozen=True)
class DeferredInit:
    """How the meta parameters of a chunk get the values :func:`init_parameters` would give
    them on ``device``: ``value(name, p)`` draws one parameter."""

    seed: int
    tp_rank: int
    tp_size: int
    device: torch.device

    def value(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """This rank's initial values of parameter ``name`` (fp32, shaped like ``p``)."""
        return initial_value(name, p, self.seed, self.tp_rank, self.tp_size, self.device)
