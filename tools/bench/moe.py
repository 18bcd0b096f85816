"""Mixture of experts on CPU: a tiny llama MoE with megatronish at ep=1 and ep=2 against a plain
PyTorch MoE of the same shape and routing (8 experts top-2, and 64 experts top-8); tokens/s and
the all-to-all share of the ep=2 step;
the experts' backward alone at 4, 16 and 64 local experts (time and bytes allocated).
Run alone: ``.venv/bin/python tools/bench/moe.py [--quick]``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import common
import moe_experts
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import MIB, batch, build_run, cli, config, median, paired_ratio, slowest, table
from torch import nn

from megatronish.moe import dispatch
from megatronish.testing.multiproc import run_world
from megatronish.testing.reference_gpt import RefConfig, ReferenceGPT

MOE = [
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.ffn_hidden_size=256",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=8",
]
# Many small experts, as the fine-grained MoEs (OLMoE, Qwen3-MoE, DeepSeek-V3) have: 64 experts,
# top-8, expert ffn 64, so a token's expert FLOPs equal the 8-expert model's (8 x 64 = 2 x 256).
MOE64 = [
    "model.moe.num_experts=64",
    "model.moe.top_k=8",
    "model.moe.ffn_hidden_size=64",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=8",
]
PLAIN, EP1, EP2 = "plain PyTorch MoE", "megatronish ep=1", "megatronish ep=2"
VARIANTS = (PLAIN, EP1, EP2)
RANKS = {PLAIN: 1, EP1: 1, EP2: 2}
WARMUP = 1  # untimed steps of each variant after the first (measured) one
# The experts' backward alone: a microbatch's rows (4 x 256 tokens, top-2) of the model above.
EXPERT_ROWS, EXPERT_HIDDEN, EXPERT_FFN, EXPERT_LOCALS = 2048, 128, 256, (4, 16, 64)


class PlainMoE(nn.Module):
    """A straightforward top-k mixture of SwiGLU experts: route every token, then loop over the
    experts, gathering each one's tokens (``index_select``) and adding its weighted output back
    (``index_add_``). Keeps the balancing and z losses of the last forward and the step's
    assignments per expert."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, aux: float, z: float):
        super().__init__()
        self.top_k, self.aux_coef, self.z_coef = top_k, aux, z
        self.router = nn.Parameter(torch.empty(experts, hidden))
        self.fc1 = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))  # gate | up
        self.fc2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.aux_loss = torch.zeros(())
        self.counts = torch.zeros(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        num_tokens, num_experts, k = tokens.shape[0], self.router.shape[0], self.top_k
        logits = F.linear(tokens.float(), self.router.float())
        probs = logits.softmax(dim=-1)
        # A stable descending sort rather than topk: ties go to the lower expert index.
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        weights, experts = ordered[:, :k], order[:, :k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(num_experts):
            token, slot = torch.where(experts == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(tokens.index_select(0, token), self.fc1[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.fc2[e])
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
        counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
        scale = self.aux_coef * num_experts / (k * num_tokens * num_tokens)
        self.aux_loss = scale * (probs.sum(dim=0) * counts).sum()
        self.aux_loss = self.aux_loss + self.z_coef * logits.logsumexp(-1).square().mean()
        self.counts = self.counts + counts
        return out.view_as(x)


# megatronish's global names -> the plain model's (a block's part after ``layers.i.``).
NAMES = {
    "embedding.word.weight": "tok_embeddings.weight",
    "head.norm.weight": "norm.weight",
    "head.weight": "output.weight",
    "attn_norm.weight": "attention_norm.weight",
    "attn.qkv.weight": "attention.wqkv.weight",
    "attn.proj.weight": "attention.wo.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.router": "feed_forward.router",
    "mlp.experts.fc1": "feed_forward.fc1",
    "mlp.experts.fc2": "feed_forward.fc2",
}


def plain_name(name: str) -> str:
    if not name.startswith("layers."):
        return NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"layers.{index}.{NAMES[rest]}"


def plain_model(spec, weights: dict[str, torch.Tensor]) -> ReferenceGPT:
    """The reference GPT with a :class:`PlainMoE` as every block's MLP, holding ``weights``
    (megatronish's global names; every tensor must match)."""
    m = spec.moe
    supported = m.layer_freq == 1 and not m.shared_experts and m.capacity_factor is None
    assert spec.is_llama and m.renormalize and supported, "the plain MoE covers this case only"
    model = ReferenceGPT(RefConfig.from_spec(spec))
    for block in model.layers:
        block.feed_forward = PlainMoE(
            spec.hidden_size,
            m.ffn_hidden_size,
            m.num_experts,
            m.top_k,
            m.aux_loss_coef,
            m.z_loss_coef,
        )
    model.load_state_dict({plain_name(n): w.detach().clone() for n, w in weights.items()})
    return model


@dataclass
class PlainRun:
    """One step as the Trainer takes it: the global batch's microbatches forward and backward
    (language-model loss + balancing and z losses, each over the microbatch count), clipping,
    ``torch.optim.AdamW``; returns the mean language-model loss."""

    model: ReferenceGPT
    optimizer: torch.optim.Optimizer
    data: object
    global_batch: int
    micro_batch: int
    grad_clip: float
    step_index: int = 0

    def moe_layers(self) -> list[PlainMoE]:
        return [block.feed_forward for block in self.model.layers]

    def step(self) -> float:
        moes, n = self.moe_layers(), self.global_batch // self.micro_batch
        for m in moes:
            m.counts = torch.zeros_like(m.counts)
        inputs, targets = batch(self.data, self.step_index * self.global_batch, self.global_batch)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for x, y in zip(inputs.split(self.micro_batch), targets.split(self.micro_batch)):
            loss = self.model(x, y)
            ((loss + sum(m.aux_loss for m in moes)) / n).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.step_index += 1
        return sum(losses) / n

    def metrics(self) -> dict[str, float]:
        """The last step's assignments per expert (max and mean over blocks and experts)."""
        counts = torch.stack([m.counts for m in self.moe_layers()]).double()
        return {
            "moe/tokens_per_expert_max": counts.max().item(),
            "moe/tokens_per_expert_mean": counts.mean().item(),
        }


def plain_run(mish) -> PlainRun:
    """A :class:`PlainRun` from megatronish's one-process run ``mish`` (its initial weights, its
    AdamW settings: decay on matrices, routers included, none on norms, as there)."""
    (chunk,) = mish.chunks
    model = plain_model(mish.spec, dict(chunk.named_parameters()))
    params = list(model.named_parameters())
    decay = [p for _, p in params if p.dim() >= 2]
    rest = [p for _, p in params if all(p is not q for q in decay)]
    o, t = mish.cfg.optimizer, mish.cfg.trainer
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    return PlainRun(model, opt, mish.data, t.global_batch_size, t.micro_batch_size, o.grad_clip)


class AllToAllTimer:
    """Wraps ``megatronish.moe.dispatch.all_to_all`` (a measurement harness in this process
    only): ``seconds`` accumulates the time spent inside it."""

    def __init__(self):
        self.seconds = 0.0
        self.inner = dispatch.all_to_all
        dispatch.all_to_all = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def _nan() -> float:
    return math.nan


def _rank(rank: int, world: int, repeats: int, budget_s: float, moe: list[str] = MOE) -> dict:
    """Rank 0 holds all three variants of the model ``moe``, rank 1 its half of ep=2 (and waits
    at the barrier while rank 0 times the one-process variants)."""
    timer = AllToAllTimer()
    ep2 = build_run([*moe, "parallel.ep=2"], rank, world)
    steps = {PLAIN: _nan, EP1: _nan, EP2: ep2.step}
    metrics = {EP2: ep2.trainer.moe_metrics}  # collective: every rank
    if rank == 0:  # world=1 runs: no collectives, the other rank plays no part
        ep1 = build_run(moe)
        plain = plain_run(ep1)
        steps.update({PLAIN: plain.step, EP1: ep1.step})
        metrics.update({PLAIN: plain.metrics, EP1: ep1.trainer.moe_metrics})
    record = {n: [] for n in VARIANTS}  # (wall, CPU, all-to-all) seconds of each step

    def recorded(name: str):
        def one() -> float:
            timer.seconds, t0, cpu0 = 0.0, time.perf_counter(), time.process_time()
            loss = steps[name]()
            record[name].append(
                (time.perf_counter() - t0, time.process_time() - cpu0, timer.seconds)
            )
            return loss

        return one

    steppers = {n: recorded(n) for n in VARIANTS}
    dist.barrier()
    first = {n: {"loss": steppers[n](), **(metrics[n]() if n in metrics else {})} for n in VARIANTS}
    ep2.trainer.topo.stats.reset()
    out = common.timed_world(steppers, repeats, 1, warmup=WARMUP, budget_s=budget_s)
    counted = len(record[EP2]) - 1
    comm = {
        k: {m: v / counted for m, v in c.items()}
        for k, c in ep2.trainer.topo.stats.summary().items()
    }
    # The first and warm-up steps are not timed (rank 1 waits in them while rank 0 steps the
    # one-process variants); CommStats counts from the warm-up steps on.
    timed = {n: rs[1 + WARMUP :] for n, rs in record.items()}
    out.update(first=first, last={n: fn() for n, fn in metrics.items()}, record=timed, comm=comm)
    dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return out


def run(quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    repeats, budget = (3, 8.0) if quick else (41, 75.0)
    ranks = run_world(_rank, 2, repeats, budget, timeout=600, collective_timeout=300)
    many = run_world(_rank, 2, repeats, budget, MOE64, timeout=600, collective_timeout=300)
    many_times = slowest(many)
    many_med = {n: median(ts) for n, ts in many_times.items()}
    many_paired = {n: paired_ratio(many_times[PLAIN], many_times[n]) for n in VARIANTS}
    with common.threads(1):
        experts = moe_experts.run_experts(
            EXPERT_ROWS, EXPERT_HIDDEN, EXPERT_FFN, EXPERT_LOCALS, 3 if quick else 9
        )
    expert_rows, expert_facts = experts_table(experts)
    times = slowest(ranks)
    med = {n: median(ts) for n, ts in times.items()}
    cfg = config(MOE)
    tokens = cfg.trainer.global_batch_size * cfg.model.seq_length
    paired = {n: paired_ratio(times[PLAIN], times[n]) for n in VARIANTS}
    ep2_vs_ep1 = paired_ratio(times[EP1], times[EP2])
    # Per rank (median over steps): CPU seconds, all-to-all seconds and their share of the step.
    cpu = {
        n: [median([c for _, c, _ in r["record"][n]]) for r in ranks[: RANKS[n]]] for n in VARIANTS
    }
    a2a_s = [median([a for _, _, a in r["record"][EP2]]) for r in ranks]
    share = [median([a / w for w, _, a in r["record"][EP2]]) for r in ranks]
    first, last, losses = ranks[0]["first"], ranks[0]["last"], ranks[0]["losses"]
    comm = ranks[0]["comm"]
    rows = [
        [
            n,
            RANKS[n],
            med[n] * 1e3,
            tokens / med[n],
            paired[n] if n != PLAIN else None,
            [c * 1e3 for c in cpu[n]],
            [a * 1e3 for a in a2a_s] if n == EP2 else None,
            share if n == EP2 else None,
        ]
        for n in VARIANTS
    ]
    key = "moe/tokens_per_expert_"
    sanity = [
        [
            n,
            first[n]["loss"],
            first[n][key + "max"],
            first[n][key + "mean"],
            len(losses[n]) + 1,
            losses[n][-1],
            last[n][key + "max"],
            last[n][key + "mean"],
        ]
        for n in VARIANTS
    ]
    comm_rows = [[k, c["calls"], c["bytes"] / MIB] for k, c in comm.items()]
    many_first = many[0]["first"]
    many_rows = [
        [
            n,
            RANKS[n],
            many_med[n] * 1e3,
            tokens / many_med[n],
            many_paired[n] if n != PLAIN else None,
            many_first[n]["loss"],
            many_first[n][key + "max"],
        ]
        for n in VARIANTS
    ]
    return {
        "title": "Mixture of experts: megatronish ep=1 and ep=2 vs a plain PyTorch MoE",
        "config": {
            "model": MOE,
            "repeats": repeats,
            "budget_s": budget,
            "warmup": WARMUP + 1,
            "steps_per_repeat": 1,
            "tokens_per_step": tokens,
        },
        "results": {
            "step_times_s": times,
            "median_step_s": med,
            "paired_vs_plain": paired,
            "ep2_vs_ep1": ep2_vs_ep1,
            "a2a_s_per_rank": a2a_s,
            "a2a_share_per_rank": share,
            "cpu_s_per_rank": cpu,
            "comm_per_step": comm,
            "first": first,
            "last": last,
            "losses": losses,
            "per_step_wall_cpu_a2a_s": [r["record"] for r in ranks],
            "experts_backward": experts,
            "experts64_top8": {
                "model": MOE64,
                "step_times_s": many_times,
                "median_step_s": many_med,
                "paired_vs_plain": many_paired,
                "first": many_first,
            },
        },
        "tables": [
            table(
                f"Throughput, {tokens} tokens per step (median over repeats)",
                [
                    "variant",
                    "ranks",
                    "step ms|,.0f",
                    "tokens/s|,.0f",
                    "tokens/s / plain's, median of per-repeat ratios|.2fx",
                    "CPU ms per step, rank 0 / 1|,.0f",
                    "all-to-all ms per step, rank 0 / 1|.1f",
                    "all-to-all share of the step, rank 0 / 1|.1%",
                ],
                rows,
            ),
            table(
                f"64 experts of ffn 64, top-8 (the same expert FLOPs per token), {tokens} tokens "
                "per step (median over repeats)",
                [
                    "variant",
                    "ranks",
                    "step ms|,.0f",
                    "tokens/s|,.0f",
                    "tokens/s / plain's, median of per-repeat ratios|.2fx",
                    "step 1 loss|.6f",
                    "step 1 tokens per expert, max|.0f",
                ],
                many_rows,
            ),
            table(
                "Sanity: same weights and batches give the same losses and routing",
                [
                    "variant",
                    "step 1 loss|.6f",
                    "step 1 tokens per expert, max|.0f",
                    "mean|.0f",
                    "steps",
                    "last loss|.6f",
                    "last step tokens per expert, max|.0f",
                    "mean|.0f",
                ],
                sanity,
            ),
            table(
                "Communication per ep=2 step and rank (CommStats, steps after the first)",
                ["group/op", "calls|.0f", "MiB|.3f"],
                comm_rows,
            ),
            table(
                f"The experts' forward and backward alone: {EXPERT_ROWS} rows, hidden "
                f"{EXPERT_HIDDEN}, ffn {EXPERT_FFN}, SwiGLU, fp32, 1 thread (median over repeats)",
                [
                    "local experts",
                    "implementation",
                    "grouped_mm",
                    "forward ms|,.1f",
                    "backward ms|,.1f",
                    "forward + backward / now's, median of per-repeat ratios|.2fx",
                    "MiB allocated in forward|,.1f",
                    "MiB allocated in backward|,.1f",
                    "of which the stacks' grads|,.1f",
                    "MiB beyond the stacks' grads|,.1f",
                ],
                expert_rows,
            ),
        ],
        "facts": {
            "megatronish ep=1 tokens/s / plain's (median of per-repeat ratios)|.2fx": paired[EP1],
            "megatronish ep=2 tokens/s / ep=1's (median of per-repeat ratios)|.2fx": ep2_vs_ep1,
            "64 experts top-8: megatronish ep=1 tokens/s / plain's|.2fx": many_paired[EP1],
            "step 1 loss, ep=1 minus plain|.1e": first[EP1]["loss"] - first[PLAIN]["loss"],
            "step 1 loss, ep=2 minus ep=1|.1e": first[EP2]["loss"] - first[EP1]["loss"],
            **expert_facts,
            "repeats run": len(times[EP1]),
            "1-minute load average, the larger of start and end|.1f": max(
                load_before, os.getloadavg()[0]
            ),
        },
    }


def experts_table(experts: dict) -> tuple[list[list], dict]:
    """The experts' forward and backward table rows and facts (64 vs 4 local experts)."""
    rows, beyond, both = [], {}, {}
    for local, backward in experts["seconds"].items():
        forward = experts["forward_seconds"][local]
        for impl in moe_experts.IMPLS:
            both[local, impl] = [f + b for f, b in zip(forward[impl], backward[impl])]
        for impl in moe_experts.IMPLS:
            total = experts["bytes"][local][impl]
            grads = experts["stack_grad_bytes"][local][impl]
            beyond[local, impl] = total - grads
            picked = experts["grouped_mm_used"][local] if impl == moe_experts.GROUPED else False
            rows.append(
                [
                    int(local),
                    impl,
                    picked,
                    median(forward[impl]) * 1e3,
                    median(backward[impl]) * 1e3,
                    paired_ratio(both[local, impl], both[local, moe_experts.GROUPED]),
                    experts["forward_bytes"][local][impl] / MIB,
                    total / MIB,
                    grads / MIB,
                    (total - grads) / MIB,
                ]
            )
    lo, hi = (str(n) for n in (EXPERT_LOCALS[0], EXPERT_LOCALS[-1]))
    facts = {}
    for impl in moe_experts.IMPLS:
        label = f"experts' backward, MiB beyond the stacks' grads, {hi} / {lo} local experts, "
        facts[f"{label}{impl}|.2fx"] = beyond[hi, impl] / beyond[lo, impl]
    for impl in (moe_experts.GROUPED, moe_experts.LOOP):
        label = f"experts' forward + backward time, {hi} / {lo} local experts (medians), "
        facts[f"{label}{impl}|.2fx"] = median(both[hi, impl]) / median(both[lo, impl])
        label = f"experts' forward MiB allocated, {hi} / {lo} local experts, "
        forward_bytes = experts["forward_bytes"]
        facts[f"{label}{impl}|.2fx"] = forward_bytes[hi][impl] / forward_bytes[lo][impl]
    slow = paired_ratio(both[hi, moe_experts.SLICED], both[hi, moe_experts.GROUPED])
    facts[f"experts' forward + backward time at {hi} local experts, before / now|.1fx"] = slow
    return rows, facts


if __name__ == "__main__":
    cli(run, __doc__)
