"""Global (unsplit) tensors from tensor-parallel shards."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.distributed.comm import all_gather_dim0
from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.sharding import param_info


@torch.no_grad()
def gather_tp_params(chunks: list[nn.Module], topo: Topology) -> dict[str, torch.Tensor]:
    """This pipeline rank's params as global tensors (collective over tp, and over ep for
    experts), keyed by global name.

    Tied head copies are skipped (the embedding holds the value).
    """
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if param_info(p).tied_to:
                continue
            shard = param_info(p).shard
            full = p.detach().clone()
            if shard is not None and topo.tp > 1:
                stacked = all_gather_dim0(full.unsqueeze(0).contiguous(), topo.tp_group)
                full = shard.join(list(stacked.unbind(0)))
            if param_info(p).experts is not None:  # ep ranks hold consecutive experts
                full = all_gather_dim0(full.contiguous(), topo.ep_group)
            out[name] = full.cpu()
    return out
