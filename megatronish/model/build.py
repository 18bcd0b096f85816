"""Build this rank's model chunks for a layout."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from megatronish.model.gpt import GPTChunk
from megatronish.model.init import DeferredInit, init_parameters
from megatronish.model.parallel_context import ParallelContext
from megatronish.moe.experts import GroupedExperts
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def chunk_layer_ranges(layers_per_chunk: list[int] | tuple[int, ...]) -> list[range]:
    """Global layer indices of every chunk, in order."""
    out, start = [], 0
    for n in layers_per_chunk:
        out.append(range(start, start + n))
        start += n
    return out


def chunk_ids_of_stage(pp_rank: int, pp: int, vpp: int, v_shape: bool = False) -> list[int]:
    """Chunks on pipeline rank ``pp_rank``, in local (virtual) order.

    Chunk c lives on rank ``c % pp`` (a loop over the ranks, vpp times). ``v_shape`` (the ZBV
    schedule, vpp = 2): chunk c < pp on rank c and chunk c >= pp back on rank ``2 pp - 1 - c``,
    so rank 0 holds the first and the last chunk.
    """
    if v_shape:
        if vpp != 2:
            raise ValueError(f"the V placement holds two chunks per rank, not vpp={vpp}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(vpp)]


def stage_of_chunk(chunk: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds global chunk ``chunk`` (see :func:`chunk_ids_of_stage`)."""
    if v_shape and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def holds_last_chunk(pp_rank: int, pp: int, vpp: int, v_shape: bool = False) -> bool:
    """True on the pipeline rank that holds the last chunk (the head and the loss)."""
    return pp * vpp - 1 in chunk_ids_of_stage(pp_rank, pp, vpp, v_shape)


def build_chunks(
    spec: ModelSpec,
    ctx: ParallelContext,
    layers_per_chunk: list[int] | tuple[int, ...],
    pp_rank: int = 0,
    pp: int = 1,
    vpp: int = 1,
    seed: int = 1234,
    device: torch.device | str = "cpu",
    deferred: bool = False,
    v_shape: bool = False,
) -> list[GPTChunk]:
    """This pipeline rank's chunks (virtual stages), initialised from ``seed``.

    ``deferred`` (ZeRO 3): the parameters stay on the meta device, uninitialised, and each chunk
    gets a ``deferred_init`` (:class:`~megatronish.model.init.DeferredInit`) from which ZeRO
    materialises only this rank's shards on ``device``; no rank ever holds the whole chunk.
    Everything else (buffers, a MoE layer's ``stats``) is built on ``device`` with its values.
    ``v_shape``: the chunks of the V placement (:func:`chunk_ids_of_stage`).
    """
    device = torch.device(device)
    ranges = chunk_layer_ranges(layers_per_chunk)
    n = len(ranges)
    chunks = []
    for c in chunk_ids_of_stage(pp_rank, pp, vpp, v_shape):
        with parameters_on_meta() if deferred else contextlib.nullcontext():
            chunk = GPTChunk(spec, ctx, ranges[c], first=c == 0, last=c == n - 1, device=device)
        if deferred:
            chunk.deferred_init = DeferredInit(seed, ctx.tp.group.rank, ctx.tp.size, device)
        else:
            init_parameters(chunk, seed, ctx.tp.group.rank, ctx.tp.size)
        chunks.append(chunk)
    return chunks


def apply_fp8(
    chunks: list[GPTChunk], recipe: str, skip_first_last: int, num_layers: int
) -> tuple[int, int]:
    """``trainer.fp8``: the tensor-parallel linears of blocks ``skip_first_last`` to
    ``num_layers - skip_first_last - 1`` (global indices) and their experts run their GEMMs in
    fp8 with ``recipe`` (the experts as :mod:`megatronish.moe.fp8_grouped` says); the embedding
    and the head stay bf16. Returns how many linears and how many blocks' experts."""
    linears = experts = 0
    for chunk in chunks:
        for index, block in chunk.layers.items():
            if not skip_first_last <= int(index) < num_layers - skip_first_last:
                continue
            for module in block.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.fp8 = recipe
                    linears += 1
                elif isinstance(module, GroupedExperts):
                    module.fp8 = recipe
                    experts += 1
    return linears, experts


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get every parameter on the meta device, moved there as it is
    registered (so at most one parameter's uninitialised storage exists at a time); buffers and
    other tensors stay where, and as, they are made."""

    def to_meta(module: nn.Module, name: str, p: nn.Parameter) -> nn.Parameter | None:
        if p.is_meta:  # already moved (a weight shared by two modules)
            return None
        meta = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)  # ParamInfo and any other attribute
        return meta

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()
