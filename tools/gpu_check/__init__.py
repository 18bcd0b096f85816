"""The sections of ``tools/gpu_check.py`` (``make gpu-check``) and what they share.

Every section is a module with ``NAME``, ``TITLE``, ``SHARE`` (its part of the time budget) and
``run(ctx, out)``, which fills a :class:`~gpu_check.report.SectionResult`. The benchmarks'
helpers (``tools/bench/common.py``: interleaved timing, the plain-PyTorch reference GPT) are
imported as ``bench.common``, beside this package in ``tools/``.
"""
