"""What each ZeRO stage shards over the data-parallel ranks, and so what every rank keeps whole.

Each stage shards one more of the training state than the one before (ZeRO, Rajbhandari et al.
2020; DeepSpeed's stages, FSDP's ``SHARD_GRAD_OP`` and ``FULL_SHARD``):

- **0**: nothing. Grads are all-reduced (averaged) over dp once per step and every rank updates
  every parameter (plain data parallelism).
- **1**: the optimizer state (fp32 main params and Adam moments). Grads are reduce-scattered once
  per step into this rank's slice of its full grad buffers; the updated params are all-gathered.
- **2**: also the grads. Buckets follow the units (blocks), a bucket's full grads exist only
  from its first grad of a microbatch until its reduce-scatter into the shard, so every
  microbatch is reduced; params are all-gathered after the update as under 1.
- **3**: also the params. A unit's full params are gathered just before use and freed after
  (:mod:`~megatronish.data_parallel.param_gather`); nothing is gathered after the update.

Code asks the stage what it shards (``stage.shards_grads``) instead of comparing numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroStage:
    """One ZeRO stage: what it shards over dp (the rest every dp rank keeps whole)."""

    number: int
    shards_optimizer_state: bool  # fp32 main params and Adam moments: this rank's shard only
    shards_grads: bool  # reduced per microbatch into the shard; full grads live per bucket
    shards_params: bool  # the model's params live as shards, each unit gathered around its use

    @property
    def reduce_scatters_grads(self) -> bool:
        """Grads are reduce-scattered into this rank's shard (else all-reduced whole)."""
        return self.shards_optimizer_state

    @property
    def reduces_per_microbatch(self) -> bool:
        """Each microbatch's grads are reduced (and their full buffers freed), not the step's."""
        return self.shards_grads

    @property
    def gathers_after_update(self) -> bool:
        """Every rank keeps whole params, all-gathered from the shards the optimizer updated."""
        return self.shards_optimizer_state and not self.shards_params

    @property
    def norm_over_world(self) -> bool:
        """Ranks hold different grad shards, so the grad norm sums over every rank (not mp)."""
        return self.shards_optimizer_state


ZERO_STAGES: dict[int, ZeroStage] = {
    0: ZeroStage(0, shards_optimizer_state=False, shards_grads=False, shards_params=False),
    1: ZeroStage(1, shards_optimizer_state=True, shards_grads=False, shards_params=False),
    2: ZeroStage(2, shards_optimizer_state=True, shards_grads=True, shards_params=False),
    3: ZeroStage(3, shards_optimizer_state=True, shards_grads=True, shards_params=True),
}
