"""Gradient compression (parallel.grad_compression): the codecs, training with them, and their
error feedback through checkpoints."""

import dataclasses

import pytest
import torch

from megatronish.checkpoint.load import load_into
from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.compression import CompressionSettings, make_compressor
from megatronish.data_parallel.int8_reduce import BLOCK, dequantize, packed_bytes, quantize
from megatronish.data_parallel.powersgd import bucket_matrices, compressible, orthonormalize
from megatronish.distributed.comm import single_group
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.rank_model import meta_chunks
from megatronish.plan.report import parallel_values
from megatronish.tensor_parallel.sharding import param_info, update_param_info
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, losses_of, merge_params, train_layout
from megatronish.testing.runs import test_config as tiny_config


def test_int8_blocks_round_to_within_half_a_step_of_their_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * BLOCK + 17, generator=g) * torch.tensor([[1.0], [1e-3], [0.0]])
    q, scales = quantize(x)
    assert q.dtype == torch.int8 and scales.shape == (3, 3)
    assert torch.all(scales[2] == 0) and torch.all(q[2] == 0)  # a block of zeros stays zero
    err = (x - dequantize(q, scales)).abs()
    step = scales.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    assert torch.all(err <= step / 2 * (1 + 1e-6))
    assert torch.all(q.abs().amax(1)[:2] == 127)  # each block's largest value uses the range
    assert packed_bytes(2 * BLOCK + 17) == 2 * BLOCK + 17 + 4 * 3


def test_powersgd_compresses_the_matrices_that_gain_and_orthonormalises_in_fp32():
    assert compressible(torch.Size([256, 64]), 4) == (256, 64)
    assert compressible(torch.Size([64, 4, 16]), 4) == (64, 64)  # first dim by the rest
    assert compressible(torch.Size([64]), 4) is None
    assert compressible(torch.Size([8, 8]), 4) is None  # (8 + 8) * 4 * 2 > 64: no gain
    p = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    orthonormalize(p)
    assert torch.allclose(p.t() @ p, torch.eye(4), atol=1e-5)


STEPS = 30
WARMUP = 10  # steps reduced uncompressed in the last layout
BANDS = {  # final loss after 30 steps against the uncompressed run's, at most this much above
    ("parallel.zero_stage=2", "parallel.grad_compression=int8"): 0.005,
    ("parallel.zero_stage=0", "parallel.grad_compression=powersgd"): 0.03,
    (
        "parallel.zero_stage=1",
        "parallel.grad_compression=powersgd",
        "parallel.powersgd_rank=8",
    ): 0.02,
    (
        "parallel.zero_stage=1",
        "parallel.grad_compression=powersgd",
        f"parallel.grad_compression_start_step={WARMUP}",
    ): 0.02,
}
_PLAIN: list = []


def plain():
    if not _PLAIN:
        _PLAIN.append(run_world(train_layout, 2, ["parallel.zero_stage=1"], STEPS)[0].losses)
    return _PLAIN[0]


@pytest.mark.parametrize("layout", list(BANDS), ids=[" ".join(k[1:]) for k in BANDS])
def test_compressed_training_tracks_the_uncompressed_run(layout):
    """The tiny model on 2 dp ranks: int8's rounding (fed back) leaves the curve where it was;
    PowerSGD's low rank lags at first, less at rank 8 than at 4, and less after a warm-up of
    uncompressed steps."""
    ref = plain()
    losses = run_world(train_layout, 2, list(layout), STEPS)[0].losses
    if any("start_step" in key for key in layout):  # the warm-up steps were not compressed
        assert losses[: WARMUP + 1] == ref[: WARMUP + 1]
        assert losses[WARMUP + 1] != ref[WARMUP + 1]
    assert losses[-1] <= ref[-1] * (1 + BANDS[layout])
    assert losses[-1] < losses[0] - 0.5 * (ref[0] - ref[-1])  # it learns most of what ref does
    assert losses != ref  # the reductions really were compressed


RESUMED = [
    ["parallel.zero_stage=1", "parallel.grad_compression=powersgd"],
    ["parallel.zero_stage=2", "parallel.grad_compression=int8"],
]


@pytest.mark.parametrize("layout", RESUMED, ids=["powersgd-zero1", "int8-zero2"])
def test_resume_on_the_same_layout_is_bit_identical(tmp_path, layout):
    """The error feedback (and PowerSGD's warm-start Q) is saved per rank and restored."""
    sched = ["scheduler.decay_steps=6", *layout]
    straight = run_world(train_layout, 2, sched, 6)
    saved = run_world(train_layout, 2, sched, 3, None, str(tmp_path))
    resumed = run_world(train_layout, 2, sched, 6, str(tmp_path))
    assert losses_of(saved) + losses_of(resumed) == losses_of(straight)
    a, b = merge_params(straight), merge_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _load_elsewhere(rank, world, path):
    trainer = build_trainer(
        rank, world, ["parallel.zero_stage=1", "parallel.grad_compression=int8"]
    )
    lines = []
    parts = dataclasses.replace(trainer.checkpoint_parts, log=lines.append)
    for t in trainer.zero.compressor.state_dict().values():
        t.fill_(1.0)
    load_into(parts, path)
    state = trainer.zero.compressor.state_dict().values()
    return lines, all(torch.count_nonzero(t) == 0 for t in state)


def test_resume_on_another_dp_size_starts_the_error_feedback_from_zero(tmp_path):
    run_world(
        train_layout,
        2,
        ["parallel.zero_stage=1", "parallel.grad_compression=int8"],
        2,
        None,
        str(tmp_path),
    )
    for rank, (lines, zeroed) in enumerate(run_world(_load_elsewhere, 4, str(tmp_path))):
        assert zeroed
        said = [line for line in lines if "error feedback starts from zero" in line]
        assert len(said) == (rank == 0), lines
        assert "written by another layout" in said[0] if said else True


def _bucket(*shapes):
    """A bucket of fresh parameters of ``shapes``, sharded over 2 ranks (so it is compressed),
    reduced here over a group of one (the codec's arithmetic alone)."""
    params = [(f"p{i}", torch.nn.Parameter(torch.empty(s))) for i, s in enumerate(shapes)]
    offsets = [sum(p.numel() for _, p in params[:i]) for i in range(len(params))]
    numel = sum(p.numel() for _, p in params)
    return Bucket(params, offsets, numel + numel % 2, 2, 0, False, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["int8", "powersgd"])
def test_error_feedback_keeps_the_sum_of_what_was_sent_next_to_the_sum_of_the_grads(kind):
    """Sending the same grads 40 times: with error feedback the sum of what arrived differs
    from the sum of the grads by the error still held back (int8: one rounding; PowerSGD: what
    its rank-2 power iteration has not yet caught up with); without it the same error adds up
    40 times."""
    bucket = _bucket((64, 48), (48,))
    codec = make_compressor(CompressionSettings(kind, powersgd_rank=2), [bucket], seed=0)
    group = single_group("dp")
    grads = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(3))
    sent = torch.zeros_like(grads)
    for _ in range(40):
        full = grads.clone()
        reduction = codec.launch(bucket, full, full, False, group)
        reduction.advance()
        reduction.finish()
        sent += full
    residual = (sent - 40 * grads).abs().max()
    one_step = (grads - full).abs().max()  # the last step's own error, no feedback
    assert residual < 0.2 * 40 * one_step  # the errors did not add up
    if kind == "int8":
        assert residual <= one_step


def test_powersgd_leaves_the_vocabulary_matrices_uncompressed_unless_asked():
    """The word embedding's and the output layer's grads are far from low rank (one row per
    token); PowerSGD all-reduces them as they are unless parallel.powersgd_compress_vocab."""
    bucket = _bucket((256, 64), (256, 64))
    update_param_info(bucket.params[1][1], vocab=True)
    assert [m.offset for m in bucket_matrices(bucket, 4)] == [0]
    assert [m.offset for m in bucket_matrices(bucket, 4, compress_vocab=True)] == [0, 256 * 64]
    cfg = tiny_config(["parallel.pp=2"], 1)
    for pp_rank, expected in ((0, {"embedding.word.weight"}), (1, {"head.weight"})):
        (chunk,) = meta_chunks(spec_of(cfg), layout_from_config(cfg, 2), pp_rank)
        assert {n for n, p in chunk.named_parameters() if param_info(p).vocab} == expected


def test_the_plan_and_the_written_layout_follow_powersgd_compress_vocab():
    layouts, sent = {}, {}
    for vocab in (False, True):
        cfg = tiny_config(
            [
                "parallel.zero_stage=1",
                "parallel.grad_compression=powersgd",
                f"parallel.powersgd_compress_vocab={vocab}",
            ],
            1,
        )
        layouts[vocab] = layout_from_config(cfg, 2)
        sent[vocab] = make_plan(spec_of(cfg), layouts[vocab]).stages[0].comm["dp/all_reduce"][1]
    assert sent[True] < sent[False]
    assert parallel_values(layouts[True])["powersgd_compress_vocab"] is True
    assert "powersgd_compress_vocab" not in parallel_values(layouts[False])
