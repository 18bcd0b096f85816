"""Layout-independent initialisation: the same seed gives the same global weights for every tp/pp.

Each parameter's full (global) tensor is drawn from a generator seeded by the run seed and the
parameter's global name; the rank keeps its tensor-parallel slice. A tied head on the last
pipeline stage is drawn from its embedding's name, so both copies start equal.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from megatronish.tensor_parallel.sharding import global_shape, param_info


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for parameter ``name``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    """Fill every parameter of ``module`` (named by global names) in place."""
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        kind = param_info(p).init
        if kind == "ones":
            p.fill_(1.0)
        elif kind == "zeros":
            p.zero_()
        else:
            key = param_info(p).tied_to or name
            gen = torch.Generator(device=p.device).manual_seed(param_seed(seed, key))
            full = torch.empty(global_shape(p, tp_size), device=p.device, dtype=torch.float32)
            full.normal_(0.0, param_info(p).std, generator=gen)
            experts = param_info(p).experts
            if experts is not None:  # this rank's experts of the global stack
                full = experts.take(full, p.shape[0])
            shard = param_info(p).shard
            p.copy_(full if shard is None else shard.take(full, tp_rank, tp_size))
