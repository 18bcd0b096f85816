"""Tensor parallelism on 2 ranks: megatronish (tp=2, with and without sp) vs the reference GPT
under torch DTensor tensor parallelism, and megatronish's activation memory per rank.
Run alone: ``.venv/bin/python tools/bench/tp.py [--quick]``.
"""

from __future__ import annotations

import math

import common
import torch
import torch.distributed as dist
from common import MIB, build_run, cli, korthikanti, median, paired_ratio, slowest, table
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import parallel as tpar

from megatronish.testing.multiproc import run_world

TP = 2
VARIANTS = ("megatronish tp=2", "megatronish tp=2 sp", "DTensor tp=2", "DTensor tp=2 sp")
PEER = {VARIANTS[0]: VARIANTS[2], VARIANTS[1]: VARIANTS[3]}


def parallelize(model: nn.Module, sp: bool) -> nn.Module:
    """Shard the fused reference GPT (rows grouped per rank) over the world, in place: the
    torchtitan plan, with ``SequenceParallel`` norms when ``sp``."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seq = Shard(1) if sp else Replicate()
    tpar.parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": tpar.RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            **({"norm": tpar.SequenceParallel()} if sp else {}),
            "output": tpar.ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for block in model.layers:
        plan = {
            "attention.wqkv": tpar.ColwiseParallel(),
            "feed_forward.w13": tpar.ColwiseParallel(),
            "attention.wo": tpar.RowwiseParallel(output_layouts=seq),
            "feed_forward.w2": tpar.RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update(
                {
                    "attention_norm": tpar.SequenceParallel(),
                    "ffn_norm": tpar.SequenceParallel(),
                    "attention": tpar.PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                    ),
                    "feed_forward": tpar.PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        tpar.parallelize_module(block, mesh, plan)
        block.attention.n_heads //= mesh.size()
        block.attention.n_kv_heads //= mesh.size()
    return model


def grad_norm_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global grad norm of a mix of DTensor and plain parameters (``clip_grad_norm_``
    rejects the mix): sharded grads summed over the mesh, replicated ones counted once."""
    sharded, local, group = torch.zeros(()), torch.zeros(()), None
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            sq = g.to_local().float().pow(2).sum()
            if any(pl.is_shard() for pl in g.placements):
                sharded += sq
                group = g.device_mesh.get_group()
            else:
                local += sq
        else:
            local += g.float().pow(2).sum()
    if group is not None:
        dist.all_reduce(sharded, group=group)
    norm = (sharded + local).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
    return norm


def activation_bytes(run) -> dict[str, int]:
    """Bytes autograd saves for backward per block (and outside blocks) in one microbatch
    forward, each storage counted once, parameters and RoPE tables excluded."""
    (chunk,) = run.chunks
    inputs, targets = common.batch(run.data, 0, run.cfg.trainer.micro_batch_size)
    chunk(inputs, targets).backward()  # builds the cached rope tables
    exclude = [*chunk.parameters(), *(getattr(chunk, "_rope", None) or ())]
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    by_region: dict[str, int] = {}
    region = ["outside blocks"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if (ptr := storage.data_ptr()) and ptr not in seen:
            seen.add(ptr)
            by_region[region[0]] = by_region.get(region[0], 0) + storage.nbytes()
        return t

    def enter(name: str):
        return lambda *_: region.__setitem__(0, name)

    blocks = chunk.layers.items()
    handles = [block.register_forward_pre_hook(enter(n)) for n, block in blocks]
    handles += [block.register_forward_hook(enter("outside blocks")) for _, block in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = chunk(inputs, targets)
    finally:
        for h in handles:
            h.remove()
    loss.backward()
    return by_region


def _rank(rank: int, world: int, repeats: int, steps: int, budget_s: float) -> dict:
    runs = {
        VARIANTS[0]: build_run(["parallel.tp=2"], rank, world),
        VARIANTS[1]: build_run(["parallel.tp=2", "parallel.sp=true"], rank, world),
    }
    mish = runs[VARIANTS[0]]
    steppers = {name: r.step for name, r in runs.items()}
    for name, sp in ((VARIANTS[2], False), (VARIANTS[3], True)):
        steppers[name] = common.reference_run(
            mish.cfg,
            mish.spec,
            mish.data,
            wrap=lambda model, sp=sp: parallelize(model, sp),
            tp_groups=TP,
            clip=grad_norm_clip,
            context=tpar.loss_parallel,
        ).step
    out = common.timed_world(steppers, repeats, steps, budget_s=budget_s)
    out["memory"] = {name: activation_bytes(runs[name]) for name in VARIANTS[:2]}
    dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return out


def run(quick: bool = False) -> dict:
    repeats, steps, budget = (3, 2, 30.0) if quick else (9, 2, 100.0)
    tp1 = build_run()
    tp1_memory = activation_bytes(tp1)
    ranks = run_world(_rank, TP, repeats, steps, budget, timeout=900, collective_timeout=300)
    cfg, m = tp1.cfg, tp1.cfg.model
    s, b, h, a = m.seq_length, cfg.trainer.micro_batch_size, m.hidden_size, m.num_attention_heads
    times = slowest(ranks)
    med = {n: median(ts) for n, ts in times.items()}
    paired = {n: paired_ratio(times[n], times[p]) for n, p in PEER.items()}
    tokens = cfg.trainer.global_batch_size * s
    memory = {}
    per_rank = ranks[0]["memory"]
    for label, t, sp, per_block in (
        ("tp=1", 1, False, tp1_memory),
        ("tp=2", TP, False, per_rank[VARIANTS[0]]),
        ("tp=2 sp", TP, True, per_rank[VARIANTS[1]]),
    ):
        per_layer = median([v for k, v in per_block.items() if k != "outside blocks"])
        memory[label] = {
            "per_block_bytes": per_block,
            "per_layer_bytes": per_layer,
            "total_bytes": sum(per_block.values()),
            "korthikanti": korthikanti(s, b, h, a, t, sp),
        }
    return {
        "title": "Tensor parallelism, 2 ranks: megatronish vs torch DTensor",
        "config": {
            "repeats": repeats,
            "steps_per_repeat": steps,
            "budget_s": budget,
            "warmup": 2,
            "s": s,
            "b": b,
            "h": h,
            "a": a,
            "layers": m.num_layers,
        },
        "results": {
            "step_times_s": times,
            "paired_ratios": paired,
            "median_step_s": med,
            "losses": ranks[0]["losses"],
            "memory": memory,
            "tokens_per_step": tokens,
            "per_rank_times": [r["times"] for r in ranks],
        },
        "tables": [
            table(
                "Step time (median over repeats)",
                [
                    "variant",
                    "step ms|.0f",
                    "tokens/s|,.0f",
                    "step time / DTensor's (same sp)|.2fx",
                    "same, median of per-repeat ratios|.2fx",
                ],
                [
                    [
                        n,
                        med[n] * 1e3,
                        tokens / med[n],
                        med[n] / med[PEER[n]] if n in PEER else None,
                        paired.get(n),
                    ]
                    for n in VARIANTS
                ],
            ),
            table(
                "Sanity: losses (rank 0) match the one-process run",
                ["variant", "first loss|.5f", "steps", "last loss|.5f"],
                [[n, ls[0], len(ls), ls[-1]] for n, ls in ranks[0]["losses"].items()],
            ),
            table(
                "Activation memory per rank, megatronish (MiB)",
                [
                    "layout",
                    "measured per layer|.2f",
                    "formula fp32, no dropout, no s^2 term|.2f",
                    "formula fp32, no dropout|.2f",
                    "formula as published (16-bit, dropout)|.2f",
                    "measured per layer / sbh (bytes)|.1f",
                    "outside layers|.2f",
                    "total|.2f",
                ],
                [
                    [
                        label,
                        r["per_layer_bytes"] / MIB,
                        r["korthikanti"]["fp32_no_attn"] / MIB,
                        r["korthikanti"]["fp32"] / MIB,
                        r["korthikanti"]["16bit"] / MIB,
                        r["per_layer_bytes"] / (s * b * h),
                        (r["total_bytes"] - r["per_layer_bytes"] * m.num_layers) / MIB,
                        r["total_bytes"] / MIB,
                    ]
                    for label, r in memory.items()
                ],
            ),
        ],
        "facts": {"repeats run": len(times[VARIANTS[0]]), "ln(vocab)|.4f": math.log(m.vocab_size)},
    }


if __name__ == "__main__":
    cli(run, __doc__)
