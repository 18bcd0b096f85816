"""``trainer.profile.steps=[a,b]``: a torch.profiler trace of steps a..b, one file per rank.

The profiler starts before step ``a`` and is stopped after step ``b`` (or when training ends
first); each rank then writes ``<trainer.profile.dir>/rank<NNNNN>.json``, a Chrome trace that
Perfetto (ui.perfetto.dev) and chrome://tracing open. While it records, the step code's timer
regions also emit named ranges (``forward mb3 chunk1``, ``send act ...``, ``reduce-scatter ...``,
``optimizer``), and each step is one ``step N`` range. No collective is involved.
"""

from __future__ import annotations

import os

import torch

from megatronish.distributed.timers import Timers


def trace_path(profile_dir: str, rank: int) -> str:
    """The trace file of ``rank``."""
    return os.path.join(profile_dir, f"rank{rank:05d}.json")


def profiler_activities(device: torch.device) -> list:
    """CPU always; CUDA kernels too on a GPU."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


class StepProfiler:
    """Starts, stops and exports the profile of a step range; a no-op without ``steps``.

    ``steps`` is ``[first, last]`` (1-based step numbers, as logged). A run resumed inside the
    range profiles the steps it runs. ``timers.ranges`` is switched on while recording.
    """

    def __init__(
        self,
        steps: list[int] | None,
        profile_dir: str,
        rank: int,
        device: torch.device,
        timers: Timers,
    ):
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.path = trace_path(profile_dir, rank)
        self.device, self.timers = device, timers
        self.prof = None
        self.step_range = None
        self.written: str | None = None

    def before_step(self, step: int) -> None:
        """Call before running step number ``step``."""
        if self.prof is None and self.written is None and self.first <= step <= self.last:
            self.prof = torch.profiler.profile(activities=profiler_activities(self.device))
            self.prof.start()
            self.timers.ranges = True
        if self.prof is not None:
            self.step_range = torch.profiler.record_function(f"step {step}")
            self.step_range.__enter__()

    def after_step(self, step: int) -> str | None:
        """Call after step ``step``; returns the trace path when this step ended the profile."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.prof is not None and step >= self.last:
            return self.finish()
        return None

    def finish(self) -> str | None:
        """Stop and write the trace if one is recording (training ended inside the range)."""
        if self.prof is None:
            return None
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        self.timers.ranges = False
        self.prof.stop()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.prof.export_chrome_trace(self.path)
        self.prof, self.written = None, self.path
        return self.path
