"""PyTorch's own tensor (and sequence) parallelism applied to the reference GPT with DTensor.

The plan is the usual torchtitan one for a llama: column-parallel ``wq wk wv w1 w3`` (or the
fused ``wqkv`` and ``w13``, their rows grouped per rank),
row-parallel ``wo w2``, a row-parallel (vocabulary-split) embedding, a column-parallel output
head whose logits stay split over the vocabulary for ``loss_parallel``; with sequence
parallelism the norms run on sequence shards (``Shard(1)`` of ``[b, s, h]``) and the residual
stream stays a DTensor. Attention modules get their local head counts (``n_heads // tp``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from megatronish.testing.reference_gpt import ReferenceGPT


def cpu_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole (gloo) world."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def parallelize(model: ReferenceGPT, mesh: DeviceMesh, sp: bool) -> ReferenceGPT:
    """Shard ``model`` in place over ``mesh``; returns it. A fused model (one ``wqkv`` and one
    ``w13``) must group its rows per rank (``RefConfig(tp_groups=tp)``)."""
    tp = mesh.size()
    if model.cfg.fused and model.cfg.tp_groups != tp:
        raise ValueError(f"fused q|k|v needs RefConfig(tp_groups={tp}) to split over tp={tp}")
    seq = Shard(1) if sp else Replicate()
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            **({"norm": SequenceParallel()} if sp else {}),
            "output": ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for block in model.layers:
        column = (
            ("attention.wqkv", "feed_forward.w13")
            if model.cfg.fused
            else (
                "attention.wq",
                "attention.wk",
                "attention.wv",
                "feed_forward.w1",
                "feed_forward.w3",
            )
        )
        plan = {
            **{name: ColwiseParallel() for name in column},
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            })  # fmt: skip
        parallelize_module(block, mesh, plan)
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
    return model


def grad_norm_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for a mix of DTensor and plain parameters (the global norm).

    Sharded DTensor grads are summed over the mesh; replicated ones (and plain tensors, which
    are identical on every rank) count once.
    """
    sharded = torch.zeros(())
    local = torch.zeros(())
    group = None
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            sq = g.to_local().float().pow(2).sum()
            if any(pl.is_shard() for pl in g.placements):
                sharded += sq
                group = g.device_mesh.get_group()
            else:
                local += sq
        else:
            local += g.float().pow(2).sum()
    if group is not None:
        dist.all_reduce(sharded, group=group)
    norm = (sharded + local).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        g = p.grad
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm


def loss_context():
    """The context that lets ``F.cross_entropy`` run on vocabulary-split DTensor logits."""
    return loss_parallel()
