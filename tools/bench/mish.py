"""Build megatronish's own Trainer for a benchmark: the real config, synthetic data, no files."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatronish.config.compose import load_config
from megatronish.config.derived import derive
from megatronish.config.validate import check_config
from megatronish.distributed.topology import Topology
from megatronish.job import build_model
from megatronish.model.spec import ModelSpec
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.testing.synthetic import PatternTokens
from megatronish.trainer import Trainer

# The CPU default model (configs/experiment/tiny.yaml -> configs/model/tiny.yaml) with the
# stdlib tokenizer's vocabulary, one microbatch of 8 per step, a constant learning rate (so the
# plain-PyTorch peers can follow the same run) and nothing but training in the step.
BENCH_OVERRIDES = [
    "+experiment=tiny",
    "model.vocab_size=4096",
    "trainer.micro_batch_size=8",
    "trainer.global_batch_size=8",
    "trainer.max_steps=1000000",
    "trainer.eval_interval=0",
    "trainer.device=cpu",
    "scheduler.style=constant",
    "scheduler.warmup_steps=0",
    "logging.wandb=false",
    "logging.log_interval=1000000",
]


@dataclass
class MishRun:
    """A ready-to-step megatronish trainer and what built it."""

    cfg: object
    topo: Topology
    spec: ModelSpec
    chunks: list[nn.Module]
    trainer: Trainer
    data: PatternTokens

    def step(self) -> float:
        """One optimizer step; returns its loss."""
        return self.trainer.train_step().loss


def bench_config(extra: list[str] | None = None):
    """The benchmark config with ``extra`` Hydra overrides on top."""
    return load_config([*BENCH_OVERRIDES, *(extra or [])])


def build_run(extra: list[str] | None = None, rank: int = 0, world: int = 1) -> MishRun:
    """Config -> topology -> model -> Trainer, as ``megatronish.job`` does, without data files.

    Collective when ``world > 1`` (torch.distributed must be initialised).
    """
    cfg = bench_config(extra)
    check_config(cfg, world)
    d = derive(cfg, world)
    p = cfg.parallel
    topo = Topology.build(tp=p.tp, dp=d.dp, pp=p.pp, rank=rank)
    spec = ModelSpec.from_config(cfg.model, cfg.model.vocab_size)
    rng = RNGTracker(topo.device)
    rng.seed(cfg.trainer.seed, tp_rank=topo.coords.tp, pp_rank=topo.coords.pp)
    chunks = build_model(cfg, topo, d, spec, rng)
    data = PatternTokens(spec.vocab_size, spec.seq_length, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, topo, spec, d, chunks, data)
    return MishRun(cfg, topo, spec, chunks, trainer, data)


def full_weights(extra: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The global (unsharded) initial weights of the model, by megatronish parameter name.

    megatronish initialises every layout to the same global weights, so the one-process model
    gives them without any collective.
    """
    cfg = bench_config([*(extra or []), "parallel.tp=1", "parallel.sp=false"])
    d = derive(cfg, 1)
    topo = Topology.single()
    spec = ModelSpec.from_config(cfg.model, cfg.model.vocab_size)
    rng = RNGTracker(topo.device)
    rng.seed(cfg.trainer.seed, tp_rank=0, pp_rank=0)
    (chunk,) = build_model(cfg, topo, d, spec, rng)
    return {n: p.detach().clone() for n, p in chunk.named_parameters()}


def batch(data: PatternTokens, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[b, s]`` of the global batch of ``step``, as the Trainer reads them."""
    first = step * batch_size
    rows = torch.stack([data[i] for i in range(first, first + batch_size)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
