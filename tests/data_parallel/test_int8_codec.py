"""The int8 codec of ``grad_compression=int8`` on its own: one scale per block of ``BLOCK``
elements, so every block is reconstructed to within half a step of its own absmax / 127, however
small it is next to the other blocks of its shard.

A scale shared by a whole shard (or a row) would round the elements of its small blocks to zero;
training still converges (error feedback sends them later), so only a direct bound shows it.
"""

import torch

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.int8_reduce import BLOCK, Int8Compressor, dequantize, quantize
from megatronish.distributed.comm import single_group

# Block magnitudes spread over twelve decades, a zero block, and a short last block.
MAGNITUDES = [1.0, 3e-3, 1e-6, 0.0, 2e2, 1e-10, 5e-2]
TAIL = 40  # elements of the last block (the one of magnitude MAGNITUDES[-1])


def _blocks(rows: int, seed: int) -> torch.Tensor:
    """``[rows, n]`` fp32 grads whose blocks have very different magnitudes (rotated per row)."""
    g = torch.Generator().manual_seed(seed)
    n = (len(MAGNITUDES) - 1) * BLOCK + TAIL
    x = torch.randn(rows, n, generator=g)
    for r in range(rows):
        for k in range(len(MAGNITUDES)):
            x[r, k * BLOCK : (k + 1) * BLOCK] *= MAGNITUDES[(k + r) % len(MAGNITUDES)]
    return x


def _assert_each_block_within_half_its_own_step(x: torch.Tensor, got: torch.Tensor) -> None:
    """Every element of ``got`` is within ``absmax(its block of x) / 127 / 2`` of ``x``."""
    rows, n = x.shape
    for r in range(rows):
        for lo in range(0, n, BLOCK):
            block, back = x[r, lo : lo + BLOCK], got[r, lo : lo + BLOCK]
            half_step = block.abs().max().item() / 127 / 2
            err = (back - block).abs().max().item()
            # fp32's division and product add at most 127 * 2^-23 of a step to the half step
            assert err <= half_step * (1 + 1e-4), (r, lo // BLOCK, err, half_step)


def test_every_block_is_reconstructed_within_half_a_step_of_its_own_absmax():
    x = _blocks(3, seed=0)
    q, scales = quantize(x)
    blocks = -(-x.shape[1] // BLOCK)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, blocks)
    _assert_each_block_within_half_its_own_step(x, dequantize(q, scales))
    for r in range(3):
        for k in range(blocks):
            block = x[r, k * BLOCK : (k + 1) * BLOCK]
            amax = block.abs().max()
            torch.testing.assert_close(scales[r, k], amax / 127, rtol=1e-6, atol=0.0)
            codes = q[r, k * BLOCK : (k + 1) * BLOCK]
            if amax > 0:  # the block's own largest value uses the whole range, small or not
                assert codes.abs().max() == 127, (r, k)
            else:
                assert torch.all(codes == 0)


def test_the_compressed_reduction_keeps_each_blocks_precision_and_its_error():
    """Through the compressor (pack, exchange, unpack, sum; one member): the shard received is
    within each block's own half step, and what it lost is the error kept for the next step."""
    x = _blocks(1, seed=1)[0]
    n = x.numel()
    # sharded over 2 ranks (so it is compressed), reduced here over a group of one
    bucket = Bucket([], [], n, 2, 0, False, torch.device("cpu"))
    codec = Int8Compressor([bucket])
    into = torch.full((n,), float("nan"))
    reduction = codec.launch(bucket, x.clone(), into, False, single_group("dp"))
    reduction.advance()
    reduction.finish()
    _assert_each_block_within_half_its_own_step(x.view(1, n), into.view(1, n))
    torch.testing.assert_close(codec.errors[0], x - into, rtol=0.0, atol=0.0)
