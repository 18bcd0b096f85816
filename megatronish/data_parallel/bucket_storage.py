"""Where a bucket's parameters live under a ZeRO stage: the model's flat params, this rank's
shard of them and its fp32 main shard (the one the optimizer updates).

Without sharded params (ZeRO 0-2) every rank holds the whole flat buffer and the shard is a view
of it; ZeRO 3 keeps only the shard (its own copy) and the flat buffer gets storage when gathered.
With ``param_dtype`` other than fp32 the main shard is a separate fp32 copy, else the shard
itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.param_gather import resize_storage
from megatronish.data_parallel.stages import ZeroStage

if TYPE_CHECKING:
    from megatronish.model.init import DeferredInit


def owned_elements(b: Bucket, zero_stage: ZeroStage) -> tuple[int, int]:
    """The elements of ``b`` this rank updates: its shard, or all of them without sharding."""
    return b.shard_range if zero_stage.shards_optimizer_state else (0, b.numel)


@torch.no_grad()
def allocate_params(
    b: Bucket,
    zero_stage: ZeroStage,
    param_dtype: torch.dtype,
    deferred: DeferredInit | None = None,
) -> None:
    """Move ``b``'s params into one flat buffer and set its ``param_flat``, ``param_shard`` and
    ``main_shard``; a meta build is drawn shard by shard from ``deferred`` (ZeRO 3)."""
    lo, hi = owned_elements(b, zero_stage)
    separate_main = param_dtype != torch.float32
    if any(p.is_meta for _, p in b.params):  # a meta build not yet drawn
        _draw_shard(b, zero_stage, param_dtype, deferred, lo, hi)
        return
    main = torch.zeros(b.numel, device=b.device)  # fp32 values as initialised
    for _, p, view in b.views(main):
        view.copy_(p.data)
    flat = main.to(param_dtype) if separate_main else main
    b.point_params_at(flat)
    b.param_flat = flat
    b.param_shard = flat[lo:hi].clone() if zero_stage.shards_params else flat[lo:hi]
    b.main_shard = main[lo:hi].clone() if separate_main else b.param_shard
    if zero_stage.shards_params:
        resize_storage(flat, 0)  # params live as shards; gathered on demand


def _draw_shard(
    b: Bucket,
    zero_stage: ZeroStage,
    param_dtype: torch.dtype,
    deferred: DeferredInit | None,
    lo: int,
    hi: int,
) -> None:
    """Zero 3 on a meta build: draw only this rank's shard ``[lo, hi)`` of ``b`` (one
    parameter at a time); the full params get storage only when gathered."""
    if not zero_stage.shards_params or deferred is None:
        raise ValueError(
            f"parameters on the meta device need ZeRO 3 and the chunk's deferred_init "
            f"(stage {zero_stage.number}, deferred_init {deferred}): build_chunks(deferred=True)"
        )
    main = b.shard_values(deferred.value, lo, hi)
    flat = torch.empty(b.numel, dtype=param_dtype, device=b.device)  # views need it once
    b.point_params_at(flat)
    resize_storage(flat, 0)  # params live as shards; gathered on demand
    b.param_flat = flat
    b.param_shard = main.to(param_dtype) if param_dtype != torch.float32 else main
    b.main_shard = main
