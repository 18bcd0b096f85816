"""The sections of ``tools/gpu_check.py`` (``make gpu-check``) and what they share.

Every section is a module with ``NAME``, ``TITLE``, ``SHARE`` (its part of the time budget) and
``run(ctx, out)``, which fills a :class:`~gpu_check.report.SectionResult`. The benchmarks'
helpers (``tools/bench``: interleaved timing, the plain-PyTorch reference GPT) are importable
once this package is.
"""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))
