"""Packed documents in the model: every document of a packed window gets the logits and per-token
losses it gets run alone; the attention of each cp rank sees exactly its documents' keys; the
GPU's FlexAttention path is the CPU's mask path."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.document_attention import (
    document_attention,
    document_mask,
    flex_document_attention,
    masked_document_attention,
    segmented_document_attention,
)
from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.split import split_sequence
from megatronish.data.documents import DocumentPacking, attention_segments
from megatronish.testing.runs import build_trainer

EOD = 2
VOCAB = 250
PACKED = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
# (lengths of the documents of a 17-token window): a one-token document, documents ending on
# the cp-4 chunk boundaries, the last cut by the window's end
LENGTHS = [[5, 1, 2, 4, 5], [1, 1, 3, 12], [17]]


def packed_windows(lengths: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, list]:
    """``[b, 17]`` windows of random non-EOD tokens whose documents (all but the last) end in
    an EOD, and their ``(tokens, lengths)`` samples."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        w = torch.randint(3, VOCAB, (sum(row),), generator=gen)
        ends = torch.tensor(row).cumsum(0) - 1
        w[ends[:-1]] = EOD
        rows.append(w)
    return torch.stack(rows), [(w, torch.tensor(n).numpy()) for w, n in zip(rows, lengths)]


def model(arch: str, overrides=()):
    trainer = build_trainer(0, 1, [f"model.arch={arch}", *PACKED, *overrides], steps=1)
    chunk = trainer.chunks[0].eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger weights than the init: positions and masks matter more
        for p in chunk.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return trainer, chunk


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_document_gets_the_logits_and_losses_it_gets_alone(arch):
    trainer, chunk = model(arch)
    packing = DocumentPacking(EOD, True, True, True)
    windows, samples = packed_windows(LENGTHS)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    docs = packing.microbatch(samples, 1, 0, divisor=7.0)
    packed = chunk.head.logits(chunk(inputs, None, docs)).transpose(0, 1)[..., :VOCAB]
    unmasked = chunk.head.logits(chunk(inputs)).transpose(0, 1)[..., :VOCAB]
    total, worst = 0.0, 0.0
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            end = min(start + n, 16)  # the window's inputs are its first 16 tokens
            alone = chunk.head.logits(chunk(inputs[b : b + 1, start:end]))
            alone = alone.transpose(0, 1)[0, :, :VOCAB]
            worst = max(worst, (packed[b, start:end] - alone).abs().max().item())
            # per-token losses; eod_mask_loss drops the one whose target is the next document
            kept = end - start - (1 if start + n <= 16 else 0)
            losses = F.cross_entropy(
                alone[:kept], targets[b, start : start + kept], reduction="none"
            )
            total += losses.sum().item()
            start += n
    assert worst < 1e-5, f"packed vs alone logits differ by {worst:.2e}"
    # the unmasked window really differs: documents after the first see earlier documents
    assert (packed - unmasked).abs().max() > 1e-2
    loss = chunk(inputs, targets, docs).item()
    assert loss == pytest.approx(total / 7.0, rel=1e-6)


@torch.no_grad()
def test_documents_with_every_option_off_change_nothing():
    """The options off: no Documents reach the model (microbatches are pairs); an empty
    Documents is the same computation, bit for bit."""
    trainer = build_trainer(0, 1, [], steps=1)
    assert trainer.packing is None
    assert all(len(mb) == 2 for mb in trainer.microbatches(trainer.train_data, 0))
    chunk = trainer.chunks[0].eval()
    windows, _ = packed_windows(LENGTHS)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    assert torch.equal(chunk(inputs, targets), chunk(inputs, targets, Documents()))


@torch.no_grad()
def test_one_document_per_window_is_plain_causal_training():
    _, chunk = model("llama")
    packing = DocumentPacking(EOD, True, True, True)
    windows, samples = packed_windows([[17], [17]])
    inputs, targets = windows[:, :-1], windows[:, 1:]
    docs = packing.microbatch(samples, 1, 0, divisor=None)
    torch.testing.assert_close(chunk(inputs, targets, docs), chunk(inputs, targets))


def fake_cp(cp: int, rank: int, seq: int) -> CPContext:
    return CPContext(group=SimpleNamespace(size=cp, rank=rank), seq_length=seq)


def qkv(b: int = 3, heads: int = 4, kv_heads: int = 2, s: int = 16, d: int = 8):
    gen = torch.Generator().manual_seed(5)
    return (
        torch.randn(b, heads, s, d, generator=gen),
        torch.randn(b, kv_heads, s, d, generator=gen),
        torch.randn(b, kv_heads, s, d, generator=gen),
    )


def reference_attention(q, k, v, ids):
    """Each document of each row attended alone by plain causal SDPA."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for doc in ids[b].unique():
            at = (ids[b] == doc).nonzero()[:, 0]
            kk, vv = (t[b, :, at].repeat_interleave(rep, 0) for t in (k, v))
            o = F.scaled_dot_product_attention(q[b, :, at], kk, vv, is_causal=True)
            out[b, :, at] = o
    return out


def documents_of(lengths: list[list[int]]) -> Documents:
    _, samples = packed_windows(lengths)
    return DocumentPacking(EOD, reset_attention_mask=True).microbatch(samples, 1, 0, None)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_cp_rank_attends_to_exactly_its_documents_keys(cp):
    docs = documents_of(LENGTHS)
    q, k, v = qkv()
    want = reference_attention(q, k, v, docs.ids)
    for rank in range(cp):
        ctx = fake_cp(cp, rank, 16)
        local_q = split_sequence(q, 2, cp, rank)
        got = masked_document_attention(local_q, k, v, Documents(ids=docs.ids), ctx, 0.0)
        torch.testing.assert_close(got, split_sequence(want, 2, cp, rank), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("min_tokens", [1, 3, 6, 16])
def test_segments_of_whole_documents_attend_like_each_document_alone(min_tokens):
    """The CPU path: one SDPA per segment (a single document: plain causal; several: their
    mask), equal samples batched; segments of every size, from one per document to one."""
    lengths = [*LENGTHS, LENGTHS[0], [4, 4, 4, 5]]  # rows 0 and 3 share their segments
    docs = documents_of(lengths)
    segments = tuple(attention_segments(torch.tensor(n).numpy(), 16, min_tokens) for n in lengths)
    q, k, v = qkv(b=len(lengths))
    want = reference_attention(q, k, v, docs.ids)
    got = segmented_document_attention(q, k, v, Documents(ids=docs.ids, segments=segments), 0.0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if min_tokens == 1:  # one segment per document: no mask at all
        assert all(not several for row in segments for _, _, several in row)
    routed = Documents(ids=docs.ids, segments=segments)
    torch.testing.assert_close(document_attention(q, k, v, routed, fake_cp(1, 0, 16), 0.0), got)
    assert routed._derived or min_tokens == 1  # the CPU took the segments


def test_segments_cover_the_inputs_with_whole_documents():
    lengths = torch.tensor([200, 10, 47, 300]).numpy()
    assert attention_segments(lengths, 512) == (
        (0, 200, False),
        (200, 257, True),
        (257, 512, False),
    )
    five = attention_segments(torch.tensor([5] * 60).numpy(), 256)
    assert five == ((0, 130, True), (130, 256, True))  # closed at 128 tokens or more
    assert attention_segments(torch.tensor([256, 1]).numpy(), 256) == ((0, 256, False),)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("cp", [1, 2])
def test_flex_attention_path_equals_the_mask_path(cp):
    """FlexAttention's eager reference (CPU: forward only) with the block mask the GPU uses."""
    docs = documents_of(LENGTHS)
    q, k, v = qkv()
    for rank in range(cp):
        ctx = fake_cp(cp, rank, 16)
        local_q = split_sequence(q, 2, cp, rank)
        fresh = Documents(ids=docs.ids)
        flex = flex_document_attention(local_q, k, v, fresh, ctx, compiled=False)
        masked = masked_document_attention(local_q, k, v, Documents(ids=docs.ids), ctx, 0.0)
        torch.testing.assert_close(flex, masked, atol=1e-6, rtol=1e-5)


def test_masks_are_built_once_per_microbatch():
    docs = documents_of(LENGTHS)
    q, k, v = qkv()
    ctx = fake_cp(1, 0, 16)
    masked_document_attention(q, k, v, docs, ctx, 0.0)
    mask = next(iter(docs._derived.values()))
    masked_document_attention(q, k, v, docs, ctx, 0.0)
    assert len(docs._derived) == 1 and next(iter(docs._derived.values())) is mask
    visible = mask[:, 0] == 0
    assert torch.equal(
        visible, document_mask(docs.ids, docs.ids, torch.arange(16), q.dtype)[:, 0] == 0
    )
