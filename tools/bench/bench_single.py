"""Single-process training throughput: megatronish's Trainer vs a plain-PyTorch GPT.

Both train the ``tiny`` model (configs/model/tiny.yaml, vocab 4096, seq 256, one microbatch
of 8) from the same initial weights on the same synthetic batches with the same AdamW, grad
clipping and constant learning rate, so they do the same work and report the same losses. The
steps are timed interleaved in one process at 2 and 1 intra-op threads.

Run alone: ``.venv/bin/python tools/bench/bench_single.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import time

from common import interleaved, machine_info, median, paired_ratio, threads
from mish import build_run, full_weights
from reference_gpt import RefConfig, ReferenceGPT
from reference_run import make_reference_run
from sections import table, write_section
from weight_map import load_megatronish_weights

from megatronish.metrics import flops_per_token, measure_matmul_peak

NAME = "single"
TITLE = "Single-process training throughput (tiny llama)"


def measure(num_threads: int, repeats: int, steps: int) -> dict:
    """Interleaved step times, losses and the matmul peak at ``num_threads`` threads."""
    with threads(num_threads):
        mish = build_run()
        ref = ReferenceGPT(RefConfig.from_spec(mish.spec, fused=True))
        load_megatronish_weights(ref, full_weights())
        reference = make_reference_run(ref, mish.cfg, mish.data)
        losses: dict[str, list[float]] = {"megatronish": [], "reference": []}
        runs = {
            "megatronish": lambda: losses["megatronish"].append(mish.step()),
            "reference": lambda: losses["reference"].append(reference.step()),
        }
        peak_before = measure_matmul_peak()
        times = interleaved(runs, repeats=repeats, steps_per_repeat=steps)
        peak = max(peak_before, measure_matmul_peak())
    spec = mish.spec
    tokens = mish.cfg.trainer.global_batch_size * spec.seq_length
    flops = flops_per_token(spec) * tokens
    out = {"threads": num_threads, "peak_flops": peak, "tokens_per_step": tokens}
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
    out["ln_vocab"] = math.log(spec.vocab_size)
    return out


def run(quick: bool = False) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    repeats, steps = (3, 2) if quick else (9, 3)
    results = [measure(2, repeats, steps), measure(1, repeats, steps)]
    rows = []
    for r in results:
        m, ref = r["megatronish"], r["reference"]
        rows.append([
            r["threads"], f"{m['tokens_per_s']:,.0f}", f"{ref['tokens_per_s']:,.0f}",
            f"{r['ratio']:.2f}x", f"{r['paired_ratio']:.2f}x",
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
        f"plain-PyTorch llama of the same shape (`tools/bench/reference_gpt.py`: nn.RMSNorm, "
        f"fused q|k|v and gate|up, RoPE, SDPA with GQA, `[b, s, h]`, untied head, "
        f"torch.optim.AdamW with the same groups, clip 1.0, fp32), loaded with megatronish's "
        f"initial weights, in one process; {repeats} interleaved repeats of "
        f"{steps} steps each after 2 warm-up steps, at 2 and at 1 intra-op threads. "
        f"Model: tiny llama (4 layers, hidden 128, 4 heads, 2 kv heads, ffn 352, vocab 4096, "
        f"seq 256), batch 8 ({first['tokens_per_step']} tokens per step). MFU counts "
        f"6N + 12Lsh model FLOPs per token (`megatronish.metrics.flops_per_token`, "
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
        "notes": [],
        "raw": {"runs": results},
        "seconds": time.perf_counter() - t0,
        "machine": machine_info(),
    }


def main() -> None:
    from report import render_section

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    section = run(args.quick)
    print(render_section(section))
    print(f"wrote {write_section(section)}")


if __name__ == "__main__":
    main()
