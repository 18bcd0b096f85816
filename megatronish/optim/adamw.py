"""AdamW with weight decay on weights only (not on norms and biases)."""

from __future__ import annotations

import torch
from torch import nn


def build_adamw(chunks: list[nn.Module], optimizer_cfg) -> torch.optim.AdamW:
    """AdamW over every chunk's params: decay on weights, none on norms and biases."""
    decay, no_decay = [], []
    for chunk in chunks:
        for _, p in chunk.named_parameters():
            (no_decay if getattr(p, "no_weight_decay", False) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": optimizer_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=optimizer_cfg.lr,
        betas=(optimizer_cfg.beta1, optimizer_cfg.beta2),
        eps=optimizer_cfg.eps,
    )
