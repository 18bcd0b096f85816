"""``python -m megatronish.plan [+experiment=NAME] [key=value ...] [world_size=N] [options]``.

Takes the same overrides as ``megatronish.train`` and prints, without allocating anything, what
every rank of the layout will hold and do. Planner options (not part of the training config):

- ``world_size=N``: ranks to plan for (default: tp * pp * (parallel.dp or 1));
- ``device=NAME``: a GPU of the table in ``megatronish/plan/devices.py`` (``h100``, ``h200``,
  ``a100``, ``a100-40gb``, ...): its memory and peak for ``device_memory_gb`` and ``peak_tflops``
  unless those are given;
- ``device_memory_gb=G``: per-device memory to check against (default: this machine's GPU, or
  its available RAM divided by the ranks on a CPU);
- ``peak_tflops=T``: per-device peak for MFU lines (default: trainer.peak_tflops or the GPU table);
- ``step_time_s=S``: report the MFU a step of S seconds would need;
- ``advise=true``: instead, rank every valid layout of the model on ``world_size`` ranks that
  fits, by an estimated step time, and optionally write the fastest as a ``parallel`` group
  file (``advise_out=configs/parallel/advised.yaml``); its options are in
  ``megatronish/plan/advise_cli.py`` and ``docs/performance.md`` ("Choosing a layout").

Exit codes: 0 fits (or no memory given), 1 does not fit, 2 invalid config or option.
"""

from __future__ import annotations

import sys

from megatronish.plan.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
