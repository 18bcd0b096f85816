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
    taken: dict[tuple[str, int], int] = {}  # ops of each (kind, chunk) so far
    order: list[Op] = []

    def count(kind: str, chunk: int) -> int:
        return taken.get((kind, chunk), 0)

    def add(kind: str, chunk: int) -> None:  # the next microbatch of that kind and chunk
        order.append(Op(kind, count(kind, chunk), chunk))
        taken[(kind, chunk)] = count(kind, chunk) + 1

    def backward_then_weights(chunk: int) -> None:
        add("bwd_input", chunk)
        add("bwd_weight", chunk)

    for _ in range(2 * (pp - rank) - 1):
        add("fwd", first)
    for _ in range(rank):
        add("fwd", second)
        add("fwd", first)
    for _ in range(pp - rank):
        add("fwd", second)
        backward_then_weights(second)
    while count("fwd", second) < count("fwd", first) or count("fwd", first) < n:
        if count("fwd", first) < n:
            add("fwd", first)
        backward_then_weights(first)
        add("fwd", second)
        backward_then_weights(second)
    for _ in range(rank):  # cool-down: B alone, their W last
        add("bwd_input", first)
        add("bwd_input", second)
    for _ in range(pp - rank):
        backward_then_weights(first)
    for chunk in (second, first):
        while count("bwd_weight", chunk) < count("bwd_input", chunk):
            add("bwd_weight", chunk)
    return [op for op in order if op.microbatch < m]
