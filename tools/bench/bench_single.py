"""Single-process training throughput: megatronish's Trainer vs a plain-PyTorch GPT.

Both train the ``tiny`` model (configs/model/tiny.yaml, vocab 4096, seq 256, one microbatch
of 8) from the same initial weights on the same synthetic batches with the same AdamW, grad
clipping and constant learning rate, so they do the same work and report the same losses. The
steps are timed interleaved in one process at 2 and 1 intra-op threads.

Run alone: ``.venv/bin/python tools/bench/bench_single.py [--quick]``.
"""

from __future__ import annotations

import math
import os
import time

from common import interleaved, machine_info, median, paired_ratio, threads
from mish import build_run, full_weights
from reference_run import make_reference_run
from sections import bench_cli, table

from megatronish.model.flops import flops_per_token
from megatronish.testing.reference_gpt import RefConfig, ReferenceGPT, load_megatronish_weights
from megatronish.training.peaks import measure_matmul_peak

NAME = "single"
WARMUP = 2
TITLE = "Single-process training throughput (tiny llama)"


def measure(num_threads: int, repeats: int, steps: int, budget_s: float | None = None) -> dict:
    """Interleaved step times, losses and the matmul peak at ``num_threads`` threads."""
    with threads(num_threads):
        mish = build_run()
        ref = ReferenceGPT(RefConfig.from_spec(mish.spec, fused=True))
        load_megatronish_weights(ref, full_weights())
        reference = make_reference_run(ref, mish.cfg, mish.data)
        losses: dict[str, list[float]] = {"megatronish": [], "reference": []}
        cpu: dict[str, list[float]] = {"megatronish": [], "reference": []}

        def run(name, step):
            def one():
                t0 = time.process_time()
                losses[name].append(step())
                cpu[name].append(time.process_time() - t0)

            return one

        runs = {
            "megatronish": run("megatronish", mish.step),
            "reference": run("reference", reference.step),
        }
        peak_before = measure_matmul_peak()
        times = interleaved(runs, repeats, steps, warmup=WARMUP, budget_s=budget_s)
        peak = max(peak_before, measure_matmul_peak())
        cpu = {name: per_repeat(ts[WARMUP:], steps) for name, ts in cpu.items()}
    spec = mish.spec
    tokens = mish.cfg.trainer.global_batch_size * spec.seq_length
    flops = flops_per_token(spec) * tokens
    out = {"threads": num_threads, "peak_flops": peak, "tokens_per_step": tokens}
    out["repeats"] = len(times["megatronish"])
    out["flops_per_step"] = flops
    for name, ts in times.items():
        step = median(ts)
        out[name] = {
            "step_times_s": ts,
            "median_step_s": step,
            "tokens_per_s": tokens / step,
            "mfu": flops / step / peak,
            "first_loss": losses[name][0],
            "last_loss": losses[name][-1],
            "steps": len(losses[name]),
        }
    out["ratio"] = out["megatronish"]["tokens_per_s"] / out["reference"]["tokens_per_s"]
    out["paired_ratio"] = paired_ratio(times["reference"], times["megatronish"])
    out["cpu_ratio"] = paired_ratio(cpu["reference"], cpu["megatronish"])
    out["cpu_s"] = cpu
    out["fastest_ratio"] = min(times["reference"]) / min(times["megatronish"])
    out["ln_vocab"] = math.log(spec.vocab_size)
    return out


def per_repeat(step_times: list[float], steps: int) -> list[float]:
    """Per-step means of consecutive groups of ``steps`` (one per repeat)."""
    return [sum(step_times[i : i + steps]) / steps for i in range(0, len(step_times), steps)]


def load_notes(load_before: float) -> list[str]:
    """A warning when other work shared the cores during the measurement."""
    load = max(load_before, os.getloadavg()[0])
    cores = os.cpu_count() or 1
    if load <= cores:
        return []
    return [
        f"Other processes shared the {cores} cores during this run (1-minute load average up "
        f"to {load:.1f}): two-thread steps suffer most (a parallel region waits for its slower "
        f"thread), so the 2-thread row is the least reliable; compare the ratio columns, which "
        f"pair back-to-back repeats, rather than the absolute rates."
    ]


def run(quick: bool = False) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    # Many short repeats: the per-repeat ratios of back-to-back steps are what cancels the
    # machine's load swings (often +-15% from one step to the next here).
    repeats, steps, budget = (3, 1, 20.0) if quick else (31, 1, 60.0)
    results = [measure(n, repeats, steps, budget) for n in (2, 1)]
    rows = []
    for r in results:
        m, ref = r["megatronish"], r["reference"]
        rows.append([
            r["threads"], f"{m['tokens_per_s']:,.0f}", f"{ref['tokens_per_s']:,.0f}",
            f"{r['ratio']:.2f}x", f"{r['paired_ratio']:.2f}x", f"{r['fastest_ratio']:.2f}x",
            f"{r['cpu_ratio']:.2f}x",
            f"{m['mfu']:.1%}", f"{ref['mfu']:.1%}", f"{r['peak_flops'] / 1e9:.0f}",
        ])  # fmt: skip
    loss_rows = [
        [r["threads"], f"{r['ln_vocab']:.4f}"]
        + [f"{r[k]['first_loss']:.4f}" for k in ("megatronish", "reference")]
        + [r["megatronish"]["steps"]]
        + [f"{r[k]['last_loss']:.4f}" for k in ("megatronish", "reference")]
        for r in results
    ]
    first = results[0]
    method = (
        f"Median seconds per optimizer step of megatronish's `Trainer.train_step` and of a "
        f"plain-PyTorch llama of the same shape (`megatronish/testing/reference_gpt.py`: "
        f"nn.RMSNorm, fused q|k|v and gate|up, RoPE, SDPA with GQA, `[b, s, h]`, untied head, "
        f"torch.optim.AdamW (fused) with the same groups, clip 1.0, fp32), loaded with "
        f"megatronish's "
        f"initial weights, in one process; {results[0]['repeats']} (2 threads) and "
        f"{results[1]['repeats']} (1 thread) interleaved repeats "
        f"(up to {repeats}; no new repeat after {budget:.0f} s) of "
        f"{steps} step(s) each after {WARMUP} warm-up steps, at 2 and at 1 intra-op threads; "
        f"ratios are reference time / megatronish time (above 1: megatronish is faster), the "
        f"CPU-time one from the process's CPU seconds per step, which waiting for a core does "
        f"not inflate. "
        f"Model: tiny llama (4 layers, hidden 128, 4 heads, 2 kv heads, ffn 352, vocab 4096, "
        f"seq 256), batch 8 ({first['tokens_per_step']} tokens per step). MFU counts "
        f"6N + 12Lsh model FLOPs per token (`megatronish.model.flops.flops_per_token`, "
        f"{first['flops_per_step'] / first['tokens_per_step'] / 1e6:.2f} MFLOP) against the "
        f"best fp32 1024^3 matmul rate measured in the same run at the same thread count."
    )
    return {
        "name": NAME,
        "title": TITLE,
        "method": method,
        "quick": quick,
        "tables": [
            table(
                "Throughput",
                [
                    "threads",
                    "megatronish tokens/s",
                    "reference tokens/s",
                    "megatronish / reference",
                    "same, median of per-repeat ratios",
                    "same, fastest repeats",
                    "CPU time, median of per-repeat ratios",
                    "megatronish MFU",
                    "reference MFU",
                    "matmul peak GFLOP/s",
                ],
                rows,
            ),
            table(
                "Sanity: same weights and batches give the same losses",
                [
                    "threads",
                    "ln(vocab)",
                    "megatronish first loss",
                    "reference first loss",
                    "steps",
                    "megatronish last loss",
                    "reference last loss",
                ],
                loss_rows,
            ),
        ],
        "notes": load_notes(load_before),
        "raw": {"runs": results},
        "seconds": time.perf_counter() - t0,
        "machine": machine_info(),
    }


def main() -> None:
    bench_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
