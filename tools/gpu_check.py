"""``make gpu-check``: does megatronish train fast and correctly on this GPU? (one GPU, ~10 min)

Sections (``tools/gpu_check/``), each independent of the others' failures:

1. throughput: the largest gpt_1b-shaped model that fits the device side by side with a
   plain-PyTorch reference of the same shape (the planner decides the layers), bf16, tp = pp = 1,
   timed interleaved; tokens/s and MFU of both (peak from the device table);
2. flash: the model's attention runs SDPA's flash kernel (profiler trace, forced backend);
3. memory: ``torch.cuda.max_memory_allocated`` against the planner's peak for that model;
4. resume: a checkpoint of device tensors resumes bit-exactly in a fresh trainer;
5. recompute: step time and peak memory of each recompute policy;
6. syncs: host-device syncs per training step (CUDA's sync debug mode and the CPU harness);
7. moe_experts: one MoE layer's forward + backward at 8 and 64 local experts (time, memory);
8. async_save: how long a blocking and an asynchronous checkpoint save hold the training thread;
9. documents: attention within packed documents, and a training step with document masks;
10. ring_kernels: ring attention's block kernels (forward with log-sum-exp, backward with the
    merged rows) against fp32 matmuls.
11. compiled: eager, compiled and compiled fp8 megatronish beside the reference eager and
    compiled (a four-layer model of section 1's shape): tokens/s, MFU and the last loss.

It writes ``docs/gpu.md`` (or ``--out``) after every section (a run stopped by SIGTERM or at a
time limit leaves what it measured) and exits 1 when a section failed, was skipped for lack of
time (``gpu_check/run.py``: each section's fixed seconds, its compiles included) or was not
reached. ``--sections a,b`` runs only those (numbered as in the full run). ``--smoke`` runs
the same sections at toy size on the CPU in fp32 within a minute or two and writes to ``--out``
(default: a temporary directory), never to docs/gpu.md. Data is synthetic; nothing is
downloaded.

Usage: ``python tools/gpu_check.py [--smoke] [--out PATH] [--budget-s S] [--peak-tflops T]
[--device-memory-gb G] [--device cuda|cpu] [--sections NAME,...]``. On a GPU machine without
.venv, Hydra or network, ``PYTHON=python3 make gpu-check`` runs it there from the wheelhouse of
``make gpu-wheels`` (``scripts/gpu_env.sh``, ``tools/gpu_check/wheelhouse.py``).

Examples:
    make gpu-check                                  # on the GPU machine: writes docs/gpu.md
    python tools/gpu_check.py --smoke               # every section at toy size on the CPU
    make gpu-check ARGS="--sections documents,compiled --out $OUT/gpu.md"  # the compiles
"""

import os

# Before CUDA starts: cuBLAS reproducible for the resume section's deterministic mode, and
# expandable segments so that one section's freed blocks serve the next.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from gpu_check.context import CheckContext  # noqa: E402
from gpu_check.report import environment, render, write_report  # noqa: E402
from gpu_check.run import number, run_all, select, stop_on_sigterm  # noqa: E402

from megatronish.distributed.launch import pick_device  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# GPU: the GPU machine gives a run about 10 minutes, start-up (wheelhouse, imports, CUDA) included.
DEFAULT_BUDGET_S = {False: 540.0, True: 90.0}  # GPU, smoke


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, fp32")
    ap.add_argument("--out", type=Path, help="report path (default docs/gpu.md; smoke: a temp dir)")
    ap.add_argument("--budget-s", type=float, help="time budget of the whole run in seconds")
    ap.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: the table)")
    ap.add_argument("--device-memory-gb", type=float, help="size the model for this memory (GiB)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda, cpu with --smoke")
    ap.add_argument(
        "--sections",
        type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
        help="comma-separated section names to run (default: all), e.g. documents,compiled",
    )
    return ap.parse_args(argv)


def report_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if args.smoke:
        return Path(tempfile.mkdtemp(prefix="gpu_check_")) / "gpu.md"
    return ROOT / "docs" / "gpu.md"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sections = select(args.sections)
    except ValueError as e:
        print(f"--sections: {e}", file=sys.stderr)
        return 2
    try:
        device = pick_device(args.device or ("cpu" if args.smoke else "cuda"), 0)
    except ValueError:
        print(
            "no CUDA device here: run on a GPU machine, or `--smoke` for the CPU dry run",
            file=sys.stderr,
        )
        return 2
    budget = args.budget_s or DEFAULT_BUDGET_S[args.smoke]
    ctx = CheckContext(device, args.smoke, budget, args.peak_tflops, args.device_memory_gb)
    chosen = f", sections {','.join(m.NAME for m in sections)}" if args.sections else ""
    print(
        f"gpu check on {device} ({ctx.precision}), budget {budget:.0f} s{chosen}"
        + (", smoke run at toy size" if args.smoke else ""),
        flush=True,
    )
    path, facts = report_path(args), environment(device, ROOT)

    def write(results, final: bool = False) -> str:
        failed = [r.name for r in results if not r.passed]
        done = f"{len(results) - len(failed)} of {len(results)} sections passed"
        if not final:
            done = f"{done} so far ({len(sections) - len(results)} still to run)"
        summary = (
            f"{done} in {ctx.elapsed():.0f} s (budget {budget:.0f} s), {ctx.precision}{chosen}"
        )
        pending = [(number(m, i + 1), m.TITLE) for i, m in enumerate(sections)][len(results) :]
        write_report(path, render(results, facts, summary, args.smoke, pending))
        return summary

    undo = stop_on_sigterm()
    try:
        results = run_all(ctx, sections, after=write)
        summary = write(results, final=True)
    finally:
        undo()
    failed = [r.name for r in results if not r.passed] + [m.NAME for m in sections[len(results) :]]
    print(f"\n{summary}" + (f"; not passed: {', '.join(failed)}" if failed else ""), flush=True)
    print(f"wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
