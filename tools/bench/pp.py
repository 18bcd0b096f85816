"""Interleaved 1F1B on 2 ranks: megatronish (pp=2, vpp=2) vs torch.distributed.pipelining on
the reference GPT, and megatronish's measured bubble per rank.
Run alone: ``.venv/bin/python tools/bench/pp.py [--quick]``.
"""

from __future__ import annotations

import math

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import build_run, cli, median, paired_ratio, slowest, table
from torch import nn

from megatronish.config.schema import TrainConfig
from megatronish.pipeline.engine import Timeline
from megatronish.pipeline.schedule import analytic_bubble
from megatronish.pipeline.trace import measured_bubble, phase_time, step_span
from megatronish.testing.multiproc import run_world
from megatronish.testing.reference_gpt import build_adamw

PP, VPP, LAYERS, MICROBATCHES, MICRO_BATCH = 2, 2, 8, 8, 1
MODEL = [
    f"model.num_layers={LAYERS}",
    f"trainer.micro_batch_size={MICRO_BATCH}",
    f"trainer.global_batch_size={MICROBATCHES * MICRO_BATCH}",
]
LAYOUT = [f"parallel.pp={PP}", f"parallel.vpp={VPP}"]
VARIANTS = ("megatronish", "torch pipelining")
# Layers per chunk: the even split both variants are timed with, and one that balances the
# ranks (the last chunk's head + loss over the vocabulary costs about two layers here).
EVEN, BALANCED = [LAYERS // (PP * VPP)] * (PP * VPP), [3, 2, 2, 1]
SPLIT_OVERRIDE = f"parallel.pipeline_layer_split=[{','.join(map(str, BALANCED))}]"


class StageModule(nn.Module):
    """Consecutive layers of the reference GPT, with its embedding and/or norm + head."""

    def __init__(self, ref: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = ref.tok_embeddings if first else None
        self.layers = nn.ModuleList(ref.layers[i] for i in layers)
        self.norm, self.output = (ref.norm, ref.output) if last else (None, None)
        self.register_buffer("cos", ref.cos.clone(), persistent=False)
        self.register_buffer("sin", ref.sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return x if self.output is None else self.output(self.norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference GPT's loss, as the schedule's ``loss_fn`` (mean over the microbatch)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TorchPipelineRun:
    """One optimizer step of the reference GPT under ``ScheduleInterleaved1F1B`` on this rank."""

    def __init__(self, rank: int, cfg: TrainConfig, spec, data):
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        ref = common.reference_model(spec, MODEL)
        per_chunk, n = LAYERS // (PP * VPP), PP * VPP
        s, b, h, z = spec.seq_length, MICRO_BATCH, spec.hidden_size, torch.zeros
        stages, self.modules = [], []
        for c in range(rank, n, PP):
            module = StageModule(ref, range(c * per_chunk, (c + 1) * per_chunk), c == 0, c == n - 1)
            # Static shapes (no handshake, like megatronish); a received activation needs grad.
            x = z(b, s, dtype=torch.long) if c == 0 else z(b, s, h).requires_grad_()
            y = z(b, s, spec.padded_vocab_size if c == n - 1 else h).requires_grad_()
            stages.append(
                PipelineStage(module, c, n, torch.device("cpu"), input_args=x, output_args=y)
            )
            self.modules.append(module)
        self.schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=cross_entropy)
        params = nn.ModuleList(self.modules)
        o = cfg.optimizer
        self.params = list(params.parameters())
        self.optimizer = build_adamw(params, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
        self.grad_clip, self.data, self.step_index = o.grad_clip, data, 0
        self.holds_loss = rank == PP - 1

    def step(self) -> float:
        """Forward/backward every microbatch, clip the global grad norm, AdamW; the mean loss."""
        n = MICROBATCHES * MICRO_BATCH
        inputs, targets = common.batch(self.data, self.step_index * n, n)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm_sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
        dist.all_reduce(norm_sq)  # the global norm over both pipeline ranks
        norm = norm_sq.sqrt().item()
        if norm > self.grad_clip:
            torch._foreach_mul_(grads, self.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.step_index += 1
        return torch.stack(losses).mean().item() if self.holds_loss else float("nan")


def _recorded_steps(run, steps: int) -> list[list]:
    """megatronish steps recorded with a Timeline, events in absolute perf_counter seconds."""
    out = []
    for _ in range(steps):
        dist.barrier()
        run.trainer.timeline = timeline = Timeline()
        run.step()
        run.trainer.timeline = None
        out.append([(n, s + timeline.origin, e + timeline.origin) for n, s, e in timeline.events])
    return out


def _rank(rank: int, world: int, repeats: int, steps: int, recorded: int) -> dict:
    mish = build_run([*MODEL, *LAYOUT], rank, world)
    balanced = build_run([*MODEL, *LAYOUT, SPLIT_OVERRIDE], rank, world)
    peer = TorchPipelineRun(rank, mish.cfg, mish.spec, mish.data)
    out = common.timed_world({VARIANTS[0]: mish.step, VARIANTS[1]: peer.step}, repeats, steps)
    balanced.step()  # warm-up
    out["timelines"] = {
        str(EVEN): _recorded_steps(mish, recorded),
        str(BALANCED): _recorded_steps(balanced, recorded),
    }
    dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return out


def bubble(ranks: list[dict], split: str) -> dict:
    """Step spans and per-rank fwd / bwd / comm seconds and measured bubble of one split."""
    steps = [dict(enumerate(t)) for t in zip(*(r["timelines"][split] for r in ranks))]
    spans = [step_span(t)[1] - step_span(t)[0] for t in steps]
    per_rank = {
        r: {
            "fwd_s": [phase_time(t[r], "fwd") for t in steps],
            "bwd_s": [phase_time(t[r], "bwd") for t in steps],
            "comm_s": [phase_time(t[r], "comm") for t in steps],
            "bubble": [measured_bubble(t[r], step_span(t)) for t in steps],
        }
        for r in range(PP)
    }
    return {
        "step_span_s": spans,
        "per_rank": per_rank,
        "analytic": analytic_bubble(PP, VPP, MICROBATCHES),
    }


def run(quick: bool = False) -> dict:
    repeats, steps, recorded = (3, 1, 2) if quick else (9, 2, 3)
    ranks = run_world(_rank, PP, repeats, steps, recorded, timeout=900, collective_timeout=300)
    m = common.config([*MODEL, *LAYOUT]).model
    times = slowest(ranks)
    med = {n: median(ts) for n, ts in times.items()}
    tokens = MICROBATCHES * MICRO_BATCH * m.seq_length
    paired = paired_ratio(times[VARIANTS[0]], times[VARIANTS[1]])
    losses = ranks[PP - 1]["losses"]  # the last stage holds the loss
    bubbles = {split: bubble(ranks, split) for split in (str(EVEN), str(BALANCED))}
    return {
        "title": "Pipeline parallelism, 2 ranks, interleaved 1F1B: megatronish vs torch pipelining",
        "config": {
            "repeats": repeats,
            "steps_per_repeat": steps,
            "recorded_steps": recorded,
            "warmup": 2,
            "pp": PP,
            "vpp": VPP,
            "layers": LAYERS,
            "microbatches": MICROBATCHES,
            "micro_batch": MICRO_BATCH,
            "balanced_split": SPLIT_OVERRIDE,
        },
        "results": {
            "step_times_s": times,
            "median_step_s": med,
            "paired_ratio": paired,
            "ratio": med[VARIANTS[0]] / med[VARIANTS[1]],
            "losses": losses,
            "bubble": bubbles,
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
                    "step time / torch pipelining's|.2fx",
                    "same, median of per-repeat ratios|.2fx",
                ],
                [
                    [n, med[n] * 1e3, tokens / med[n], med[n] / med[VARIANTS[1]], p]
                    for n, p in zip(VARIANTS, (paired, None), strict=True)
                ],
            ),
            table(
                "Sanity: losses (last stage) of the same run",
                ["variant", "first loss|.5f", "steps", "last loss|.5f"],
                [[n, ls[0], len(ls), ls[-1]] for n, ls in losses.items()],
            ),
            table(
                "Bubble per pipeline rank, megatronish (one step's forward/backward phase)",
                [
                    "layers per chunk",
                    "step fwd/bwd ms|.0f",
                    "pp rank",
                    "fwd ms|.0f",
                    "bwd ms|.0f",
                    "send/recv ms|.0f",
                    "measured bubble|.1%",
                    f"analytic (pp-1)/(vpp*m), m={MICROBATCHES}|.1%",
                ],
                [
                    [
                        split,
                        median(b["step_span_s"]) * 1e3,
                        r,
                        median(d["fwd_s"]) * 1e3,
                        median(d["bwd_s"]) * 1e3,
                        median(d["comm_s"]) * 1e3,
                        median(d["bubble"]),
                        b["analytic"],
                    ]
                    for split, b in bubbles.items()
                    for r, d in b["per_rank"].items()
                ],
            ),
        ],
        "facts": {"ln(vocab)|.4f": math.log(m.vocab_size)},
    }


if __name__ == "__main__":
    cli(run, __doc__)
