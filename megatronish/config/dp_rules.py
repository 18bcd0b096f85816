"""Data parallelism's rules: hybrid sharding (``parallel.zero_shard_size``) and gradient
compression (``parallel.grad_compression``) against the layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig


def data_parallel_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """Every data-parallel rule ``cfg`` breaks on ``dp`` data-parallel ranks."""
    return hybrid_shard_errors(cfg, dp) + compression_errors(cfg, dp)


def compression_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """The rules of ``parallel.grad_compression``."""
    p = cfg.parallel
    kind = getattr(p, "grad_compression", None)
    if kind is None:
        start = getattr(p, "grad_compression_start_step", 0)
        if start:
            return [
                f"parallel.grad_compression_start_step={start} delays a compression that is not "
                "set: set parallel.grad_compression (powersgd or int8) or leave it at 0"
            ]
        return []
    key = f"parallel.grad_compression={kind}"
    if dp * p.cp == 1:
        return [
            f"{key} compresses the data-parallel reduction, and dp x cp = 1 has none: set it "
            "to null"
        ]
    if kind == "powersgd" and p.zero_stage > 1:
        return [
            f"{key} compresses the all-reduce of ZeRO 0 and 1, not parallel.zero_stage="
            f"{p.zero_stage}'s reduce-scatter of every microbatch: use zero_stage 0 or 1, or "
            "grad_compression=int8"
        ]
    if kind == "int8" and p.zero_stage == 0:
        return [
            f"{key} quantizes ZeRO's reduce-scatter, and parallel.zero_stage=0 all-reduces: use "
            "zero_stage 1, 2 or 3, or grad_compression=powersgd"
        ]
    errors = []
    if getattr(p, "zero_shard_size", None) not in (None, dp):
        errors.append(
            f"{key} compresses the reduction over every dp rank; with parallel.zero_shard_size "
            "the link between nodes carries only the shards' all-reduce, which it does not "
            "compress: use one of them"
        )
    if p.grad_reduce_dtype != "fp32":
        errors.append(
            f"{key} sends its own compressed format: set parallel.grad_reduce_dtype=fp32 (it is "
            f"{p.grad_reduce_dtype})"
        )
    return errors


def hybrid_shard_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """The rules of ``parallel.zero_shard_size``."""
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
