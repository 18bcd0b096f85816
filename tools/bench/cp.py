"""Context parallelism on CPU: activation memory per rank at cp = 1, 2, 4, with the K/V
all-gather, the heads' all-to-all, ring attention and (cp = 4) the all-to-all in pairs with a
ring across them, for a sequence whose activations do not fit one rank's budget; cp = 2 steps of
each exchange against dp = 2 on the same tokens, and cp = 4 steps of each exchange.
Run alone: ``.venv/bin/python tools/bench/cp.py``.
"""

from __future__ import annotations

import torch.distributed as dist
from common import MIB, cli, median, paired_ratio, slowest, table, timed_world

from megatronish.plan.estimate import make_plan
from megatronish.plan.fit_check import memory_fit_error
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.testing.memory import least_activations, measure_step
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer, test_config

SEQ = 8192
EXCHANGES = ("all_gather", "a2a", "ring", "a2a_ring")  # parallel.cp_comm_type
A2A_SIZE = 2  # parallel.cp_a2a_size of a2a_ring (cp = 4 only: it needs 1 < size < cp)
MODEL = [
    "model.num_layers=4",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=4",  # heads and kv heads divisible by cp = 4 (all-to-all)
    "model.ffn_hidden_size=352",
    "model.vocab_size=4096",
    f"model.seq_length={SEQ}",
    "trainer.micro_batch_size=1",
    "scheduler.style=constant",
    "scheduler.warmup_steps=0",
    "trainer.eval_interval=0",
    "trainer.device=cpu",
    "logging.wandb=false",
    "logging.log_interval=1000000",
]
BUDGET_MIB = 256  # a rank's memory budget for this run's states and activations


def exchange_args(cp: int, exchange: str) -> list[str]:
    """The overrides of ``exchange`` at ``cp``."""
    size = [f"parallel.cp_a2a_size={A2A_SIZE}"] if exchange == "a2a_ring" else []
    return [f"parallel.cp={cp}", f"parallel.cp_comm_type={exchange}", *size]


def _memory(rank: int, world: int, repeats: int, exchange: str) -> dict:
    layout = exchange_args(world, exchange)
    trainer = build_trainer(
        rank, world, ["trainer.global_batch_size=1", *layout], steps=repeats + 2, model=MODEL
    )
    first = trainer.train_step().loss
    runs = [measure_step(trainer) for _ in range(repeats)]
    states = runs[-1].params + runs[-1].grads + runs[-1].optimizer
    return {"activations": least_activations(runs), "states": states, "loss": first}


def memory(cp: int, repeats: int, exchange: str) -> dict:
    """Measured (the largest rank), planned, and what the start-up check says at the budget."""
    ranks = run_world(_memory, cp, repeats, exchange, timeout=600)
    layout = exchange_args(cp, exchange)
    cfg = test_config([*MODEL, "trainer.global_batch_size=1", *layout], 1)
    stage = make_plan(spec_of(cfg), layout_from_config(cfg, cp)).stages[0]
    refused = memory_fit_error(cfg, cp, 4096, BUDGET_MIB * MIB, 0, f"{BUDGET_MIB} MiB")
    loss = next(r["loss"] for r in ranks if r["loss"] == r["loss"])
    return {
        "cp": cp,
        "exchange": exchange if cp > 1 else "",
        "activations": max(r["activations"] for r in ranks),
        "states": max(r["states"] for r in ranks),
        "planned_activations": stage.step_extra,
        "planned_states": stage.states.total,
        "fits": refused is None,
        "first_loss": loss,
    }


def _torch_cp_on_cpu() -> str:
    """Whether torch's own context parallel runs SDPA on CPU (in a 2-rank gloo world)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "runs"
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _steps(rank: int, world: int, repeats: int) -> dict:
    """cp = 2: every exchange and dp = 2 on two sequences; cp = 4: every exchange on one."""
    variants = {f"cp={world} {x}": exchange_args(world, x) for x in _exchanges(world)}
    if world == 2:
        variants = {"dp=2": [], **variants}
    batch = f"trainer.global_batch_size={4 // world}"
    runs = {
        name: build_trainer(rank, world, [batch, *extra], steps=1_000_000, model=MODEL)
        for name, extra in variants.items()
    }
    out = timed_world(
        {n: (lambda t=t: t.train_step().loss) for n, t in runs.items()},
        repeats,
        1,
        warmup=1,
        budget_s=120,
    )
    if world == 2:
        out["torch_cp"] = _torch_cp_on_cpu()
    return out


def _exchanges(cp: int) -> tuple[str, ...]:
    return EXCHANGES if cp > A2A_SIZE else EXCHANGES[:-1]


def _tokens(variant: str) -> int:
    """Tokens per step of a step-time variant: 4 // world sequences."""
    return SEQ * (1 if variant.startswith("cp=4") else 2)


def _peak(mem: list[dict], cp: int, exchange: str) -> float:
    return next(m["activations"] for m in mem if m["cp"] == cp and m["exchange"] == exchange)


def run(quick: bool) -> dict:
    repeats = 2 if quick else 3
    mem = [memory(1, repeats, "all_gather")]
    mem += [memory(cp, repeats, exchange) for cp in (2, 4) for exchange in _exchanges(cp)]
    ranks = run_world(_steps, 2, 3 if quick else 9, timeout=900)
    four = run_world(_steps, 4, 3 if quick else 7, timeout=900)
    times = {**slowest(ranks), **slowest(four)}
    losses = {  # a rank's losses (NaN on ranks that do not compute it)
        n: next(r["losses"][n] for r in world if r["losses"][n][0] == r["losses"][n][0])
        for world in (ranks, four)
        for n in world[0]["losses"]
    }
    rows = [
        [
            m["cp"],
            m["exchange"],
            m["activations"] / MIB,
            m["planned_activations"] / MIB,
            m["planned_activations"] / m["activations"],
            m["states"] / MIB,
            (m["activations"] + m["states"]) / MIB,
            m["fits"],
            m["first_loss"],
        ]
        for m in mem
    ]
    step_rows = [
        [n, median(t) * 1e3, _tokens(n) / median(t), losses[n][0], losses[n][-1]]
        for n, t in times.items()
    ]
    return {
        "title": f"Context parallelism: a {SEQ}-token sequence over 1, 2 and 4 ranks, K/V "
        "all-gather, heads' all-to-all, ring attention and all-to-all in pairs with a ring",
        "config": {"model": MODEL, "budget_mib": BUDGET_MIB},
        "results": {
            "memory": mem,
            "times": times,
            "losses": losses,
            "torch_cp": ranks[0]["torch_cp"],
        },
        "tables": [
            table(
                f"Memory per rank (MiB), one sequence of {SEQ} tokens per step, budget "
                f"{BUDGET_MIB} MiB",
                [
                    "cp|",
                    "exchange|",
                    "activations, measured|.1f",
                    "activations, planned|.1f",
                    "planned / measured|.2f",
                    "states|.1f",
                    "measured total|.1f",
                    "start-up check at the budget: fits|",
                    "step 1 loss|.5f",
                ],
                rows,
            ),
            table(
                f"Step time (median): 2 ranks, 2 sequences of {SEQ} tokens per step; 4 ranks "
                f"(cp=4, on the same 2 cores), 1 sequence",
                ["variant|", "step ms|,.0f", "tokens/s|,.0f", "step 1 loss|.5f", "last loss|.5f"],
                step_rows,
            ),
        ],
        "facts": {
            "cp=2 all_gather step time / dp=2's (median of per-repeat ratios)|.2fx": paired_ratio(
                times["cp=2 all_gather"], times["dp=2"]
            ),
            "cp=2 a2a step time / all_gather's (median of per-repeat ratios)|.2fx": paired_ratio(
                times["cp=2 a2a"], times["cp=2 all_gather"]
            ),
            "cp=2 ring step time / all_gather's (median of per-repeat ratios)|.2fx": paired_ratio(
                times["cp=2 ring"], times["cp=2 all_gather"]
            ),
            "cp=4 activation peak per rank, ring / all_gather|.2fx": _peak(mem, 4, "ring")
            / _peak(mem, 4, "all_gather"),
            "cp=4 activation peak per rank, a2a_ring / all_gather|.2fx": _peak(mem, 4, "a2a_ring")
            / _peak(mem, 4, "all_gather"),
            "cp=4 a2a_ring step time / ring's (median of per-repeat ratios)|.2fx": paired_ratio(
                times["cp=4 a2a_ring"], times["cp=4 ring"]
            ),
            "cp=4 a2a_ring step time / a2a's (median of per-repeat ratios)|.2fx": paired_ratio(
                times["cp=4 a2a_ring"], times["cp=4 a2a"]
            ),
            "torch.distributed.tensor.experimental.context_parallel on CPU|": ranks[0]["torch_cp"],
        },
    }


if __name__ == "__main__":
    cli(run, __doc__)
