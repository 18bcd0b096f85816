"""The notes under the ZeRO benchmark's tables (``bench_zero.py``): method details and findings.

Numbers in the notes come from the run; the explanations were established by probing the same
code paths (RSS around each ZeRO call with exact-RSS malloc settings, thread-CPU cProfile of
each variant's steps) and hold as long as megatronish/optim/zero.py keeps its current design.
"""

from __future__ import annotations

MIB = 2**20


def _peak(mem: dict, variant: str) -> float:
    return max(r["rss_peak"] - r["rss_start"] for r in mem[variant]) / MIB


def _built(mem: dict, variant: str) -> float:
    return max(r["rss_built"] - r["rss_start"] for r in mem[variant]) / MIB


def memory_method(mem: dict) -> str:
    psi = mem["zero 0"][0]["psi"]
    return (
        f"Memory model: hidden 512, 8 heads, 4 kv heads, ffn 1408, 4 layers, vocab 4096, seq "
        f"64, micro batch 1 per rank (Ψ = {psi / 1e6:.2f} M parameters per rank), so that "
        f"parameter state outweighs activations. 'State' columns are "
        f"`trainer.zero.state_bytes()` + `trainer.optimizer.state_bytes()` at a step boundary; "
        f"the formulas are ZeRO's for fp32 training (4 bytes params + 4 grads + 8 Adam per "
        f"parameter; no separate master copy). 'Masks' are the bytes of ZeRO's weight-decay and "
        f"grad-norm selections (ranges of parameters), which state_bytes() leaves out. "
        f"Peak RSS: each variant in a fresh forked world; glibc's mmap threshold pinned to "
        f"256 KiB (`mallopt`) so freed "
        f"tensors leave the RSS, VmHWM reset (`/proc/self/clear_refs`) after building and "
        f"trimming, then 2 training steps; 'above start' subtracts the rank's RSS right after "
        f"the fork (Python + torch + the parent's pages, about "
        f"{mem['zero 0'][0]['rss_start'] / MIB:.0f} MiB)."
    )


def memory_findings(mem: dict) -> list[str]:
    psi4 = 4 * mem["zero 0"][0]["psi"] / MIB
    masks0 = mem["zero 0"][0]["masks"] / MIB
    return [
        f"State bytes match the ZeRO formulas exactly, but the peaks do not follow them: zero 3 "
        f"peaks at {_peak(mem, 'zero 3'):.0f} MiB above start (zero 1: "
        f"{_peak(mem, 'zero 1'):.0f}, zero 0: {_peak(mem, 'zero 0'):.0f}, FSDP2: "
        f"{_peak(mem, 'FSDP2'):.0f}). During a zero 3 step megatronish holds, on top of its "
        f"shards: the whole chunk's gathered params (`ZeroDataParallel.gather` materialises "
        f"every bucket of the chunk, and with pp = 1 the chunk is the whole model: 4Ψ = "
        f"{psi4:.0f} MiB) through forward and backward; a full-size grad buffer for every "
        f"bucket (`start_step` -> `_new_grad_buffer`, 4Ψ), freed only after all reductions; "
        f"and, on gloo, a full-size copy of each bucket that an in-flight "
        f"`reduce_scatter_tensor` keeps until `finish_reduction` waits (4Ψ; reproduced with bare "
        f"`reduce_scatter_tensor` calls). FSDP2 gathers one block at a time and reduces "
        f"per block. Fixes: gather/release per layer (module pre-forward / pre-backward hooks) "
        f"instead of per chunk; allocate a bucket's grad buffer at its first hook and free it "
        f"right after its own reduction (wait per bucket); on gloo, reduce with an in-place "
        f"all-reduce and keep the shard (no copy; and gloo's all-reduce is faster than its "
        f"reduce-scatter: 22 vs 36 ms per 16 MiB on 2 ranks in the platform measurements).",
        f"Zero 2 peaks above zero 1 ({_peak(mem, 'zero 2'):.0f} vs {_peak(mem, 'zero 1'):.0f} "
        f"MiB): its full grad buffers are re-allocated every step and live through backward, "
        f"next to the separate reduced shard, so stage 2 saves memory only between steps.",
        f"Weight decay and the grad norm select parameters by (start, end) ranges of the flat "
        f"buffers ({masks0:.3f} MiB at zero 0), not per-element masks. RSS after build "
        f"(zero 0 {_built(mem, 'zero 0'):.0f} MiB vs DDP {_built(mem, 'DDP'):.0f}) also "
        f"reflects that megatronish allocates grads and Adam state up front while "
        f"torch.optim.AdamW creates its state at the first step.",
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
