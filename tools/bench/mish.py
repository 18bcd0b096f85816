"""Build megatronish's own Trainer for a benchmark: the real config, synthetic data, no files."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatronish.config.compose import load_config
from megatronish.distributed.topology import Topology
from megatronish.model.spec import ModelSpec
from megatronish.testing.runs import build_trainer
from megatronish.testing.synthetic import PatternTokens
from megatronish.training.trainer import Trainer

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
    """A Trainer on the benchmark config (``megatronish.testing.runs.build_trainer``).

    Collective when ``world > 1`` (torch.distributed must be initialised).
    """
    t = build_trainer(rank, world, list(extra or []), 1_000_000, model=BENCH_OVERRIDES)
    return MishRun(t.cfg, t.topo, t.spec, t.chunks, t, t.train_data)


def full_weights(extra: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The global (unsharded) initial weights of the model, by megatronish parameter name.

    megatronish initialises every layout to the same global weights, so the one-process model
    gives them without any collective.
    """
    (chunk,) = build_run([*(extra or []), "parallel.tp=1", "parallel.sp=false"]).chunks
    return {n: p.detach().clone() for n, p in chunk.named_parameters()}


def batch(data: PatternTokens, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[b, s]`` of the global batch of ``step``, as the Trainer reads them."""
    first = step * batch_size
    rows = torch.stack([data[i] for i in range(first, first + batch_size)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
