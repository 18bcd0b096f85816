"""Interleaved 1F1B on 2 ranks: megatronish (pp=2, vpp=2) vs torch.distributed.pipelining.

Both variants live in one forked 2-rank gloo world (one thread per rank): megatronish's Trainer
with ``parallel.pp=2 parallel.vpp=2`` and the plain reference GPT cut into the same 4 chunks
(chunk c on rank c % 2: embedding + layers 0-1, layers 2-3, layers 4-5, layers 6-7 + norm +
head), each a ``PipelineStage``, run by ``ScheduleInterleaved1F1B`` with the loss as its
``loss_fn``. They start from the same global weights, train on the same microbatches with the
same AdamW, global grad-norm clipping and learning rate, and their steps are timed interleaved.
Afterwards megatronish records a few steps with its Timeline to measure each rank's bubble.

Run alone: ``.venv/bin/python tools/bench/bench_pp.py [--quick]``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import interleaved, machine_info, median, paired_ratio
from mish import batch, bench_config, build_run, full_weights
from sections import bench_cli, table
from torch import nn

from megatronish.pipeline.engine import Timeline
from megatronish.pipeline.schedule import analytic_bubble
from megatronish.pipeline.trace import measured_bubble, phase_time, step_span
from megatronish.testing.multiproc import run_world
from megatronish.testing.reference_gpt import (
    RefConfig,
    ReferenceGPT,
    build_adamw,
    load_megatronish_weights,
)

NAME = "pp"
TITLE = "Pipeline parallelism, 2 ranks, interleaved 1F1B: megatronish vs torch pipelining"
PP, VPP, LAYERS, MICROBATCHES, MICRO_BATCH = 2, 2, 8, 8, 1
MODEL = [f"model.num_layers={LAYERS}", f"trainer.micro_batch_size={MICRO_BATCH}",
         f"trainer.global_batch_size={MICROBATCHES * MICRO_BATCH}"]  # fmt: skip
LAYOUT = [f"parallel.pp={PP}", f"parallel.vpp={VPP}"]
VARIANTS = ("megatronish", "torch pipelining")
# Layers per chunk: the even split both variants are timed with, and one that balances the
# ranks (the last chunk's head + loss over the vocabulary costs about two layers here).
STEP_COLUMNS = ["variant", "step ms", "tokens/s", "step time / torch pipelining's",
                "same, median of per-repeat ratios"]  # fmt: skip
LOSS_COLUMNS = ["variant", "first loss", "steps", "last loss"]
BUBBLE_COLUMNS = ["layers per chunk", "step fwd/bwd ms", "pp rank", "fwd ms", "bwd ms",
                  "send/recv ms", "measured bubble"]  # fmt: skip
EVEN, BALANCED = [LAYERS // (PP * VPP)] * (PP * VPP), [3, 2, 2, 1]
SPLIT_OVERRIDE = f"parallel.pipeline_layer_split=[{','.join(map(str, BALANCED))}]"


class StageModule(nn.Module):
    """Consecutive layers of the reference GPT, with its embedding and/or norm + head."""

    def __init__(self, ref: ReferenceGPT, layers: range, first: bool, last: bool):
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

    def __init__(self, rank: int, cfg, spec, data):
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        ref = ReferenceGPT(RefConfig.from_spec(spec, fused=True))
        load_megatronish_weights(ref, full_weights(MODEL))
        per_chunk, n = LAYERS // (PP * VPP), PP * VPP
        s, b, h = spec.seq_length, MICRO_BATCH, spec.hidden_size
        cpu = torch.device("cpu")
        stages, self.modules = [], []
        for c in range(rank, n, PP):
            module = StageModule(ref, range(c * per_chunk, (c + 1) * per_chunk), c == 0, c == n - 1)
            # Static shapes (no handshake, like megatronish); a received activation needs grad.
            x = (
                torch.zeros(b, s, dtype=torch.long)
                if c == 0
                else torch.zeros(b, s, h).requires_grad_()
            )
            y = torch.zeros(b, s, spec.padded_vocab_size if c == n - 1 else h).requires_grad_()
            stages.append(PipelineStage(module, c, n, cpu, input_args=x, output_args=y))
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
        inputs, targets = batch(self.data, self.step_index, MICROBATCHES * MICRO_BATCH)
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
    """One rank of the world: build both variants, time them interleaved, record timelines."""
    mish = build_run([*MODEL, *LAYOUT], rank, world)
    balanced = build_run([*MODEL, *LAYOUT, SPLIT_OVERRIDE], rank, world)
    peer = TorchPipelineRun(rank, mish.cfg, mish.spec, mish.data)
    steppers = {VARIANTS[0]: mish.step, VARIANTS[1]: peer.step}
    losses: dict[str, list[float]] = {n: [] for n in VARIANTS}

    def recorder(name):
        return lambda: losses[name].append(steppers[name]())

    times = interleaved(
        {n: recorder(n) for n in VARIANTS}, repeats, steps, sync=lambda: dist.barrier()
    )
    balanced.step()  # warm-up
    timelines = {str(EVEN): _recorded_steps(mish, recorded)}
    timelines[str(BALANCED)] = _recorded_steps(balanced, recorded)
    dist.barrier()  # ranks leave together (a rank exiting early can hang gloo shutdown)
    return {"times": times, "losses": losses, "timelines": timelines}


def bubble_rows(ranks: list[dict], split: str) -> tuple[list[list[str]], dict]:
    """Per-rank times and measured bubble of one layer split, medians over the recorded steps."""
    recorded = len(ranks[0]["timelines"][split])
    steps = [{r: ranks[r]["timelines"][split][i] for r in range(PP)} for i in range(recorded)]
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
    analytic = analytic_bubble(PP, VPP, MICROBATCHES)
    rows = []
    for r, d in per_rank.items():
        ms = {k: f"{median(v) * 1e3:.0f}" for k, v in d.items() if k.endswith("_s")}
        rows.append([split, f"{median(spans) * 1e3:.0f}", r, ms["fwd_s"], ms["bwd_s"],
                     ms["comm_s"], f"{median(d['bubble']):.1%}", f"{analytic:.1%}"])  # fmt: skip
    return rows, {"step_span_s": spans, "per_rank": per_rank, "analytic": analytic}


def run(quick: bool = False) -> dict:
    """The section result (see ``sections.py``)."""
    t0 = time.perf_counter()
    repeats, steps, recorded = (3, 1, 2) if quick else (9, 2, 3)
    ranks = run_world(_rank, PP, repeats, steps, recorded, timeout=900, collective_timeout=300)
    cfg = bench_config([*MODEL, *LAYOUT])
    m = cfg.model
    step_times = {n: [max(r["times"][n][i] for r in ranks) for i in range(repeats)]
                  for n in VARIANTS}  # fmt: skip
    med = {n: median(ts) for n, ts in step_times.items()}
    tokens = cfg.trainer.global_batch_size * m.seq_length
    ratio = med[VARIANTS[0]] / med[VARIANTS[1]]
    paired = paired_ratio(step_times[VARIANTS[0]], step_times[VARIANTS[1]])
    rows = [[n, f"{med[n] * 1000:.0f}", f"{tokens / med[n]:,.0f}",
             f"{med[n] / med[VARIANTS[1]]:.2f}x", f"{paired:.2f}x" if n == VARIANTS[0] else ""]
            for n in VARIANTS]  # fmt: skip
    losses = ranks[PP - 1]["losses"]  # the last stage holds the loss
    loss_rows = [[n, f"{losses[n][0]:.5f}", len(losses[n]), f"{losses[n][-1]:.5f}"]
                 for n in VARIANTS]  # fmt: skip
    b_rows, b_raw = [], {}
    for split in (str(EVEN), str(BALANCED)):
        split_rows, b_raw[split] = bubble_rows(ranks, split)
        b_rows += split_rows
    method = (
        f"One forked 2-rank gloo world, one thread per rank. The tiny llama with {LAYERS} "
        f"layers (hidden {m.hidden_size}, {m.num_attention_heads} heads, ffn "
        f"{m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}, fp32), pp={PP} vpp={VPP} "
        f"({LAYERS // (PP * VPP)} layers per chunk), {MICROBATCHES} microbatches of "
        f"{MICRO_BATCH} per step. torch pipelining runs the reference GPT cut into the same "
        f"chunks as `PipelineStage`s with static shapes under `ScheduleInterleaved1F1B` "
        f"(`scale_grads=True`, loss as `loss_fn`), then an all-reduced global grad norm, "
        f"clipping and AdamW, as megatronish's Trainer does. {repeats} interleaved repeats of "
        f"{steps} steps after 2 warm-up steps, barrier before each timing; a repeat's time is the "
        f"slower rank's; medians."
    )
    bubble_note = (
        f"Bubble: megatronish records {recorded} more steps with its Timeline, with the even "
        f"layer split it was timed with and with `{SPLIT_OVERRIDE}`. Per "
        f"rank: (span of the step's forward/backward phase - the rank's forward+backward time) "
        f"/ that time, median over the steps; time in sends and receives, waiting for the peer "
        f"included, counts as bubble. The analytic (pp-1)/(vpp*m) assumes equal chunks and free "
        f"communication; with the even split the last chunk also computes the head and loss "
        f"over the {m.vocab_size}-token vocabulary (about two layers' work), so rank 1 computes "
        f"more and rank 0 waits for it. `tools/pipeline_timeline.py` draws such a step "
        f"(docs/pipeline.png)."
    )
    return {
        "name": NAME,
        "title": TITLE,
        "method": method,
        "quick": quick,
        "tables": [
            table("Step time (median over repeats)", STEP_COLUMNS, rows),
            table("Sanity: losses (last stage) of the same run", LOSS_COLUMNS, loss_rows),
            table(
                "Bubble per pipeline rank, megatronish (one step's forward/backward phase)",
                [*BUBBLE_COLUMNS, f"analytic (pp-1)/(vpp*m), m={MICROBATCHES}"],
                b_rows,
            ),
        ],
        "notes": [bubble_note, f"ln(vocab) = {math.log(m.vocab_size):.4f}."],
        "raw": {
            "step_times_s": step_times,
            "median_step_s": med,
            "ratio": ratio,
            "paired_ratio": paired,
            "losses": losses,
            "bubble": b_raw,
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
