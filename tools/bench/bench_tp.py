"""Tensor parallelism on 2 ranks: megatronish (tp=2, with and without sp) vs torch DTensor TP.

All four variants live in one forked 2-rank gloo world (one thread per rank): megatronish's
Trainer with ``parallel.tp=2`` (``parallel.sp`` false / true) and the reference GPT sharded with
``torch.distributed.tensor.parallel`` (without / with ``SequenceParallel``). They start from the
same global weights and train on the same batches with the same AdamW, clipping and learning
rate; their steps are timed interleaved. The same world then measures megatronish's activation
memory per rank and compares it with Korthikanti et al. (see ``actmem.py``).

Run alone: ``.venv/bin/python tools/bench/bench_tp.py [--quick]``.
"""

from __future__ import annotations

import math
import time

import dtensor_tp
import torch
import torch.distributed as dist
from actmem import ADAPTATION, korthikanti_16bit, korthikanti_fp32_no_dropout, measure_forward
from common import interleaved, machine_info, median, paired_ratio
from mish import batch, build_run, full_weights
from reference_run import make_reference_run
from sections import bench_cli, table

from megatronish.testing.multiproc import run_world
from megatronish.testing.reference_gpt import RefConfig, ReferenceGPT, load_megatronish_weights

NAME = "tp"
TITLE = "Tensor parallelism, 2 ranks: megatronish vs torch DTensor"
TP = 2
VARIANTS = ("megatronish tp=2", "megatronish tp=2 sp", "DTensor tp=2", "DTensor tp=2 sp")


# Checked by listing the tensors each block saves (2026-11); re-check when the model changes.
WHY_MORE = (
    "Why megatronish saves more than the fp32 formula (2026-11, by listing the saved tensors): "
    "its RMSNorm (torch's composite rms_norm) saves x, x*rsqrt(mean(x^2)) and its output (3 "
    "tensors of the norm's input size, the formula counts 1 plus the linear input); SwiGLU "
    "keeps gate|up (2f), SiLU(gate) (f) and the product (f) = 11h per token for f = 2.75h "
    "instead of GeLU's 8h; attention keeps the whole q|k|v projection output (V is a view of "
    "it) next to the rotated Q and K (GQA's K and V stay at the kv head count); and with sp the "
    "column-parallel linears save their all-gathered (full-sequence) input instead of the "
    "shard that Megatron-LM keeps and re-gathers in backward."
)


def _dtensor_run(sp: bool, cfg, spec, data):
    """The reference GPT with megatronish's initial weights, sharded by DTensor over the world."""
    model = ReferenceGPT(RefConfig.from_spec(spec, fused=True, tp_groups=TP))  # as megatronish
    load_megatronish_weights(model, full_weights())
    dtensor_tp.parallelize(model, dtensor_tp.cpu_mesh(), sp)
    return make_reference_run(
        model, cfg, data, clip=dtensor_tp.grad_norm_clip, context=dtensor_tp.loss_context
    )


def activation_bytes(run) -> dict[str, int]:
    """Saved-for-backward bytes per block of one microbatch forward of a megatronish run."""
    (chunk,) = run.chunks
    inputs, targets = batch(run.data, 0, run.cfg.trainer.micro_batch_size)
    chunk(inputs, targets).backward()  # builds the cached rope tables
    exclude = [*chunk.parameters(), *(getattr(chunk, "_rope", None) or ())]
    return measure_forward(lambda: chunk(inputs, targets), dict(chunk.layers.items()), exclude)


def _any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any rank."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _rank(rank: int, world: int, repeats: int, steps: int, budget_s: float) -> dict:
    """One rank of the world: build every variant, time them interleaved, measure memory."""
    runs = {
        VARIANTS[0]: build_run(["parallel.tp=2"], rank, world),
        VARIANTS[1]: build_run(["parallel.tp=2", "parallel.sp=true"], rank, world),
    }
    mish = runs[VARIANTS[0]]
    steppers = {name: r.step for name, r in runs.items()}
    for name, sp in ((VARIANTS[2], False), (VARIANTS[3], True)):
        steppers[name] = _dtensor_run(sp, mish.cfg, mish.spec, mish.data).step
    losses: dict[str, list[float]] = {n: [] for n in VARIANTS}

    def recorder(name):
        return lambda: losses[name].append(steppers[name]())

    times = interleaved(
        {n: recorder(n) for n in VARIANTS}, repeats, steps, sync=lambda: dist.barrier(),
        budget_s=budget_s, agree=_any_rank,
    )  # fmt: skip
    memory = {name: activation_bytes(runs[name]) for name in VARIANTS[:2]}
    dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return {"times": times, "losses": losses, "memory": memory}


def _single_memory() -> dict[str, int]:
    """Activation bytes of the one-process model (tp=1), for the table's first row."""
    return activation_bytes(build_run())


def run(quick: bool = False) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    repeats, steps, budget = (3, 2, 30.0) if quick else (9, 2, 100.0)
    tp1_memory = _single_memory()
    ranks = run_world(_rank, TP, repeats, steps, budget, timeout=900, collective_timeout=300)
    cfg = build_run().cfg
    m = cfg.model
    s, b, h, a = m.seq_length, cfg.trainer.micro_batch_size, m.hidden_size, m.num_attention_heads
    num_layers = m.num_layers

    # A step takes as long as its slowest rank.
    done = len(ranks[0]["times"][VARIANTS[0]])
    step_times = {n: [max(r["times"][n][i] for r in ranks) for i in range(done)] for n in VARIANTS}
    med = {n: median(ts) for n, ts in step_times.items()}
    tokens = cfg.trainer.global_batch_size * s
    base = {"megatronish tp=2": "DTensor tp=2", "megatronish tp=2 sp": "DTensor tp=2 sp"}
    rows = []
    for n in VARIANTS:
        peer = base.get(n)
        ratio = f"{med[n] / med[peer]:.2f}x" if peer else ""
        paired = f"{paired_ratio(step_times[n], step_times[peer]):.2f}x" if peer else ""
        rows.append([n, f"{med[n] * 1000:.0f}", f"{tokens / med[n]:,.0f}", ratio, paired])
    losses = ranks[0]["losses"]
    loss_rows = [
        [n, f"{losses[n][0]:.5f}", len(losses[n]), f"{losses[n][-1]:.5f}"] for n in VARIANTS
    ]

    mem_rows, mem_raw = [], {}
    for label, t, sp, per_block in (
        ("tp=1", 1, False, tp1_memory),
        ("tp=2", TP, False, ranks[0]["memory"][VARIANTS[0]]),
        ("tp=2 sp", TP, True, ranks[0]["memory"][VARIANTS[1]]),
    ):
        layers = [v for k, v in per_block.items() if k != "outside blocks"]
        per_layer = median(layers)
        total = sum(per_block.values())
        lit = korthikanti_16bit(s, b, h, a, t, sp)
        fp32 = korthikanti_fp32_no_dropout(s, b, h, a, t, sp)
        flash = korthikanti_fp32_no_dropout(s, b, h, a, t, sp, attention_matrix=False)
        mem_raw[label] = {
            "per_block_bytes": per_block, "per_layer_bytes": per_layer, "total_bytes": total,
            "korthikanti_16bit": lit, "fp32_no_dropout": fp32, "fp32_no_dropout_no_attn": flash,
        }  # fmt: skip
        mib = 2**20
        mem_rows.append([
            label, f"{per_layer / mib:.2f}", f"{flash / mib:.2f}", f"{fp32 / mib:.2f}",
            f"{lit / mib:.2f}", f"{per_layer / (s * b * h):.1f}",
            f"{(total - per_layer * num_layers) / mib:.2f}", f"{total / mib:.2f}",
        ])  # fmt: skip

    method = (
        f"One forked 2-rank gloo world, one thread per rank. Each variant trains the tiny llama "
        f"(4 layers, hidden {h}, {a} heads, 2 kv heads, ffn 352, vocab 4096, seq {s}, micro "
        f"batch {b} = global batch, fp32) from the same global weights on the same batches with "
        f"the same AdamW (clip 1.0, constant lr; torch's fused AdamW for DTensor). DTensor "
        f"variants shard the plain reference GPT with fused q|k|v and gate|up (rows grouped per "
        f"rank, as megatronish's are) with `parallelize_module`: Colwise wqkv/w13, Rowwise "
        f"o/w2, Rowwise (vocab-split) embedding, Colwise head with `loss_parallel`, and with sp "
        f"`SequenceParallel` norms plus `PrepareModuleInput` all-gathers (the torchtitan plan); "
        f"their global grad norm is computed over the local shards with one all-reduce (torch's "
        f"`clip_grad_norm_` rejects the mix of DTensor and plain norm weights without sp). "
        f"{done} interleaved repeats (up to {repeats}; no new repeat after {budget:.0f} s) of "
        f"{steps} steps after 2 warm-up steps, barrier before "
        f"each timing; a repeat's time is the slower rank's; medians."
    )
    mem_method = (
        f"Activation memory: bytes of the tensors autograd saves for backward during one "
        f"microbatch forward on rank 0 (`saved_tensors_hooks`, each storage counted once, "
        f"parameters and RoPE tables excluded), attributed to the block that saved them; "
        f"'per layer' is the median over the {num_layers} blocks, 'outside layers' is the "
        f"embedding, final norm, head and the loss's saved softmax. s={s}, b={b}, h={h}, a={a}. "
        + ADAPTATION
    )
    return {
        "name": NAME,
        "title": TITLE,
        "method": method,
        "quick": quick,
        "tables": [
            table(
                "Step time (median over repeats)",
                [
                    "variant",
                    "step ms",
                    "tokens/s",
                    "step time / DTensor's (same sp)",
                    "same, median of per-repeat ratios",
                ],
                rows,
            ),
            table(
                "Sanity: losses (rank 0) match the one-process run",
                ["variant", "first loss", "steps", "last loss"],
                loss_rows,
            ),
            table(
                "Activation memory per rank, megatronish (MiB)",
                [
                    "layout",
                    "measured per layer",
                    "formula fp32, no dropout, no s^2 term",
                    "formula fp32, no dropout",
                    "formula as published (16-bit, dropout)",
                    "measured per layer / sbh (bytes)",
                    "outside layers",
                    "total",
                ],
                mem_rows,
            ),
        ],
        "notes": [mem_method, WHY_MORE, f"ln(vocab) = {math.log(4096):.4f}."],
        "raw": {
            "step_times_s": step_times,
            "paired_ratios": {
                n: paired_ratio(step_times[n], step_times[p]) for n, p in base.items()
            },
            "median_step_s": med,
            "losses": losses,
            "memory": mem_raw,
            "tokens_per_step": tokens,
            "per_rank_times": [r["times"] for r in ranks],
        },
        "seconds": time.perf_counter() - t0,
        "machine": machine_info(),
    }


def main() -> None:
    bench_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
