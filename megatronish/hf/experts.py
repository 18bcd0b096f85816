"""A mixture-of-experts block's router and experts under a Hugging Face model's names, and what
the plain-softmax-router families (Mixtral, Qwen3-MoE) can hold of a router (pure).

Hub checkpoints (and ``save_pretrained``) store one tensor per expert and projection; a
transformers 5 ``state_dict()`` holds the experts fused, ``mlp.experts.gate_up_proj``
``[E, 2f, h]`` and ``mlp.experts.down_proj`` ``[E, h, f]``: exactly megatronish's ``fc1`` and
``fc2``. Exports write the per-expert names; imports take either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatronish.hf.from_hf import _Source
    from megatronish.spec import MoESpec

FUSED_BLOCK = "mlp."  # where transformers 5 modules hold the router and the fused experts


@dataclass(frozen=True)
class ExpertNames:
    """How one model family names a block's router and expert ``j``'s projections."""

    block: str  # after "model.layers.{i}.", e.g. "block_sparse_moe."
    gate: str  # expert j's gate projection, after "experts.{j}."
    up: str
    down: str


def experts_to_hf(t: dict, layer: int, num_experts: int, f: int, names: ExpertNames) -> dict:
    """Block ``layer``'s router and experts (``f`` hidden units each) under checkpoint names."""
    src, dst = f"layers.{layer}.mlp.", f"model.layers.{layer}.{names.block}"
    out = {dst + "gate.weight": t[src + "router"]}
    fc1, fc2 = t[src + "experts.fc1"], t[src + "experts.fc2"]
    for j in range(num_experts):
        gate, up = fc1[j].split([f, f])
        out[f"{dst}experts.{j}.{names.gate}"] = gate
        out[f"{dst}experts.{j}.{names.up}"] = up
        out[f"{dst}experts.{j}.{names.down}"] = fc2[j]
    return out


def experts_from_hf(s: _Source, layer: int, num_experts: int, names: ExpertNames) -> dict:
    """Block ``layer``'s ``router``, ``experts.fc1`` and ``experts.fc2`` from the HF source
    ``s`` (a ``from_hf._Source``), in checkpoint or fused naming."""
    prefix = f"model.layers.{layer}."
    blocks = (names.block, FUSED_BLOCK)
    block = next((prefix + b for b in blocks if s.has(prefix + b + "gate.weight")), None)
    if block is None:
        raise ValueError(f"the HF state dict has no router {prefix}{names.block}gate.weight")
    dst = f"layers.{layer}.mlp."
    out = {dst + "router": s.take(block + "gate.weight")}
    if s.has(block + "experts.gate_up_proj"):
        out[dst + "experts.fc1"] = s.take(block + "experts.gate_up_proj")
        out[dst + "experts.fc2"] = s.take(block + "experts.down_proj")
        return out
    experts = [f"{block}experts.{j}." for j in range(num_experts)]
    out[dst + "experts.fc1"] = torch.stack(
        [torch.cat([s.take(e + names.gate), s.take(e + names.up)]) for e in experts]
    )
    out[dst + "experts.fc2"] = torch.stack([s.take(e + names.down) for e in experts])
    return out


def plain_router_problems(moe: MoESpec, model: str) -> list[str]:
    """What an HF mixture of experts ``model`` (no shared experts, a softmax router without
    expert bias or groups: Mixtral, Qwen3-MoE) cannot hold of ``moe``, a line each."""
    problems = []
    if moe.shared_experts:
        problems.append(
            f"model.moe.shared_experts={moe.shared_experts}: {model} has no always-on experts"
        )
    if moe.score != "softmax":
        problems.append(f"model.moe.router.score={moe.score}: {model}'s router is a softmax")
    if moe.bias_update_rate is not None:
        problems.append(
            f"model.moe.router.bias_update_rate={moe.bias_update_rate}: {model}'s router has "
            "no expert bias"
        )
    if moe.num_groups is not None:
        problems.append(
            f"model.moe.router.num_groups={moe.num_groups}: {model} routes without expert groups"
        )
    return problems


def plain_router(renormalize: bool, aux_loss_coef: float) -> dict:
    """The ``model.moe.router`` group an import of such a model records."""
    return {
        "score": "softmax",
        "renormalize": renormalize,
        "aux_loss_coef": aux_loss_coef,
        "z_loss_coef": 0.0,
        "bias_update_rate": None,  # no expert bias
        "num_groups": None,
        "max_groups": None,
    }
