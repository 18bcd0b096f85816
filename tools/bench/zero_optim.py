"""Thread-CPU time of the optimizer-side work of one step: megatronish vs torch (1 thread).

megatronish's ``ShardedAdamW`` calls torch's fused AdamW kernel on the decayed and the
undecayed runs of its flat bucket shards; ``torch.optim.AdamW`` (CPU default: a per-parameter
loop) runs about ten tensor ops per parameter; one ``torch._fused_adamw_`` call over the whole
shards (decay on every element) is the lower bound for a one-pass update.
The grad-norm pair is ``ZeroDataParallel.grad_norm`` (over ranges) vs ``clip_grad_norm_``. Every
candidate runs on the tiny model's real buffers (zero 0, one process), interleaved, medians.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from common import median, threads
from mish import build_run
from zero_peers import plain_run


def _thread_ms(fn: Callable[[], object], calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls * 1000


def _fused_step(shards, state, lr: float, cfg) -> None:
    """One fused AdamW call over the whole flat shards (decay on every element: a cost bound)."""
    o = cfg.optimizer
    params, grads, m, v, steps = state
    for s in steps:
        s += 1
    torch._fused_adamw_(
        params, grads, m, v, [], steps, amsgrad=False, lr=lr, beta1=o.beta1, beta2=o.beta2,
        weight_decay=o.weight_decay, eps=o.eps, maximize=False,
    )  # fmt: skip


def measure(extra: list[str], repeats: int = 7, calls: int = 10) -> dict[str, float]:
    """Median milliseconds (thread CPU) per call of each candidate."""
    with threads(1):
        mish = build_run(extra)
        ref = plain_run(mish.cfg, mish.spec, mish.data, extra)
        mish.step(), ref.step()  # grads and optimizer state exist from here on
        zero, opt, lr = mish.trainer.zero, mish.trainer.optimizer, mish.cfg.optimizer.lr
        shards = zero.optimizer_shards()
        flat = [s[0].detach().clone() for s in shards]
        state = (
            flat, [s[1] for s in shards], [torch.zeros_like(t) for t in flat],
            [torch.zeros_like(t) for t in flat], [torch.zeros(()) for _ in flat],
        )  # fmt: skip
        params = [p for p in ref.model.parameters() if p.grad is not None]
        candidates = {
            "megatronish ShardedAdamW.step": lambda: opt.step(shards, lr),
            "torch.optim.AdamW.step (per-parameter loop)": ref.optimizer.step,
            "torch._fused_adamw_, one call over the whole shards": lambda: _fused_step(
                shards, state, lr, mish.cfg
            ),
            "megatronish ZeroDataParallel.grad_norm": zero.grad_norm,
            "torch clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, 1e9),
        }
        times: dict[str, list[float]] = {n: [] for n in candidates}
        for r in range(repeats):
            for name in candidates if r % 2 == 0 else reversed(list(candidates)):
                times[name].append(_thread_ms(candidates[name], calls))
    return {n: median(ts) for n, ts in times.items()}
