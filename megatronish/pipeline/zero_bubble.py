"""Zero-bubble schedules (Qi et al., 2023, "Zero Bubble Pipeline Parallelism") as compute orders.

Each backward is split into B (``bwd_input``: the gradient w.r.t. the chunk's input, which the
previous chunk waits for) and W (``bwd_weight``: the weight gradients, which nobody waits for);
W fills what would otherwise be bubble.

- **ZB-H1** (the paper's handcrafted schedule with 1F1B's memory, sec. 3.1): 1F1B's warm-up
  (``pp - r - 1`` forwards on rank r), then one forward and one B per step; rank r holds its
  first ``r`` W back and afterwards runs the oldest W after each B, so at most ``pp`` microbatches
  are in flight (forward run, W not yet) on any rank, as in 1F1B; the held-back W fill the
  cool-down. The bubble is ``(pp - 1)(F + B - W)`` against 1F1B's ``(pp - 1)(F + B + W)``.
- **ZBV** (sec. 6): two chunks per rank in a V, chunk ``r`` and chunk ``2 pp - 1 - r`` on rank r,
  so the last chunk (the head) sits on rank 0 beside the embedding and the turn from chunk
  ``pp - 1`` to chunk ``pp`` stays on rank ``pp - 1``. The order is torch pipelining's
  ``ScheduleZBVZeroBubble``: a warm-up of ``2 (pp - r) - 1`` forwards of the first chunk, ``r``
  pairs of forwards, ``pp - r`` rounds of forward, B and W of the second chunk, a steady state of
  F, B, W on each chunk, and a cool-down of Bs whose W run last. With equal F, B and W times its
  bubble is ``(pp - 1)(F + B - 2W)`` per stage: none.

Nothing here touches processes or tensors; :mod:`megatronish.pipeline.simulate` proves the
dependencies, the in-flight count and the bubble.
"""

from __future__ import annotations

from megatronish.pipeline.ops import Op


def zb_h1_order(pp: int, num_microbatches: int, rank: int) -> list[Op]:
    """ZB-H1's compute ops on ``rank`` (one chunk per rank: chunk = rank)."""
    m = num_microbatches
    warmup = min(pp - rank - 1, m)
    order = [Op("fwd", k, rank) for k in range(warmup)]
    next_w = 0

    def backward(k: int) -> list[Op]:
        nonlocal next_w
        ops = [Op("bwd_input", k, rank)]
        if k >= rank:  # rank r keeps r W back to fill its cool-down
            ops.append(Op("bwd_weight", next_w, rank))
            next_w += 1
        return ops

    for k in range(m - warmup):
        order.append(Op("fwd", warmup + k, rank))
        order += backward(k)
    for k in range(m - warmup, m):
        order += backward(k)
    order += [Op("bwd_weight", k, rank) for k in range(next_w, m)]
    return order


def zbv_order(pp: int, num_microbatches: int, rank: int) -> list[Op]:
    """ZBV's compute ops on ``rank``: chunks ``rank`` (first leg) and ``2 pp - 1 - rank``."""
    m = num_microbatches
    n = max(2 * pp - 1, m)  # the pattern for enough microbatches; the ones past m are dropped
    first, second = rank, 2 * pp - 1 - rank
    f0 = f1 = b0 = b1 = 0
    order: list[Op] = []

    def add(kind: str, microbatch: int, chunk: int) -> None:
        order.append(Op(kind, microbatch, chunk))

    for _ in range(2 * (pp - rank) - 1):
        add("fwd", f0, first)
        f0 += 1
    for _ in range(rank):
        add("fwd", f1, second)
        f1 += 1
        add("fwd", f0, first)
        f0 += 1
    for _ in range(pp - rank):
        add("fwd", f1, second)
        f1 += 1
        add("bwd_input", b1, second)
        add("bwd_weight", b1, second)
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            add("fwd", f0, first)
            f0 += 1
        add("bwd_input", b0, first)
        add("bwd_weight", b0, first)
        b0 += 1
        add("fwd", f1, second)
        f1 += 1
        add("bwd_input", b1, second)
        add("bwd_weight", b1, second)
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        add("bwd_input", b0, first)
        b0 += 1
        add("bwd_input", b1, second)
        b1 += 1
    for _ in range(pp - rank):
        add("bwd_input", b0, first)
        b0 += 1
        add("bwd_weight", w0, first)
        w0 += 1
    order += [Op("bwd_weight", k, second) for k in range(w1, b1)]
    order += [Op("bwd_weight", k, first) for k in range(w0, b0)]
    return [op for op in order if op.microbatch < m]
