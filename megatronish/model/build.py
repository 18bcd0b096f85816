"""Build this rank's model chunks for a layout."""

from __future__ import annotations

import torch

from megatronish.model.gpt import GPTChunk
from megatronish.model.init import init_parameters
from megatronish.model.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext


def chunk_layer_ranges(layers_per_chunk: list[int] | tuple[int, ...]) -> list[range]:
    """Global layer indices of every chunk, in order."""
    out, start = [], 0
    for n in layers_per_chunk:
        out.append(range(start, start + n))
        start += n
    return out


def chunk_ids_of_stage(pp_rank: int, pp: int, vpp: int) -> list[int]:
    """Chunks on pipeline rank ``pp_rank``: chunk c lives on rank c % pp."""
    return [pp_rank + v * pp for v in range(vpp)]


def build_chunks(
    spec: ModelSpec,
    tp: TPContext,
    layers_per_chunk: list[int] | tuple[int, ...],
    pp_rank: int = 0,
    pp: int = 1,
    vpp: int = 1,
    seed: int = 1234,
    device: torch.device | str = "cpu",
) -> list[GPTChunk]:
    """This pipeline rank's chunks (virtual stages), initialised from ``seed``."""
    ranges = chunk_layer_ranges(layers_per_chunk)
    n = len(ranges)
    chunks = []
    for c in chunk_ids_of_stage(pp_rank, pp, vpp):
        chunk = GPTChunk(spec, tp, ranges[c], first=c == 0, last=c == n - 1, device=device)
        init_parameters(chunk, seed, tp.group.rank, tp.size)
        chunks.append(chunk)
    return chunks
