"""Packed documents on CPU: training tokens/s with and without document masks (positions reset,
EOD targets left out) on the built-in corpus, whose documents are the standard library's
modules; and the attention core alone by each exact way to mask documents on a CPU (one SDPA
with the microbatch's mask, SDPA per document, plain causal as the unmasked bound).
Run alone: ``.venv/bin/python tools/bench/packed.py [--quick]``.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from common import BENCH_OVERRIDES, cli, interleaved, median, paired_ratio, table, threads

from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.document_attention import (
    masked_document_attention,
    segmented_document_attention,
)
from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.split import split_sequence
from megatronish.data.documents import DocumentPacking, document_lengths, expected_attention_span
from megatronish.data.gpt_dataset import GPTDataset
from megatronish.data.indexed import IndexedDataset
from megatronish.data.sentencepiece_tokenizer import SentencePieceTokenizer
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus
from megatronish.testing.runs import build_trainer

CACHE = "~/.cache/megatronish"
PACKED = [
    "data.reset_attention_mask=true",
    "data.reset_position_ids=true",
    "data.eod_mask_loss=true",
]
# (seq_length, micro batch): the default run's shape, and a longer window of as many tokens
SHAPES = [(256, 8), (1024, 2)]


def corpus() -> tuple[IndexedDataset, int]:
    prefix, model = ensure_stdlib_corpus(CACHE, 4096, 8.0)
    return IndexedDataset(prefix), SentencePieceTokenizer(model).eod_id


def trainer(extra: list[str], s: int, b: int, indexed: IndexedDataset, eod: int):
    shape = [f"model.seq_length={s}", f"trainer.micro_batch_size={b}"]
    shape.append(f"trainer.global_batch_size={b}")
    t = build_trainer(0, 1, [*shape, *extra], 1_000_000, model=BENCH_OVERRIDES, eod_id=eod)
    t.train_data = GPTDataset(indexed, s, seed=1234)
    return t


def training(s: int, b: int, indexed, eod: int, repeats: int) -> dict:
    runs = {
        "unmasked": trainer([], s, b, indexed, eod),
        "documents": trainer(PACKED, s, b, indexed, eod),
    }
    steps = {name: (lambda t=t: t.train_step().loss) for name, t in runs.items()}
    times = interleaved(steps, repeats, 2, warmup=2)
    return {"times": times, "tokens": s * b}


def attention_paths(s: int, b: int, indexed, eod: int, repeats: int) -> dict:
    """Forward + backward of one attention core (tiny's 4 heads / 2 kv, d 32) on real windows."""
    data = GPTDataset(indexed, s, seed=1234)
    packing = DocumentPacking(eod, reset_attention_mask=True)
    samples = [(data[i], document_lengths(data.tokens(i), eod)) for i in range(b)]
    layout = packing.microbatch(samples, 1, 0, None)
    ids, segments = layout.ids, layout.segments
    gen = torch.Generator().manual_seed(0)
    q0 = torch.randn(b, 4, s, 32, generator=gen)
    kv0 = torch.randn(b, 2, s, 32, generator=gen)
    cp = CPContext(seq_length=s)

    def leaves():
        return (q0.clone().requires_grad_(), kv0.clone().requires_grad_(), kv0.clone())

    def one_mask():
        q, k, v = leaves()
        docs = Documents(ids=ids)  # a new microbatch: its mask is built in the timing
        masked_document_attention(q, k, v, docs, cp, 0.0).sum().backward()

    def by_segments():
        q, k, v = leaves()
        docs = Documents(ids=ids, segments=segments)
        segmented_document_attention(q, k, v, docs, 0.0).sum().backward()

    def per_document():
        q, k, v = leaves()
        outs = []
        for row in range(b):
            bounds = np.cumsum(np.bincount(ids[row].numpy()))
            start = 0
            for end in bounds.tolist():
                sl = slice(start, end)
                outs.append(
                    F.scaled_dot_product_attention(
                        q[row : row + 1, :, sl],
                        k[row : row + 1, :, sl],
                        v[row : row + 1, :, sl],
                        is_causal=True,
                        enable_gqa=True,
                    )
                )
                start = end
        torch.cat([o.reshape(-1) for o in outs]).sum().backward()

    def causal():
        q, k, v = leaves()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    variants = {
        "segments": by_segments,
        "one mask": one_mask,
        "per document": per_document,
        "causal": causal,
    }
    times = interleaved(variants, repeats, 5, warmup=2)
    docs = int(sum((r.max() + 1).item() for r in ids))
    return {"times": times, "documents": docs, "segments": sum(len(r) for r in segments)}


def cp_balance(indexed, eod: int, s: int, windows: int) -> list[list[object]]:
    """Attention work per cp rank under the load-balanced split with document masks: each
    query's same-document keys up to itself, summed over the rank's two chunks; the busiest
    rank over the mean, per window (mean and worst over ``windows`` corpus windows)."""
    data = GPTDataset(indexed, s, seed=1234)
    rows = []
    for cp in (2, 4, 8):
        ratios = []
        for i in range(windows):
            lengths = document_lengths(data.tokens(i), eod)
            ids = np.repeat(np.arange(lengths.size), lengths)[:s]
            starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1])
            work = np.arange(s) - starts[ids] + 1  # keys each query attends to
            per_rank = [
                work[split_sequence(torch.arange(s), 0, cp, r).numpy()].sum() for r in range(cp)
            ]
            ratios.append(max(per_rank) / np.mean(per_rank))
        rows.append([s, cp, float(np.mean(ratios)), float(np.max(ratios))])
    return rows


def run(quick: bool) -> dict:
    indexed, eod = corpus()
    _, lengths = indexed.document_spans()
    repeats = 3 if quick else 7
    train_rows, attn_rows, results = [], [], {}
    with threads(2):
        for s, b in SHAPES:
            t0 = time.perf_counter()
            r = training(s, b, indexed, eod, repeats)
            a = attention_paths(s, b, indexed, eod, repeats)
            results[f"s{s}"] = {"training": r, "attention": a, "seconds": time.perf_counter() - t0}
            tm = r["times"]
            rate = {n: r["tokens"] / median(ts) for n, ts in tm.items()}
            span = expected_attention_span(lengths, s)
            train_rows.append(
                [
                    s,
                    b,
                    span,
                    rate["unmasked"],
                    rate["documents"],
                    paired_ratio(tm["documents"], tm["unmasked"]),
                ]
            )
            at = a["times"]
            attn_rows.append(
                [
                    s,
                    b,
                    a["documents"],
                    a["segments"],
                    median(at["segments"]) * 1e3,
                    median(at["one mask"]) * 1e3,
                    median(at["per document"]) * 1e3,
                    median(at["causal"]) * 1e3,
                    paired_ratio(at["segments"], at["causal"]),
                ]
            )
    balance = cp_balance(indexed, eod, 4096, 16 if quick else 64)
    return {
        "title": "Packed documents: document masks on CPU",
        "config": {
            "model": "tiny (configs/model/tiny.yaml), vocab 4096, fp32, 2 threads",
            "corpus": f"the built-in corpus, {lengths.size:,} documents, median length "
            f"{int(np.median(lengths)):,} tokens",
            "documents": PACKED,
        },
        "results": results,
        "tables": [
            table(
                "Training tokens/s, median of interleaved repeats (step time ratio: paired "
                "median; above 1 the masked run is slower)",
                [
                    "seq|",
                    "micro batch|",
                    "mean document length per token|.0f",
                    "unmasked tokens/s|,.0f",
                    "with documents tokens/s|,.0f",
                    "documents / unmasked step time|.3f",
                ],
                train_rows,
            ),
            table(
                "One attention core, forward + backward on the corpus's windows (ms, median; "
                "segments: megatronish's CPU path; the last column its paired ratio to unmasked "
                "causal attention)",
                [
                    "seq|",
                    "micro batch|",
                    "documents|",
                    "segments|",
                    "segments ms|.2f",
                    "one mask per microbatch ms|.2f",
                    "SDPA per document ms|.2f",
                    "causal, unmasked ms|.2f",
                    "segments / causal|.2f",
                ],
                attn_rows,
            ),
            table(
                "Context parallelism with document masks: the busiest cp rank's attention work "
                "over the mean (1.00 = balanced; without documents every rank's is equal), on "
                "the corpus's 4096-token windows",
                ["seq|", "cp|", "mean over windows|.3f", "worst window|.3f"],
                balance,
            ),
        ],
        "facts": {},
    }


if __name__ == "__main__":
    cli(run, __doc__)
