"""Aux-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): after every training step each
mixture-of-experts block moves its expert bias by ``bias_update_rate`` towards the mean load,
up for an expert that took fewer assignments than the mean over the experts, down for one that
took more (Megatron-LM's ``get_updated_expert_bias``).

The loads are the step's assignments per expert before any capacity drop, over every token of
the global batch: each rank's own counts (``MoELayer.stats``, its own tokens: sequence shards
under tp, chunks under cp, its batch under dp) summed over the world in one all-reduce of a
``[layers, experts]`` table. Every rank holding a block applies the same sign to the same fp32
bias, so the biases stay identical everywhere; nothing is read on the host.
"""

from __future__ import annotations

import torch

from megatronish.distributed.comm import ParallelGroup, all_reduce
from megatronish.moe.layer import MoELayer


@torch.no_grad()
def global_loads(
    layers: list[MoELayer],
    num_layers: int,
    num_experts: int,
    world: ParallelGroup,
    device: torch.device,
) -> torch.Tensor:
    """``[num_layers, num_experts]`` assignments per expert of every block in the step so far,
    summed over ``world`` (collective; rows of dense blocks are zero)."""
    rows = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
    for layer in layers:
        rows[layer.layer_id] = layer.stats[:num_experts]
    return all_reduce(rows, world)


@torch.no_grad()
def update_expert_bias(layers: list[MoELayer], loads: torch.Tensor, rate: float) -> None:
    """Move each block's expert bias by ``rate`` towards balance: ``+rate`` where its
    ``loads`` row (:func:`global_loads`) is below the row's mean, ``-rate`` above, 0 at it."""
    for layer in layers:
        load = loads[layer.layer_id]
        offset = torch.sign(load.mean() - load).to(torch.float32)
        layer.expert_bias.add_(offset, alpha=rate)
