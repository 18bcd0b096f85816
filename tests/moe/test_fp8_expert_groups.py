"""The fp8 experts' weight grad sums each expert's tokens in groups padded to whole blocks of 16
rows (CUDA's kernel asserts on the device that every group but the last is such a multiple)."""

import torch

from megatronish.moe.fp8_grouped import ALIGN_ROWS, PaddedGroups
from megatronish.moe.grouped_mm import expert_offsets


def test_each_experts_rows_are_padded_to_whole_blocks_of_16_rows_with_zeros():
    counts = [5, 0, 27, 16, 33]  # an expert without rows gets one block of zeros
    groups = PaddedGroups(counts, expert_offsets(counts, torch.device("cpu")))
    assert ALIGN_ROWS == 16
    assert groups.ends == [16, 32, 64, 80, 128] and groups.rows == 128
    assert groups.offsets.dtype == torch.int32 and groups.offsets.tolist() == groups.ends
    starts = [0, *groups.ends[:-1]]
    placed = [start + i for start, n in zip(starts, counts, strict=True) for i in range(n)]
    assert groups.destination.tolist() == placed  # each row at its group's start, in order
    x = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(0))
    q, scale = groups.quantize(x)
    assert q.shape == (128, 8) and scale.shape == (len(counts) * 8,)
    padding = torch.ones(128, dtype=torch.bool)
    padding[placed] = False
    assert not q[padding].float().any()
    group_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    dequantized = q[placed].float() * scale.view(len(counts), 8)[group_of_row]
    torch.testing.assert_close(dequantized, x, rtol=2**-4, atol=1e-3)  # e4m3 keeps 3 bits
