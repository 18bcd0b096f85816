"""What the plan counts for ring attention's blocks: the kernel they run on the plan's device,
the temporaries of their backward (the plain-matmul kernel's fp32 score tiles with packed
documents on CUDA) against a measured backward, and the fp32 dK|dV accumulators' bytes."""

import pytest
import torch
from torch.autograd.profiler import profile

from megatronish.config.compose import load_config
from megatronish.context_parallel import ring_kernel as rk
from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.ring import ring_attention
from megatronish.distributed.comm import ParallelGroup
from megatronish.plan.context_parallel import (
    cp_volume,
    ring_accumulator_bytes,
    ring_block_bytes,
    ring_block_kernel,
    ring_workspace,
)
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import Layout, layout_from_config, spec_of
from megatronish.spec import ModelSpec
from megatronish.testing.recording_p2p import RecordingP2P
from megatronish.testing.runs import PACKED_DOCUMENTS
from megatronish.testing.runs import test_config as tiny_config

GiB = 1 << 30


def _layout(**changes) -> Layout:
    base = Layout(
        tp=1, pp=1, vpp=1, dp=1, sp=False, zero_stage=0, micro_batch_size=2, global_batch_size=2
    )
    return base.with_(cp=2, cp_comm_type="ring").with_(**changes)


SPEC = ModelSpec(
    arch="llama",
    num_layers=1,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    seq_length=128,
    vocab_size=128,
    padded_vocab_size=128,
    max_position_embeddings=128,
)


def test_the_plan_runs_the_blocks_on_the_runtimes_kernel():
    """The kernel the plan counts is the runtime's rule for its device, dtype and documents
    (documents on CUDA: the math kernel), and the config's document masks reach the layout."""
    for device in ("cuda", "cpu"):
        for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            for documents in (False, True):
                layout = _layout(device_type=device, precision=precision, document_masks=documents)
                want = rk.block_kernel(device, dtype, SPEC.head_dim, documents)
                assert ring_block_kernel(SPEC, layout) == want
    bf16 = _layout(precision="bf16")
    assert ring_block_kernel(SPEC, bf16) == "cuda_flash"
    assert ring_block_kernel(SPEC, bf16.with_(document_masks=True)) == "math"
    assert layout_from_config(tiny_config(list(PACKED_DOCUMENTS), 1), 1).document_masks
    assert not layout_from_config(tiny_config([], 1), 1).document_masks


def _peak(prof) -> int:
    """Peak net allocation over the profiled region."""
    events = sorted(
        (e for e in prof.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _measured_backward(cp: int) -> int:
    """The most any rank's ring backward allocates (SPEC's shapes, packed documents, fp32, the
    blocks on the math kernel), each rank run in turn with a recording communicator."""
    s, b = SPEC.seq_length // cp, 2
    ids = (torch.arange(SPEC.seq_length) // 24).expand(b, -1).contiguous()
    most = 0
    for rank in range(cp):
        ctx = CPContext(
            group=ParallelGroup(name="cp", ranks=tuple(range(cp)), rank=rank),
            seq_length=SPEC.seq_length,
            comm_type="ring",
            p2p=lambda group: RecordingP2P(),
        )
        g = torch.Generator().manual_seed(rank)
        shapes = ((b, 4, s, 16), (b, 2, s, 16), (b, 2, s, 16))
        q, k, v = (torch.randn(shape, generator=g).requires_grad_() for shape in shapes)
        out = ring_attention(q, k, v, ctx, Documents(ids=ids))
        dout = torch.randn_like(out)
        with profile(use_cpu=True, profile_memory=True) as prof:
            out.backward(dout)
        most = max(most, _peak(prof))
    return most


@pytest.mark.parametrize("tile_rows", [64, 16, 4])
def test_the_planned_ring_workspace_covers_the_measured_backward(monkeypatch, tile_rows):
    """Packed documents on CUDA's rule (the math kernel, which runs on CPU too), the tile
    budget at ``tile_rows`` rows of the diagonal block's scores (64: the whole block at once):
    the plan's workspace for the ring's backward holds what it allocates, within 20%."""
    rule = rk.block_kernel
    monkeypatch.setattr(rk, "block_kernel", lambda device, *a, **kw: rule("cuda", *a, **kw))
    monkeypatch.setattr(rk, "MATH_TILE_BYTES", 2 * 4 * tile_rows * 64 * 4)
    measured = _measured_backward(2)
    planned = ring_workspace(SPEC, _layout(document_masks=True))
    assert measured <= planned <= 1.2 * measured, (planned, measured)


def _gpt_1b(seq: int, cp: int, documents: bool, pp: int = 1):
    cfg = load_config(
        [
            "+experiment=gpt_1b",
            f"model.seq_length={seq}",
            f"model.max_position_embeddings={seq}",
            "trainer.micro_batch_size=1",
            "trainer.global_batch_size=8",
            "trainer.precision=bf16",
            f"parallel.cp={cp}",
            "parallel.cp_comm_type=ring",
            f"parallel.pp={pp}",
        ]
    )
    spec, layout = spec_of(cfg), layout_from_config(cfg, 4 * cp * pp)  # tp 2, dp 2
    return spec, layout.with_(document_masks=documents)


@pytest.mark.parametrize("seq,cp", [(16384, 2), (131072, 8)])
def test_packed_documents_on_cuda_plan_the_math_kernels_score_tiles(seq, cp):
    """gpt_1b in bf16 on CUDA: with packed documents the ring's blocks run the math kernel,
    whose backward adds two fp32 score tiles (the budget's, at these lengths) and fp32 copies:
    more than the tiles, under a GiB, at 16k and 128k tokens alike (the whole diagonal block's
    scores would be 2 and 8 GiB, each). The first of two pipeline stages (no loss on it) plans
    that much more workspace; on one stage it is under the loss's logits here."""
    spec, plain = _gpt_1b(seq, cp, False, pp=2)
    documents = plain.with_(document_masks=True)
    extra = ring_workspace(spec, documents) - ring_workspace(spec, plain)
    assert 2 * rk.MATH_TILE_BYTES < extra < GiB, extra / GiB
    first = [make_plan(spec, x).stages[0].activations.workspace for x in (plain, documents)]
    assert first[1] - first[0] == extra
    tokens, heads = seq // cp, spec.num_heads // 2
    assert extra < heads * tokens * tokens * 4 / 2  # well under one whole block's scores


def test_the_ring_sends_its_accumulators_in_fp32():
    """bf16: the K|V blocks travel in bf16, the dK|dV accumulators (cp per layer and
    microbatch in backward) in fp32, twice a block's bytes."""
    spec, layout = _gpt_1b(16384, 4, False)
    block, accumulator = ring_block_bytes(spec, layout), ring_accumulator_bytes(spec, layout)
    assert accumulator == 2 * block
    calls, nbytes = cp_volume(spec, layout, 0)["cp/send"]
    passes = layout.num_microbatches * spec.num_layers
    kv, accumulators = passes * 2 * (4 - 1), passes * 4  # forward and backward; backward
    assert (calls, nbytes) == (kv + accumulators, kv * block + accumulators * accumulator)
