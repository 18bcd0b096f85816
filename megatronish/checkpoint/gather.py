"""Global (unsplit) tensors from tensor-parallel shards."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.distributed.comm import all_gather_dim0
from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.sharding import param_info


@torch.no_grad()
def gather_tp_params(chunks: list[nn.Module], topo: Topology) -> dict[str, torch.Tensor]:
    """This pipeline rank's params as global tensors (collective over tp), keyed by global name.

    Tied head copies are skipped (the embedding holds the value).
    """
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if param_info(p).tied_to:
                continue
            shard = param_info(p).shard
            if shard is None or topo.tp == 1:
                out[name] = p.detach().clone().cpu()
                continue
            stacked = all_gather_dim0(p.detach().unsqueeze(0).contiguous(), topo.tp_group)
            out[name] = shard.join(list(stacked.unbind(0))).cpu()
    return out
