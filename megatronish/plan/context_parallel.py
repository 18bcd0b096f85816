"""Context parallelism (``parallel.cp``) in the plan: each sequence split over ``cp`` ranks.

- **Tokens**: every per-rank term counts the rank's ``s = seq / cp`` tokens of each sequence
  (:func:`rank_seq_length`; the load-balanced split gives every cp rank the same causal
  attention work).
- **Activations**: attention also keeps the whole sequence's K and V, gathered over cp
  (``cp s b 2g d``, :func:`gathered_kv_bytes`); the attention kernel runs with a mask of the
  rank's queries against the whole sequence (:func:`attention_mask`), and K/V expanded for a
  fused kernel span the whole sequence (:func:`kv_length`).
- **Communication** (:func:`cp_volume`): per layer and microbatch one all-gather of k|v (the
  whole sequence's ``[s, b, 2 kv_heads / tp, d]``) in forward, repeated when full recompute
  reruns the layer, and one reduce-scatter of their grads in backward. Both sit between computes
  (never hidden: the step time's ``cp`` term). Grads are reduced, and ZeRO shards spread, over
  dp x cp (:mod:`~megatronish.plan.data_parallel`).
- **All-to-all** (``parallel.cp_comm_type=a2a``): no K/V is gathered; each layer exchanges the
  rank's ``[s, b, (a + 2g) / tp, d]`` q|k|v for the whole sequence of ``1 / cp`` of the heads and
  the ``[s, b, a / tp, d]`` output back (forward, recompute's reruns, and both again in
  backward). Attention then runs causal over the whole sequence for ``a / cp`` heads: the same
  scores, no gathered K/V kept, and the exchanged q|k|v and output are what attention keeps
  (:func:`exchanged_bytes`).
- **Ring** (``parallel.cp_comm_type=ring``): no K/V is gathered; each layer's forward (and every
  rerun: full recompute's, and selective recompute's, which reruns the core) sends its
  ``[b, 2g, s, d]`` K|V block on ``cp - 1`` times and receives as many; backward sends K|V
  ``cp - 1`` times and the dK|dV accumulators (fp32, :func:`ring_accumulator_bytes`) ``cp``
  times. Attention keeps its output and the rows' log-sum-exp; its backward allocates the
  fp32 dQ and accumulators and, where the blocks run the plain-matmul kernel (fp32 on CUDA,
  packed documents on CUDA: :func:`ring_block_kernel`), two fp32 score tiles of at most
  ``MATH_TILE_BYTES`` (:func:`ring_workspace`). Each step's
  transfers overlap that step's block of attention (``1 / cp`` of the layer's attention work,
  twice that in backward): :func:`ring_overlap_time` credits the shorter of the two per step
  (none on shared CPU cores); backward's last hop of the accumulators is exposed.
- **All-to-all, then a ring** (``parallel.cp_comm_type=a2a_ring``, ``cp_a2a_size = k``): the
  all-to-all's exchange inside each group of ``k`` consecutive cp ranks (the ``cp_a2a`` group;
  the same bytes per rank as a2a's, ``k`` ranks), then a ring over the ``cp / k`` groups (the
  ``cp_ring`` group, spanning the whole cp group's ranks) whose member holds ``k s`` tokens of
  ``1 / k`` of the heads: the same block bytes as the ring's, ``cp / k - 1`` forward steps and
  ``2 cp / k - 1`` backward, each block ``k`` times the ring's attention. Memory: what the
  all-to-all keeps (the exchanged q|k|v and the output brought back), no gathered K/V.
"""

from __future__ import annotations

import torch

from megatronish.context_parallel.ring_kernel import block_kernel, math_tile_rows
from megatronish.plan.hardware import Hardware, comm_time
from megatronish.plan.layout import Layout
from megatronish.plan.recompute import core_reruns, reruns
from megatronish.spec import ModelSpec


def rank_seq_length(spec: ModelSpec, layout: Layout) -> int:
    """``s``: the tokens of each sequence a rank computes (its cp rank's share)."""
    return spec.seq_length // layout.cp


def heads_exchanged(layout: Layout) -> bool:
    """Whether attention runs on more of the sequence for fewer heads (all-to-all: the whole
    sequence of ``1 / cp`` of them; a2a_ring: ``k s`` tokens of ``1 / k``)."""
    return layout.cp > 1 and layout.cp_comm_type in ("a2a", "a2a_ring")


def ring(layout: Layout) -> bool:
    """Whether K/V blocks travel a ring (nothing gathered, attention per block)."""
    return layout.cp > 1 and layout.cp_comm_type in ("ring", "a2a_ring")


def exchange_group(layout: Layout) -> str:
    """The CommStats name of the group that exchanges heads: cp's or a2a_ring's cp_a2a."""
    return layout.group("cp_a2a") if layout.cp_comm_type == "a2a_ring" else "cp"


def ring_group(layout: Layout) -> str:
    """The CommStats name of the ring's group: cp's or a2a_ring's cp_ring."""
    return layout.group("cp_ring") if layout.cp_comm_type == "a2a_ring" else "cp"


def ring_size(layout: Layout) -> int:
    """Ranks in the ring: cp, or ``cp / cp_a2a_size`` under a2a_ring."""
    if layout.cp_comm_type == "a2a_ring":
        return layout.cp // layout.cp_a2a_size
    return layout.cp


def kv_length(spec: ModelSpec, layout: Layout) -> int:
    """Keys and values a rank's queries attend to, per head the rank holds: the whole sequence
    (``cp s``); under all-to-all ``s``, as the whole sequence of ``1 / cp`` of the heads is the
    same count as ``s`` of every head."""
    if heads_exchanged(layout) or ring(layout):
        return rank_seq_length(spec, layout)
    return layout.cp * rank_seq_length(spec, layout)


def attention_mask(layout: Layout) -> str:
    """The mask SDPA runs with: causal (one process, or the whole sequence under all-to-all),
    or under cp the rank's queries against the whole sequence (bottom-right aligned on CUDA, an
    explicit tensor on a CPU)."""
    if layout.cp == 1 or heads_exchanged(layout) or ring(layout):
        return "causal"
    return "lower_right" if layout.device_type == "cuda" else "tensor"


def gathered_kv_bytes(
    tokens: int, kv_heads: int, head_dim: int, element_bytes: int, layout: Layout
) -> int:
    """What attention keeps of the whole sequence's K and V gathered over cp (``tokens``: the
    rank's ``s b``; ``kv_heads``: per tp rank); 0 without cp, under all-to-all or a ring."""
    if layout.cp == 1 or heads_exchanged(layout) or ring(layout):
        return 0
    return layout.cp * tokens * 2 * kv_heads * head_dim * element_bytes


def exchanged_bytes(tokens: int, heads: int, head_dim: int, element_bytes: int) -> int:
    """Under all-to-all, what the exchanges add to what attention keeps: the output brought
    back (the projection's input, ``s b a d``; ``heads``: query heads per tp rank). The
    exchanged q|k|v replaces the qkv output and the rotated Q and K, which are not kept."""
    return tokens * heads * head_dim * element_bytes


def cp_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """``{"cp/op": (calls, bytes)}`` of one step's context-parallel exchanges on pipeline rank
    ``pp_rank`` (see the module docstring)."""
    if layout.cp == 1:
        return {}
    layers = layout.chunk_layers(spec.num_layers)
    n_layers = sum(layers[c] for c in layout.stage_chunks(pp_rank))
    redo, _ = reruns(spec, layout, pp_rank)
    m = layout.num_microbatches
    out: dict[str, tuple[int, int]] = {}
    if heads_exchanged(layout):
        local = rank_seq_length(spec, layout) * layout.micro_batch_size * spec.head_dim
        a, g = spec.num_heads // layout.tp, spec.kv_heads_per_rank(layout.tp)
        qkv, back = (local * n * layout.activation_bytes for n in (a + 2 * g, a))
        forwards = m * (n_layers + redo)
        calls = 2 * forwards + 2 * m * n_layers
        key = f"{exchange_group(layout)}/all_to_all"
        out[key] = (calls, (forwards + m * n_layers) * (qkv + back))
    if ring(layout):
        block, n = ring_block_bytes(spec, layout), ring_size(layout)
        kv = m * (ring_passes(layout, n_layers, redo) + n_layers) * (n - 1)
        accumulators = m * n_layers * n
        nbytes = kv * block + accumulators * ring_accumulator_bytes(spec, layout)
        group = ring_group(layout)
        out[f"{group}/send"] = out[f"{group}/recv"] = (kv + accumulators, nbytes)
    if out:
        return out
    kv = spec.seq_length * layout.micro_batch_size * 2 * spec.kv_heads_per_rank(layout.tp)
    kv_bytes = kv * spec.head_dim * layout.activation_bytes
    gathers = m * (n_layers + redo)
    return {
        "cp/all_gather": (gathers, gathers * kv_bytes),
        "cp/reduce_scatter": (m * n_layers, m * n_layers * kv_bytes),
    }


def ring_block_bytes(spec: ModelSpec, layout: Layout) -> int:
    """One K|V block (a rank's ``[b, 2g, s, d]``; under a2a_ring ``k s`` tokens of ``2g / k``
    heads, the same bytes), which each ring step moves."""
    tokens = rank_seq_length(spec, layout) * layout.micro_batch_size
    return tokens * 2 * spec.kv_heads_per_rank(layout.tp) * spec.head_dim * layout.activation_bytes


def ring_accumulator_bytes(spec: ModelSpec, layout: Layout) -> int:
    """One dK|dV accumulator: a K|V block's shape in fp32 (it is rounded once, at home)."""
    return ring_block_bytes(spec, layout) // layout.activation_bytes * 4


def ring_member(spec: ModelSpec, layout: Layout) -> tuple[int, int, int]:
    """``(tokens, query heads, kv heads)`` of each sequence a ring member attends over: ``s``
    tokens of ``a / t`` and ``g / t`` heads; under a2a_ring ``k s`` of ``1 / k`` of them."""
    k = layout.cp_a2a_size if layout.cp_comm_type == "a2a_ring" else 1
    kv = spec.kv_heads_per_rank(layout.tp)
    return rank_seq_length(spec, layout) * k, spec.num_heads // layout.tp // k, max(1, kv // k)


def ring_block_kernel(spec: ModelSpec, layout: Layout) -> str:
    """The kernel the ring's blocks run on the plan's device (the runtime's rule,
    :func:`~megatronish.context_parallel.ring_kernel.block_kernel`)."""
    dtype = torch.bfloat16 if layout.activation_bytes == 2 else torch.float32
    return block_kernel(layout.device_type, dtype, spec.head_dim, layout.document_masks)


def math_block_workspace(
    b: int, heads: int, kv_heads: int, queries: int, keys: int, d: int, e: int, documents: bool
) -> int:
    """What the plain-matmul kernel's backward of one block allocates beyond its inputs
    (``e``: their bytes per element): per tile of :func:`~megatronish.context_parallel.
    ring_kernel.math_tile_rows` rows the fp32 probabilities and their grad, the tile's
    visibility (documents: the comparison, the causal test and the result; else the causal
    triangle); dQ, the fp32 dK and dV, a grad at the query heads before its sum, and fp32
    copies of K and V (16-bit inputs)."""
    rows = math_tile_rows(b, heads, queries, keys)
    tiles = 2 * b * heads * rows * keys * 4 + (3 * b if documents else 1) * rows * keys
    grads = b * heads * queries * d * e + 2 * b * kv_heads * keys * d * 4
    grads += b * heads * keys * d * 4
    copies = 2 * b * kv_heads * keys * d * 4 if e != 4 else 0
    return tiles + grads + copies


def ring_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Bytes a ring attention's backward allocates on top of what the layers keep, at its
    largest step: the fp32 dQ, K|V held and received, the block's fp32 dK|dV share and, from
    the second step on, the accumulators held and received (:func:`ring_accumulator_bytes`);
    plus the block kernel's own: the plain-matmul kernel's (:func:`math_block_workspace`: the
    diagonal block at the first step, half-size blocks after it, whose second query chunk is
    copied out with its output and incoming grad), the flash kernels' fp32 dQ accumulator. 0
    without a ring."""
    if not ring(layout):
        return 0
    tokens, heads, kv_heads = ring_member(spec, layout)
    b, d, e = layout.micro_batch_size, spec.head_dim, layout.activation_bytes
    block, accumulator = ring_block_bytes(spec, layout), ring_accumulator_bytes(spec, layout)
    first = b * heads * tokens * d * 4 + 2 * block + accumulator
    later = first + 2 * accumulator
    if ring_block_kernel(spec, layout) != "math":
        return later + b * heads * tokens * d * 4

    def kernel(queries: int, keys: int) -> int:
        shape = (b, heads, kv_heads, queries, keys, d, e)
        return math_block_workspace(*shape, layout.document_masks)

    half = tokens // 2
    second_queries = kernel(half, tokens) + 3 * b * heads * half * d * e  # their rows copied
    return max(first + kernel(tokens, tokens), later + max(kernel(tokens, half), second_queries))


def ring_passes(layout: Layout, n_layers: int, redo: int) -> int:
    """Ring forwards per microbatch: every layer's, full recompute's reruns (``redo``), and
    selective recompute's rerun of every core."""
    return n_layers + redo + core_reruns(layout, n_layers)


def ring_overlap_time(
    spec: ModelSpec, layout: Layout, hw: Hardware, pp_rank: int, rate: float
) -> float:
    """Seconds of ring transfers per step that the attention blocks hide (``rate``: the
    stage's FLOP/s per rank): per step the shorter of its group's sends and its block's
    attention (forward ``4 s b (n s / 2) a d / n`` FLOPs, causal, for the ``n`` ranks of the
    ring, ``s`` tokens and ``a`` heads a member holds; backward twice that). None on shared
    cores (communication uses the cores compute needs)."""
    if not ring(layout) or hw.shared_cores:
        return 0.0
    layers = layout.chunk_layers(spec.num_layers)
    n_layers = sum(layers[c] for c in layout.stage_chunks(pp_rank))
    redo, _ = reruns(spec, layout, pp_rank)
    cp = ring_size(layout)
    s, heads = spec.seq_length // cp, spec.num_heads // layout.tp // (layout.cp // cp)
    flops = 4 * s * layout.micro_batch_size * (cp * s / 2) * heads * spec.head_dim / cp
    forward_block = flops / rate
    group = f"{ring_group(layout)}/send"
    send = comm_time(layout, hw, group, 1, ring_block_bytes(spec, layout))
    send_acc = comm_time(layout, hw, group, 1, ring_accumulator_bytes(spec, layout))
    forward = ring_passes(layout, n_layers, redo) * (cp - 1) * min(send, forward_block)
    # backward steps: K|V only at the first, K|V and dK|dV between, dK|dV only at the last
    first, last = min(send, 2 * forward_block), min(send_acc, 2 * forward_block)
    both = min(send + send_acc, 2 * forward_block)
    backward = n_layers * (first + last + (cp - 2) * both)
    return layout.num_microbatches * (forward + backward)
