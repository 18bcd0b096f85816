"""What the trainer does with the mixture-of-experts blocks of its chunks (found once, by
:func:`moe_layers`): the auxiliary losses' gradient scale, the expert biases' update after the
backward, and the routing statistics of a step (tokens per expert, losses, drops)."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.distributed.comm import ParallelGroup, all_reduce
from megatronish.moe.balancing import global_loads, update_expert_bias
from megatronish.moe.layer import AUX, DROPPED, MoELayer, Z
from megatronish.spec import ModelSpec


def moe_layers(chunks: list[nn.Module]) -> list[MoELayer]:
    """Every mixture-of-experts block of ``chunks``."""
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def start_step(layers: list[MoELayer], loss_scale: float) -> None:
    """Before a step: the auxiliary losses of ``layers`` (:func:`moe_layers`) get the
    language-model loss's scale per microbatch; the statistics start from zero."""
    for layer in layers:
        layer.loss_scale = loss_scale
        layer.stats.zero_()


def after_backward(
    layers: list[MoELayer], spec: ModelSpec, world: ParallelGroup, device: torch.device
) -> None:
    """After a step's forward and backward, before the next forward: aux-loss-free balancing
    moves the expert biases (:mod:`~megatronish.moe.balancing`; collective over ``world`` when
    ``model.moe.router.bias_update_rate`` > 0, nothing otherwise)."""
    rate = spec.moe.bias_update_rate if spec.moe is not None else None
    if rate:
        loads = global_loads(layers, spec.num_layers, spec.moe.num_experts, world, device)
        update_expert_bias(layers, loads, rate)


def step_metrics(
    layers: list[MoELayer],
    num_layers: int,
    num_experts: int,
    world: ParallelGroup,
    dp_replicas: int,
    num_microbatches: int,
    device: torch.device,
) -> dict[str, float]:
    """The last step's routing metrics over every rank (collective over ``world``); ``layers``:
    this rank's blocks (:func:`moe_layers`), none on a rank without any.

    Keys are ``moe/...``:

    - ``aux_loss`` / ``z_loss``: summed over the blocks, mean over the microbatches of the step
      (the amounts added to the language-model loss in the gradient);
    - ``tokens_per_expert_max`` / ``_mean``: assignments one expert of one block took in the
      step (max over blocks and experts, and their mean);
    - ``dropped_tokens``: assignments over capacity, all blocks, the whole step.
    """
    rows = torch.zeros(num_layers, num_experts + 3, dtype=torch.float64, device=device)
    for layer in layers:
        rows[layer.layer_id] = layer.stats
    all_reduce(rows, world)
    host = rows.tolist()  # one device read, on log steps only
    counts = [row[:num_experts] for row in host if sum(row[:num_experts]) > 0]
    per_batch = dp_replicas * num_microbatches
    every = [c for row in counts for c in row]
    return {
        "moe/aux_loss": sum(row[AUX] for row in host) / per_batch,
        "moe/z_loss": sum(row[Z] for row in host) / per_batch,
        "moe/tokens_per_expert_max": max(every, default=0.0),
        "moe/tokens_per_expert_mean": sum(every) / len(every) if every else 0.0,
        "moe/dropped_tokens": sum(row[DROPPED] for row in host),
    }
