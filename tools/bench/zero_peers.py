"""torch-native data-parallel peers of megatronish's ZeRO: DDP and FSDP2 on the reference GPT.

Both wrap the plain reference GPT (``reference_gpt.py``, fused q|k|v and gate|up) loaded with
megatronish's initial weights, read this rank's slice of every global batch exactly as
megatronish's Trainer does (dp rank ``r`` takes samples ``[r * B/dp, (r + 1) * B/dp)`` of the
batch), and step with the same AdamW groups, grad clipping and constant learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from mish import bench_config, full_weights
from torch import nn

from megatronish.model.spec import ModelSpec
from megatronish.testing.reference_gpt import (
    RefConfig,
    ReferenceGPT,
    build_adamw,
    load_megatronish_weights,
)
from megatronish.testing.synthetic import PatternTokens


@dataclass
class DataParallelRun:
    """``step()``: this rank's batch -> forward -> backward -> clip -> AdamW; returns the loss.

    The returned loss is the mean over the global batch (one scalar all-reduce, as megatronish's
    Trainer does for the loss it reports). ``micro_batch`` splits the rank's batch into
    microbatches whose grads accumulate (for the plain model only: DDP would sync every one).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: object
    global_batch: int
    rank: int
    world: int
    grad_clip: float = 1.0
    micro_batch: int | None = None
    step_index: int = field(default=0)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // self.world
        first = self.step_index * self.global_batch + self.rank * per_rank
        rows = torch.stack([self.data[i] for i in range(first, first + per_rank)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def step(self) -> float:
        inputs, targets = self.batch()
        self.optimizer.zero_grad(set_to_none=True)
        size = self.micro_batch or len(inputs)
        losses = []
        for mb_in, mb_target in zip(inputs.split(size), targets.split(size), strict=True):
            mb_loss = self.model(mb_in, mb_target)
            (mb_loss * (size / len(inputs))).backward()
            losses.append(mb_loss.detach())
        loss = torch.stack(losses).mean()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.step_index += 1
        mean = loss.detach().clone()
        if self.world > 1:
            dist.all_reduce(mean)
        return mean.item() / self.world


def peer_setup(extra: list[str] | None = None):
    """``(cfg, spec, data)`` of the benchmark config with ``extra``, without building a model."""
    cfg = bench_config(extra)
    spec = ModelSpec.from_config(cfg.model, cfg.model.vocab_size)
    return cfg, spec, PatternTokens(spec.vocab_size, spec.seq_length, seed=cfg.trainer.seed)


def reference_model(spec, extra: list[str] | None = None) -> ReferenceGPT:
    """The reference GPT of ``spec``'s shape with megatronish's initial global weights.

    ``extra``: the Hydra overrides the megatronish run was built with (its model shape).
    """
    model = ReferenceGPT(RefConfig.from_spec(spec, fused=True))
    load_megatronish_weights(model, full_weights(extra))
    return model


def _run(model: nn.Module, cfg, data, rank: int, world: int, micro=None) -> DataParallelRun:
    o = cfg.optimizer
    opt = build_adamw(model, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
    return DataParallelRun(
        model, opt, data, cfg.trainer.global_batch_size, rank, world, o.grad_clip, micro
    )


def plain_run(cfg, spec, data, extra=None) -> DataParallelRun:
    """The reference GPT alone (a world of one), accumulating microbatches like the Trainer."""
    return _run(reference_model(spec, extra), cfg, data, 0, 1, cfg.trainer.micro_batch_size)


def ddp_run(cfg, spec, data, rank: int, world: int, extra=None) -> DataParallelRun:
    """``DistributedDataParallel`` (gloo, default buckets) around the reference GPT."""
    model = nn.parallel.DistributedDataParallel(reference_model(spec, extra))
    return _run(model, cfg, data, rank, world)


def fsdp2_run(cfg, spec, data, rank: int, world: int, extra=None) -> DataParallelRun:
    """FSDP2 ``fully_shard`` on every block, then the root, over a 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = reference_model(spec, extra)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _run(model, cfg, data, rank, world)
