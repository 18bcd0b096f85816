"""Data parallelism's rules: hybrid sharding (``parallel.zero_shard_size``) against the layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig


def data_parallel_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """Every data-parallel rule ``cfg`` breaks on ``dp`` data-parallel ranks."""
    p = cfg.parallel
    shard = getattr(p, "zero_shard_size", None)
    if shard is None:
        return []
    if p.zero_stage == 0:
        return [
            f"parallel.zero_shard_size={shard} sizes the groups ZeRO shards over, but "
            "parallel.zero_stage=0 shards nothing: set zero_stage to 1, 2 or 3, or "
            "zero_shard_size to null"
        ]
    if dp % shard:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        return [
            f"parallel.zero_shard_size={shard} must divide the data-parallel size dp={dp} "
            f"(shard groups of consecutive dp ranks, replicated across): use one of "
            f"{', '.join(map(str, divisors))}"
        ]
    return []
