"""Calibration probes of the layout advisor's step-time model on this machine.

- compute: the best one-thread fp32 matmul FLOP/s (``measure_matmul_peak``);
- network: a forked 2-rank gloo world times all-reduces of 128 KiB to 4 MiB, the sizes of the
  validation layouts' messages (a 2-rank ring moves each byte once), and the model's latency
  and bandwidth are the line ``time = latency + bytes / bandwidth`` through them with the
  least squared relative errors. gloo's cost per call at these sizes is far above its
  small-message latency, which a ping-pong of one float also measures (reported, not used).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megatronish.testing.multiproc import run_world
from megatronish.training.peaks import measure_matmul_peak

MATMUL = 1024
SIZES = (1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 22)  # bytes


def matmul_probe(repeats: int = 3) -> float:
    """The best one-thread fp32 matmul FLOP/s over a few probes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return max(measure_matmul_peak(MATMUL, 5) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _network_rank(rank: int, world: int, repeats: int) -> dict:
    msg, peer = torch.zeros(1), 1 - rank

    def ping_pong() -> None:
        for _ in range(10):
            if rank == 0:
                dist.send(msg, peer)
                dist.recv(msg, peer)
            else:
                dist.recv(msg, peer)
                dist.send(msg, peer)

    out = {"ping_pong_s": _timed(ping_pong, repeats) / 20}  # one way
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)  # warm-up
        out[nbytes] = _timed(lambda x=x: dist.all_reduce(x), repeats)
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``y = a + b x`` with the least squared relative residuals: (a, b)."""
    w = [1 / y**2 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    num = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
    b = num / sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    return my - b * mx, b


def network_probe(repeats: int = 25) -> dict:
    """Latency (s) and bandwidth (bytes/s) of gloo between two ranks on a core each."""
    results = run_world(_network_rank, 2, repeats)
    times = {n: max(r[n] for r in results) for n in SIZES}
    latency, per_byte = fit_line(list(SIZES), [times[n] for n in SIZES])
    return {
        "all_reduce_s": {str(n): t for n, t in times.items()},
        "ping_pong_s": max(r["ping_pong_s"] for r in results),
        "latency_s": max(latency, 0.0),
        "bandwidth": 1 / per_byte,
    }
