"""What a checkpoint saves and restores, as typed parts the training layer builds and hands down.

Saving, loading and resuming read these parts and nothing else of the run, so the checkpoint
layer depends only on the layers below it (ZeRO, the optimizer, the RNG tracker, the topology,
the model spec, the config schema), never on the trainer that owns the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatronish.config.schema import TrainConfig
from megatronish.data_parallel.zero import ZeroDataParallel
from megatronish.distributed.topology import Topology
from megatronish.optim.sharded_adamw import ShardedAdamW
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.random import RNGTracker


class TrainProgress(Protocol):
    """The training loop's counters: saved in the metadata, restored by a load."""

    step: int
    consumed_samples: int  # the data cursor: the global sample the next step starts at
    skipped_steps: int
    skipped_in_a_row: int  # a load resets it: a saved step never ends a skip streak


@dataclass(frozen=True)
class CheckpointParts:
    """One rank's state a checkpoint holds (model and ZeRO state, optimizer state, the train
    state with the data cursor, the RNG streams) and what saving and loading need of the run
    around it."""

    cfg: TrainConfig
    topo: Topology
    spec: ModelSpec
    zero: ZeroDataParallel  # the params: their fp32 main values in buckets, sharded by ZeRO
    optimizer: ShardedAdamW  # the Adam moments (sharded like the params) and the update count
    progress: TrainProgress
    # The dropout streams, saved per rank and restored by a load (reseeded from the seed and
    # the step on a new layout); None: a save holds no streams and a load restores none.
    rng: RNGTracker | None
    settle: Callable[[], None]  # learns the pending steps' skips (a save first calls it)
    drop_unsettled: Callable[[], None]  # forgets the pending steps a load replaced
    log: Callable[[str], None]  # one line to the run's log
    # The model's state that is not a parameter (the expert biases of aux-loss-free balancing),
    # by global name: the same on every rank holding it, saved once, restored in any layout.
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)


def model_buffers(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every persistent buffer of ``chunks`` by global name (their state_dict minus params)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        params = {n for n, _ in chunk.named_parameters()}
        out.update({n: t for n, t in chunk.state_dict(keep_vars=True).items() if n not in params})
    return out
