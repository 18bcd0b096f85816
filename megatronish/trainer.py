"""The training loop: microbatches -> forward/backward -> grad sync -> clip -> step -> log."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from megatronish.config.derived import Derived
from megatronish.distributed.comm import all_reduce
from megatronish.distributed.topology import Topology
from megatronish.metrics import flops_per_token, peak_memory_bytes
from megatronish.model.spec import ModelSpec
from megatronish.optim.adamw import build_adamw
from megatronish.optim.data_parallel import DataParallelGrads
from megatronish.optim.grads import clip_grads, global_grad_norm, sync_model_parallel_grads
from megatronish.optim.lr_schedule import schedule_from_config
from megatronish.pipeline.no_pipeline import forward_backward_no_pipeline
from megatronish.progress import ProgressLogger


@dataclass
class StepResult:
    step: int
    loss: float  # mean over the global batch; nan on ranks without the loss
    grad_norm: float
    lr: float
    skipped: bool


@dataclass
class TrainState:
    """What resume needs besides model and optimizer tensors."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    history: list[StepResult] = field(default_factory=list)


class Trainer:
    """Runs optimizer steps over a sample stream addressed by a global cursor."""

    def __init__(
        self,
        cfg,
        topo: Topology,
        spec: ModelSpec,
        derived: Derived,
        chunks: list[nn.Module],
        train_data,
        valid_data=None,
        *,
        logger: ProgressLogger | None = None,
        peak_flops: float | None = None,
        forward_backward=None,
    ):
        self.cfg, self.topo, self.spec, self.derived = cfg, topo, spec, derived
        self.chunks = chunks
        self.train_data, self.valid_data = train_data, valid_data
        self.logger = logger or ProgressLogger(cfg, enabled=False, run_dir=".")
        self.peak_flops = peak_flops
        self.optimizer = build_adamw(chunks, cfg.optimizer)
        self.lr_at = schedule_from_config(cfg.optimizer, cfg.scheduler, cfg.trainer.max_steps)
        self.dp_grads = DataParallelGrads(chunks, topo.dp_group)
        self.forward_backward = forward_backward or forward_backward_no_pipeline
        self.state = TrainState()
        self.holds_loss = topo.is_last_stage
        self.flops_per_step = flops_per_token(spec) * derived.tokens_per_step

    # -- data -------------------------------------------------------------------------------
    def microbatches(self, data, first_sample: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's microbatches of the global batch that starts at ``first_sample``."""
        t = self.cfg.trainer
        per_rank = t.global_batch_size // self.topo.dp
        start = first_sample + self.topo.coords.dp * per_rank
        out = []
        for m in range(self.derived.num_microbatches):
            first = start + m * t.micro_batch_size
            batch = torch.stack([data[i] for i in range(first, first + t.micro_batch_size)])
            batch = batch.to(self.topo.device, non_blocking=True)
            out.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        return out

    def autocast(self):
        if self.cfg.trainer.precision == "bf16":
            return torch.autocast(self.topo.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- one step ---------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        step = self.state.step
        for c in self.chunks:
            c.train()
        batches = self.microbatches(self.train_data, self.state.consumed_samples)
        self.optimizer.zero_grad(set_to_none=False)
        losses = self.forward_backward(
            self.chunks,
            batches,
            loss_scale=1.0 / len(batches),
            autocast=self.autocast,
            on_last_backward=self.dp_grads.start_last_microbatch,
        )
        sync_model_parallel_grads(self.chunks, self.topo)
        self.dp_grads.reduce()
        loss = self._mean_loss(losses)
        norm = global_grad_norm(self.chunks, self.topo).item()
        lr = self.lr_at(step)
        skipped = not math.isfinite(norm)
        if skipped:  # the optimizer state is left untouched
            self.state.skipped_steps += 1
        else:
            clip_grads(self.chunks, torch.tensor(norm), self.cfg.optimizer.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.state.step += 1
        self.state.consumed_samples += self.cfg.trainer.global_batch_size
        return StepResult(step=step + 1, loss=loss, grad_norm=norm, lr=lr, skipped=skipped)

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """Mean loss of the global batch on last-stage ranks (nan elsewhere)."""
        if not self.holds_loss or not losses:
            return float("nan")
        mean = torch.stack(losses).float().mean()
        all_reduce(mean, self.topo.dp_group)
        return (mean / self.topo.dp).item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``trainer.eval_iters`` global batches."""
        if self.valid_data is None or self.topo.pp > 1:
            return float("nan")
        for c in self.chunks:
            c.eval()
        losses = []
        for i in range(self.cfg.trainer.eval_iters):
            first = i * self.cfg.trainer.global_batch_size
            for inputs, targets in self.microbatches(self.valid_data, first):
                with self.autocast():
                    losses.append(self.chunks[0](inputs, targets).detach())
        return self._mean_loss(losses)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> list[StepResult]:
        """Train until ``trainer.max_steps``; returns the results of the steps run here."""
        t, log_every = self.cfg.trainer, self.cfg.logging.log_interval
        window_start, window_steps = time.perf_counter(), 0
        while self.state.step < t.max_steps:
            result = self.train_step()
            self.state.history.append(result)
            window_steps += 1
            step = result.step
            if step % log_every == 0 or step == t.max_steps or step == 1:
                elapsed = time.perf_counter() - window_start
                self._log(result, elapsed / window_steps)
                window_start, window_steps = time.perf_counter(), 0
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
                self.logger.log_eval(step, self.evaluate())
                window_start = time.perf_counter()
        return self.state.history

    def _log(self, r: StepResult, step_time: float) -> None:
        tokens_per_s = self.derived.tokens_per_step / step_time
        mfu = None
        if self.peak_flops:
            mfu = self.flops_per_step / step_time / (self.peak_flops * self.topo.world_size)
        self.logger.log_step(
            {
                "step": r.step,
                "loss": r.loss,
                "lr": r.lr,
                "grad_norm": r.grad_norm,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "step_time_s": step_time,
                "peak_memory": peak_memory_bytes(self.topo.device),
                "skipped_steps": self.state.skipped_steps,
            }
        )
