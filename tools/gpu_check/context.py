"""What every section of the GPU check shares: the device, the precision, the model shape,
the time budget, and a one-process megatronish trainer on synthetic data.

The model is ``configs/experiment/gpt_1b.yaml``'s shape (with a 32k vocabulary) at tp = pp = 1 in
bf16 on a GPU; ``--smoke`` keeps its head and feed-forward ratios at toy size, in fp32 on the CPU.
Data is :class:`~megatronish.testing.synthetic.PatternTokens` (no files, no network).
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass, field

import torch

from megatronish.config.compose import load_config
from megatronish.config.schema import TrainConfig
from megatronish.plan.devices import gpu_for_cuda_name
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.testing.runs import trainer_for
from megatronish.training.peaks import device_peak_flops
from megatronish.training.precision import apply_fp32_matmul_setting
from megatronish.training.trainer import Trainer

GiB = 2**30
FULL_SHAPE = ["+experiment=gpt_1b", "model.vocab_size=32000"]
# The same kv-head and feed-forward ratios (8/16, 5504/2048) at toy size.
TOY_SHAPE = [
    "+experiment=gpt_1b",
    "model.vocab_size=512",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=172",
    "model.seq_length=64",
]
# One process, nothing but training in a step, a constant learning rate (the reference follows
# the same run). Every build names its batch (:func:`batch`).
RUN = [
    "parallel.tp=1",
    "parallel.pp=1",
    "parallel.sp=false",
    "parallel.zero_stage=0",
    "trainer.max_steps=1000000",
    "trainer.eval_interval=0",
    "scheduler.style=constant",
    "scheduler.warmup_steps=0",
    "logging.wandb=false",
    "logging.log_interval=1000000",
    "checkpoint.dir=null",
]


def gib(n: float) -> str:
    """Bytes in GiB, with more digits for small sizes (toy models)."""
    return f"{n / GiB:.1f}" if n >= 10 * GiB else f"{n / GiB:.3g}"


def batch(micro_batch_size: int, microbatches: int = 1) -> list[str]:
    """Overrides for a step of ``microbatches`` micro batches of ``micro_batch_size``."""
    return [
        f"trainer.micro_batch_size={micro_batch_size}",
        f"trainer.global_batch_size={micro_batch_size * microbatches}",
    ]


@dataclass
class Built:
    """A ready-to-step trainer and the RNG tracker its model uses."""

    cfg: TrainConfig
    trainer: Trainer
    rng: RNGTracker

    @property
    def spec(self) -> ModelSpec:
        return self.trainer.spec


def build_trainer(cfg: TrainConfig, device: torch.device) -> Built:
    """A one-process Trainer for ``cfg`` on ``device`` with synthetic data; its checkpoints
    hold its RNG streams (as a run's do)."""
    apply_fp32_matmul_setting(device, cfg.trainer.tf32)
    trainer, rng = trainer_for(cfg, 0, 1, device, checkpoint_rng=True)
    return Built(cfg, trainer, rng)


@dataclass
class CheckContext:
    """The run's settings and clock (see the module docstring)."""

    device: torch.device
    smoke: bool
    budget_s: float
    peak_tflops: float | None = None  # --peak-tflops; None: the device table or a CPU probe
    device_memory_gb: float | None = None  # --device-memory-gb; None: the device's own
    # trainer.precision: bf16 whenever CUDA runs; fp32 on the CPU (its bf16 matmuls are slow)
    precision: str = ""
    start: float = field(default_factory=time.monotonic)
    # Set by the runner (gpu_check.run): the selected sections' fixed seconds and timing shares
    # in all, and the fixed seconds of those after the running one.
    fixed_s: float = 0.0
    shares: float = 1.0
    reserved_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.precision:
            self.precision = "bf16" if self.cuda else "fp32"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def shape(self) -> list[str]:
        return TOY_SHAPE if self.smoke else FULL_SHAPE

    @property
    def micro_batch_size(self) -> int:
        """gpt_1b's micro batch (4), or 2 at toy size."""
        return 2 if self.smoke else 4

    @functools.cached_property
    def peak(self) -> tuple[float | None, str]:
        """(peak FLOP/s of the device for MFU or None, where it comes from)."""
        flops = device_peak_flops(self.device, self.precision, self.peak_tflops)
        if self.peak_tflops:
            return flops, f"--peak-tflops {self.peak_tflops:g}"
        if not self.cuda:
            return flops, f"CPU fp32 matmul probe, {flops / 1e9:.0f} GFLOP/s"
        gpu = gpu_for_cuda_name(torch.cuda.get_device_name(self.device))
        if gpu is None:
            return None, "this GPU is not in the device table: give --peak-tflops for MFU"
        return flops, f"device table: {gpu.title}, {flops / 1e12:g} TFLOP/s dense {self.precision}"

    def mfu(self, flops_per_step: float, step_s: float) -> str:
        peak = self.peak[0]
        return f"{flops_per_step / step_s / peak:.1%}" if peak else "n/a"

    # -- timing ------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def plan(self, fixed: list[float], shares: list[float]) -> None:
        """The run's sections: their fixed seconds and timing shares (see :meth:`share`)."""
        self.fixed_s, self.shares = sum(fixed), sum(shares) or 1.0

    def share(self, fraction: float) -> float:
        """Seconds of timed steps a section with ``SHARE`` ``fraction`` may use: that part (of
        the run's shares) of what the run's fixed seconds leave of the budget, within what is
        left once the later sections' fixed seconds are set aside."""
        pool = max(0.0, self.budget_s - self.fixed_s) * fraction / self.shares
        return max(0.0, min(pool, self.remaining() - self.reserved_s))

    @property
    def warmup(self) -> int:
        return 1 if self.smoke else 3

    @property
    def steps_per_repeat(self) -> int:
        return 1 if self.smoke else 2

    @property
    def max_repeats(self) -> int:
        return 3 if self.smoke else 15

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- building ----------------------------------------------------------------------------
    def config(self, extra: list[str] | None = None):
        """The composed config: the shape, the run settings, device and precision, ``extra``."""
        device = [f"trainer.device={self.device.type}", f"trainer.precision={self.precision}"]
        return load_config([*self.shape, *RUN, *device, *(extra or [])])

    def build(self, extra: list[str] | None = None) -> Built:
        return build_trainer(self.config(extra), self.device)

    def small(self, microbatches: int = 1) -> list[str]:
        """Overrides for a two-layer model of the shape (kernel and resume checks)."""
        if self.smoke:
            return batch(self.micro_batch_size, microbatches)
        return ["model.num_layers=2", *batch(1, microbatches)]

    def release(self) -> None:
        """Free what the last section left (its objects must be gone already)."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def step(self, built: Built):
        """One optimizer step that ends when the device is done."""
        result = built.trainer.train_step()
        self.sync()
        return result
