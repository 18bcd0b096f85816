"""The notes under the ZeRO benchmark's tables (``bench_zero.py``): method details and findings.

Numbers in the notes come from the run; the explanations follow megatronish/optim's design
(zero.py, param_gather.py, grad_reduce.py) and the planner that mirrors it.
"""

from __future__ import annotations

MIB = 2**20


STAGES = ("zero 0", "zero 1", "zero 2", "zero 3")


def _peak(variants: dict, variant: str) -> float:
    """Peak RSS in the steps above start, MiB (the larger rank)."""
    return max(r["rss_peak"] - r["rss_start"] for r in variants[variant]) / MIB


def _built(variants: dict, variant: str) -> float:
    return max(r["rss_built"] - r["rss_start"] for r in variants[variant]) / MIB


def _planned(m: dict, variant: str) -> float:
    """The planner's peak plus the runtime's own bytes, MiB."""
    return (m["variants"][variant][0]["plan"]["peak"] + m["runtime"]) / MIB


def _ratio(m: dict, variant: str) -> float:
    """Measured peak above start / (the planner's peak + runtime)."""
    return _peak(m["variants"], variant) / _planned(m, variant)


def _psi(m: dict) -> float:
    return m["variants"]["zero 0"][0]["psi"] / 1e6


def memory_method(mem: dict) -> str:
    """``mem``: ``bench_zero.memory``'s result (model name -> overrides, label, variants)."""
    models = "; ".join(
        f"{name}: {m['label']} (Ψ = {_psi(m):.2f} M parameters; its six variants took "
        f"{m['seconds']:.0f} s)"
        for name, m in mem.items()
    )
    first = next(iter(mem.values()))
    start = first["variants"]["zero 0"][0]["rss_start"] / MIB
    return (
        f"Memory models, one microbatch of 1 per rank so that parameter state outweighs "
        f"activations: {models}. Each of megatronish zero 0-3, DDP and FSDP2 trains "
        f"{first['steps']} steps in a fresh forked 2-rank gloo world. 'State' columns are "
        f"`trainer.zero.state_bytes()` + `trainer.optimizer.state_bytes()` at a step boundary; "
        f"the formulas are ZeRO's for fp32 training (4 bytes params + 4 grads + 8 Adam per "
        f"parameter; no separate master copy). RSS: glibc's mmap threshold pinned to 256 KiB "
        f"(`mallopt`) so freed tensors leave the RSS, VmHWM reset (`/proc/self/clear_refs`) "
        f"after building and trimming; 'above start' subtracts the rank's RSS right after the "
        f"fork (Python + torch + the parent's pages, about {start:.0f} MiB); both RSS columns "
        f"are the larger rank's. 'Planned peak' is the planner's tensor bytes at the step's "
        f"high-water mark for the config the variant trained "
        f"(`make_plan(spec_of(cfg), layout_from_config(cfg, 2)).stages[0].peak`: the states "
        f"plus the larger of the activation peak with ZeRO 3's gathered blocks, and ZeRO 2/3's "
        f"full grads at their most in a backward beside the activations it still holds; or the "
        f"states plus the optimizer's workspace) plus the training loop's own memory beside "
        f"its tensors (BLAS and OpenMP workspaces, malloc arenas, gloo), "
        f"{first['runtime'] / MIB:.0f} MiB, measured the same way on a model too small for its "
        f"tensors to matter (hidden 64, 2 layers: the RSS its zero 0 steps add beyond their "
        f"planned tensors); 'measured / planned' divides the peak RSS in steps above start by "
        f"that sum. The raw results also hold the planned states, gathered params, in-flight "
        f"grads and activation peak."
    )


def _stage_peaks(variants: dict) -> str:
    return ", ".join(f"{_peak(variants, v):.0f}" for v in STAGES)


def _decreasing(variants: dict) -> bool:
    peaks = [_peak(variants, v) for v in STAGES]
    return all(a > b for a, b in zip(peaks, peaks[1:], strict=False))


def memory_findings(mem: dict) -> list[str]:
    """``mem``: ``bench_zero.memory``'s result (model name -> overrides, label, variants)."""
    per_model = []
    for name, m in mem.items():
        v = m["variants"]
        order = "strictly decreasing" if _decreasing(v) else "NOT strictly decreasing"
        per_model.append(
            f"{name} model (Ψ = {_psi(m):.1f} M): zero 0 > 1 > 2 > 3 = "
            f"{_stage_peaks(v)} MiB ({order}), zero 3 "
            f"{_peak(v, 'zero 3'):.0f} vs FSDP2 {_peak(v, 'FSDP2'):.0f} MiB "
            f"({_peak(v, 'zero 3') / _peak(v, 'FSDP2'):.2f}x), zero 0 {_peak(v, 'zero 0'):.0f} "
            f"vs DDP {_peak(v, 'DDP'):.0f} MiB"
        )
    ratios = [_ratio(m, s) for m in mem.values() for s in STAGES]
    over = {  # measured - planned peak - runtime, MiB, per model
        name: [_peak(m["variants"], s) - _planned(m, s) for s in STAGES] for name, m in mem.items()
    }
    excess = [f"{min(d):.0f}-{max(d):.0f} MiB ({name})" for name, d in over.items()]
    by_size = sorted(mem, key=lambda k: _psi(mem[k]))
    plan3 = mem[by_size[-1]]["variants"]["zero 3"][0]["plan"]
    first_name = next(iter(mem))
    first = mem[first_name]["variants"]
    masks = max(r["masks"] for m in mem.values() for s in STAGES for r in m["variants"][s])
    return [
        f"Peak RSS in steps above start, per rank: {'; '.join(per_model)}.",
        f"Measured / (planned + runtime) is {min(ratios):.2f}-{max(ratios):.2f} over the four "
        f"stages of both models (measured minus that: {'; '.join(excess)}).",
        f"What a zero 3 step holds on top of its shards ({by_size[-1]} model, planned): "
        f"{plan3['params_step'] / MIB:.0f} MiB of gathered params, about two blocks (the one "
        f"computing and the next one prefetched; in backward each bucket of the computing block "
        f"is freed as soon as its grads are in, which the planner does not count), "
        f"{plan3['grads_step'] / MIB:.0f} MiB of full "
        f"grads (the bucket being filled and the one whose reduce-scatter is in flight; "
        f"buckets align to blocks and are freed after their reduction every microbatch) and "
        f"{plan3['activations_peak'] / MIB:.0f} MiB of activations; on gloo the flat "
        f"all-gathers and reduce-scatters run as per-rank broadcasts and reduces in place, "
        f"with no temporary copies.",
        f"Weight decay and the grad norm select parameters by (start, end) ranges of the flat "
        f"buffers, not per-element masks: at most {masks / MIB:.3f} MiB per rank, left out of "
        f"the table. RSS after build ({first_name} model: zero 0 {_built(first, 'zero 0'):.0f} MiB "
        f"vs DDP {_built(first, 'DDP'):.0f}) also reflects that megatronish allocates grads "
        f"and Adam state up front while torch.optim.AdamW creates its state at the first step.",
    ]


def scaling_finding(scaling: dict, z0: str, single: str) -> str:
    s, one = scaling[z0], scaling[single]["main_thread"]
    t = s["main_thread"]
    wait2 = t["cpu_wait"] / (t["on_cpu"] + t["cpu_wait"] + t["blocked"])
    wait1 = one["cpu_wait"] / (one["on_cpu"] + one["cpu_wait"] + one["blocked"])
    return (
        f"Wall-clock scaling on this shared 2-core machine measures the machine as much as the "
        f"code: the ranks' main threads spent {wait2:.0%} of a 2-rank step (megatronish zero "
        f"0) and {wait1:.0%} of a 1-rank step runnable but waiting for a CPU. Linux autogroup "
        f"scheduling shares the cores between sessions, not processes, so while other "
        f"sessions are busy a 2-rank world gets little more CPU than a 1-rank one. The "
        f"CPU-time efficiency ({s['cpu']:.0%} for megatronish zero 0) is what data "
        f"parallelism itself costs (communication work, the replicated optimizer step); on an "
        f"idle machine the wall-clock efficiency would be about that, less the time ranks sit "
        f"blocked in collectives (the last number of the last column)."
    )


def _quartiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 4], xs[(3 * len(xs)) // 4]


def timing_finding(
    times: dict[str, list[float]], cpu_ratios: dict[str, float], peers: dict[str, str]
) -> str:
    parts = []
    for m, p in peers.items():
        lo, hi = _quartiles([a / b for a, b in zip(times[m], times[p], strict=True)])
        parts.append(f"{m} / {p} {lo:.2f}x-{hi:.2f}x (CPU time {cpu_ratios[m]:.2f}x)")
    return (
        f"Middle half of the per-repeat step-time ratios: {'; '.join(parts)}. On this shared "
        f"machine wall-clock differences of several percent are within noise; CPU time, which "
        f"waiting for a core does not inflate, is the steadier comparison. Where megatronish "
        f"saves time against the reference GPT (torch.profiler, one process): its output "
        f"head and loss run over chunks of tokens and compute the head's grads during "
        f"forward (`model/linear_cross_entropy.py`), so no [tokens, vocab] tensor (32 MiB per "
        f"microbatch here) is allocated, where the reference allocates four (the logits, "
        f"log_softmax's output and two in F.cross_entropy's backward), whose fresh pages cost "
        f"about as much as the arithmetic on this machine; its "
        f"optimizer update is torch's fused AdamW kernel (below). Matmuls and attention run "
        f"the same kernels in both. FSDP2 pays for DTensor dispatch in Python (about 8x the Python "
        f"calls per step) and a per-parameter AdamW over DTensors. Like DDP's, megatronish's "
        f"first bucket is small (1 MB, `optim/buckets.FIRST_BUCKET_BYTES`: here the output "
        f"head alone), so its reduction starts while the rest of backward runs."
    )


def optimizer_finding(optim: dict[str, float], step_cpu_ms: float) -> str:
    """``step_cpu_ms``: a 2-rank megatronish zero 0 step's main-thread CPU per rank."""
    mish = optim["megatronish ShardedAdamW.step"]
    loop = optim["torch.optim.AdamW.step (per-parameter loop)"]
    fused = optim["torch._fused_adamw_, one call over the whole shards"]
    norm = optim["megatronish ZeroDataParallel.grad_norm"]
    clip = optim["torch clip_grad_norm_"]
    saved = loop + clip - mish - norm
    return (
        f"Optimizer side (one thread, the tiny model's real buffers): `ShardedAdamW.step` "
        f"(`optim/sharded_adamw.py`: torch's fused AdamW kernel on the decayed and undecayed "
        f"runs of each flat shard, the clipping factor applied inside the kernel) takes "
        f"{mish:.1f} ms per step against {loop:.1f} ms for torch's per-parameter AdamW and "
        f"{fused:.1f} ms for one fused call over the whole shards (the one-pass bound); the "
        f"grad norm over ranges takes {norm:.1f} ms vs {clip:.1f} for `clip_grad_norm_`. "
        f"Together megatronish spends {saved:.1f} ms per step less than torch here "
        f"({saved / step_cpu_ms:.1%} of a 2-rank step's main-thread CPU)."
    )
