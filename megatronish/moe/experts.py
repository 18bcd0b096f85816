"""The experts of one mixture-of-experts block that this rank holds, as stacked weights.

``fc1`` ``[local experts, (2)f/tp, h]`` and ``fc2`` ``[local experts, h, f/tp]`` are one parameter
each (stacks indexed by expert, split over tp like the dense MLP: gate|up by columns, down by
rows), so checkpoints store them by global expert index and Mixtral's ``gate_up_proj`` /
``down_proj`` are the same tensors. Experts have no biases (as in Megatron-LM's grouped MLP).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.moe.fp8_grouped import fp8_experts_supported, fp8_grouped_linear
from megatronish.moe.grouped_mm import (
    device_capability,
    expert_offsets,
    grouped_linear,
    grouped_mm_supported,
)
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.sharding import ExpertShard, TPShard, mark_param
from megatronish.tensor_parallel.weight_grad import WeightGradStore


class GroupedExperts(nn.Module):
    """Experts ``[first, first + num_local)`` of the block, each a SwiGLU (llama) or GELU (gpt2)
    MLP; the output is partial over tp (summed by the caller). ``grouped``: use (True) or never
    use (False) ``torch._grouped_mm``; None: where this torch has it for the device and shapes."""

    def __init__(
        self,
        spec: ModelSpec,
        tp_size: int,
        num_local: int,
        first: int,
        device: torch.device | str | None = None,
        grouped: bool | None = None,
    ):
        super().__init__()
        self.grouped = grouped
        moe, h = spec.moe, spec.hidden_size
        f = moe.ffn_hidden_size
        self.llama, self.num_local = spec.is_llama, num_local
        blocks = (f, f) if self.llama else (f,)
        experts = ExpertShard(moe.num_experts, first)
        fc1 = TPShard(dim=1, blocks=blocks)
        self.fc1 = mark_param(
            nn.Parameter(torch.empty(num_local, fc1.local_size(tp_size), h, device=device)),
            shard=fc1,
            std=spec.init_std,
            experts=experts,
        )
        self.fc2 = mark_param(
            nn.Parameter(torch.empty(num_local, h, f // tp_size, device=device)),
            shard=TPShard(dim=2, blocks=(f,)),
            experts=experts,
            std=spec.init_std / math.sqrt(2 * spec.num_layers),
        )
        self.weight_grad_store: WeightGradStore | None = None
        self.fp8: str | None = None  # trainer.fp8's recipe where these experts run in fp8

    def forward(
        self, rows: torch.Tensor, counts: list[int], offsets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rows`` grouped by local expert (``counts`` rows each, host ints): two grouped
        matmuls (see :func:`~megatronish.moe.grouped_mm.grouped_linear`), the activation once
        over all rows. ``offsets``: the groups' int32 end rows already on ``rows``' device."""
        store = self.weight_grad_store
        fp8 = self.fp8 is not None and self.fp8_here(rows.device)
        if fp8 and rows.shape[0]:
            if offsets is None:
                offsets = expert_offsets(counts, rows.device)
            return self._mlp(rows, lambda x, w: fp8_grouped_linear(x, w, counts, offsets, store))
        grouped = self.grouped
        if grouped is None:
            grouped = all(grouped_mm_supported(rows, w, counts) for w in (self.fc1, self.fc2))
        if grouped and offsets is None:
            offsets = expert_offsets(counts, rows.device)  # once for both matmuls
        return self._mlp(rows, lambda x, w: grouped_linear(x, w, counts, offsets, grouped, store))

    def _mlp(
        self, rows: torch.Tensor, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        y = linear(rows, self.fc1)
        if self.llama:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return linear(y, self.fc2)

    @staticmethod
    def fp8_here(device: torch.device) -> bool:
        """Whether ``trainer.fp8`` experts on ``device`` run their GEMMs in fp8 (else bf16)."""
        return fp8_experts_supported(device, device_capability(device))
