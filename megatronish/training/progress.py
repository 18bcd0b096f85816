"""Console progress, the run's log file and wandb, from the rank that holds the loss.

Console lines are plain text (one line per log interval, flushed), readable in a SLURM log file;
a second line breaks the step time down by timer (``docs/performance.md``). The same lines go to
``logging.log_file`` (default ``<out_dir>/train.log``, appended across resumes), each with the
wall-clock time; ``logging.progress_bar=true`` adds a tqdm bar on a terminal.
wandb runs online when ``WANDB_API_KEY`` is set, offline otherwise, and can be disabled with
``logging.wandb=false`` or ``WANDB_MODE=disabled`` (the test suite does this).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from typing import Any

from megatronish.config.schema import TrainConfig


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_startup_memory(peak: int, what: str, steps: str) -> str:
    """The line printed once, before the first step: the start-up's peak memory (model, ZeRO
    state, a loaded checkpoint), ``what`` it measures, and what the steps' ``mem`` is."""
    return f"start-up peak memory {fmt_bytes(peak)} ({what}); mem on step lines: {steps}"


def fmt_duration(seconds: float) -> str:
    """``3d04h``, ``2h05m``, ``4m07s``, ``12s``."""
    s = int(round(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def format_step(m: dict[str, Any], max_steps: int) -> str:
    """One console line for a logged step: ``tokens_per_s`` is global (every rank's tokens),
    ``tokens_per_s_per_device`` (shown when the run has more than one device) divides it by
    the world size; the ETA assumes the remaining steps take this line's ``step_time_s``."""
    parts = [f"step {m['step']:>6d}/{max_steps}", f"loss {m['loss']:.4f}"]
    parts.append(f"lr {m['lr']:.2e}")
    parts.append(f"grad {m['grad_norm']:.3f}")
    if "moe/aux_loss" in m:  # mixture of experts: the router losses and the load per expert
        parts.append(f"aux {m['moe/aux_loss']:.4f} z {m['moe/z_loss']:.4f}")
        mean = m["moe/tokens_per_expert_mean"]
        parts.append(f"expert load max/mean {m['moe/tokens_per_expert_max'] / max(mean, 1):.2f}")
        if m.get("moe/dropped_tokens"):
            parts.append(f"dropped {m['moe/dropped_tokens']:,.0f}")
    per_device = m.get("tokens_per_s_per_device")
    if per_device is not None and per_device != m["tokens_per_s"]:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s ({per_device:,.0f} tok/s/dev)")
    else:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    parts.append(f"{m['step_time_s']:.2f} s/step")
    parts.append(f"mem {fmt_bytes(m['peak_memory'])}")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    if m["step"] < max_steps:
        parts.append(f"ETA {fmt_duration((max_steps - m['step']) * m['step_time_s'])}")
    return " | ".join(parts)


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def format_timers(m: dict[str, Any]) -> str | None:
    """The step-time breakdown line: ``name max/min`` ms per step over ranks, non-zero timers."""
    parts = []
    for key, hi in m.items():
        if key.startswith("time/") and key.endswith("_max_ms") and hi > 0:
            name = key[len("time/") : -len("_max_ms")]
            parts.append(f"{name} {_ms(hi)}/{_ms(m[f'time/{name}_min_ms'])}")
    if not parts:
        return None
    return "  ms/step max/min over ranks: " + " | ".join(parts)


class RunLog:
    """``logging.log_file``: the logged lines, each after its wall-clock time, appended (a
    resumed run continues the file; a line marks each start)."""

    def __init__(self, path: str, run_id: str | None):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - kept open
        self.write(f"=== start of run {run_id or ''} (pid {os.getpid()}) ===")

    def write(self, line: str) -> None:
        stamp = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S")
        for part in line.splitlines() or [""]:
            self._file.write(f"{stamp} {part}\n")

    def close(self) -> None:
        self._file.close()


class ProgressLogger:
    """Prints, writes the log file and (optionally) sends metrics to wandb; a no-op on ranks
    that do not log."""

    def __init__(
        self,
        cfg: TrainConfig,
        enabled: bool,
        run_dir: str,
        run_id: str | None = None,
        bar_file=None,
    ):
        """``bar_file``: where ``logging.progress_bar`` draws (default: stderr, when it is a
        terminal)."""
        self.enabled = enabled
        self.max_steps = cfg.trainer.max_steps
        self.wandb_run = None
        self.start = time.time()
        log_file = cfg.logging.get("log_file")
        self.run_log = RunLog(log_file, run_id) if enabled and log_file else None
        self.bar = None
        if enabled and cfg.logging.get("progress_bar"):
            from tqdm import tqdm

            # disable=None: shown on a terminal only (a SLURM log gets the plain lines)
            self.bar = tqdm(
                total=self.max_steps,
                unit="step",
                file=bar_file,
                disable=None if bar_file is None else False,
            )
        if enabled and cfg.logging.wandb and os.environ.get("WANDB_MODE") != "disabled":
            self.wandb_run = self._start_wandb(cfg, run_dir, run_id)

    @staticmethod
    def _start_wandb(cfg: TrainConfig, run_dir: str, run_id: str | None):
        try:
            import wandb
            from omegaconf import OmegaConf
        except ImportError:  # pragma: no cover - wandb is a dependency
            return None
        mode = cfg.logging.wandb_mode or os.environ.get("WANDB_MODE")
        if mode is None:
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        os.makedirs(run_dir, exist_ok=True)
        return wandb.init(
            project=cfg.logging.wandb_project,
            name=cfg.name,
            id=run_id,
            resume="allow",
            dir=run_dir,
            mode=mode,
            config=OmegaConf.to_container(cfg, resolve=True),
        )

    @property
    def run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def _emit(self, line: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(line)  # above the bar
        else:
            print(line, flush=True)
        if self.run_log is not None:
            self.run_log.write(line)

    def info(self, msg: str) -> None:
        if self.enabled:
            self._emit(msg)

    def log_step(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._emit(format_step(metrics, self.max_steps))
        timers = format_timers(metrics)
        if timers:
            self._emit(timers)
        if self.bar is not None:
            self.bar.update(metrics["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            self.bar.refresh()  # once per logged step: tqdm's own rate limit would skip it
        if self.wandb_run is not None:
            logged = {k if "/" in k else f"train/{k}": v for k, v in metrics.items()}
            self.wandb_run.log(logged, step=metrics["step"])

    def log_eval(self, step: int, loss: float, per_dataset: dict[str, float] | None = None) -> None:
        """The validation loss (and, for a blend, each dataset's)."""
        if not self.enabled:
            return
        per_dataset = per_dataset or {}
        parts = [f"valid loss {loss:.4f}", *(f"{k} {v:.4f}" for k, v in per_dataset.items())]
        self._emit(f"eval   step {step:>6d} | " + " | ".join(parts))
        if self.wandb_run is not None:
            metrics = {"valid/loss": loss, **{f"valid/{k}": v for k, v in per_dataset.items()}}
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.run_log is not None:
            self.run_log.close()
            self.run_log = None
        sys.stdout.flush()
