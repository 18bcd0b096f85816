"""The mixture-of-experts blocks of a plan: what they keep for backward and what they send.

Symbols: ``T`` tokens a block routes per microbatch on a rank (its cp rank's ``s / cp * b``,
gathered over tp under sequence parallelism, so the same on every tp rank), ``T_r`` the rank's
own share (``T / tp`` under sp), ``k`` top-k, ``E`` experts, ``N = T k`` rows dispatched
(dropless; with a capacity factor at most ``E * capacity``), ``h`` hidden, ``f'`` an expert's
hidden units per tp rank, ``e`` bytes per activation.

Communication per block and microbatch (CommStats' bytes, :mod:`megatronish.moe.dispatch`):

- ep > 1: forward an all-to-all of the counts (``8 E``), of the dispatched rows (``N h e``) and
  of the experts' outputs (the rows received); backward the two row exchanges again. A rank
  receives ``N`` rows on average over its ep group (the exact number follows the routing), so
  the plan's ``4 N h e + 8 E`` is the ep group's mean, and ep times it the group's sum, exactly.
- tp > 1 (sp): the block gathers the tokens and reduce-scatters the output as a dense MLP does,
  and also gathers the router's top-k weights (fp32) and expert ids (int64) in forward and
  reduce-scatters the weights' grads in backward (``T k`` each).
- cp > 1: an all-reduce of the counts (``8 E``) over cp, for the balancing loss.

With shared experts (and ``parallel.moe_shared_expert_overlap``) each forward's rows all-to-all
runs while the shared experts compute: the step time's ``ep`` term loses the shorter of the two
per forward (:func:`overlapped_dispatch_time`).

Full recompute reruns a checkpointed block's forward collectives; a group that ends in a
mixture-of-experts block reruns all of them (its balancing and z losses keep the last saved
tensors), while a dense block's final reduce-scatter is skipped.

Everything else the plan knows of experts is here too: which blocks are mixtures of experts
(:func:`block_flags`; the functions taking a model's blocks use the dense ones of
:mod:`~megatronish.plan.dense` for the others), their FLOPs (active weights), the expert buckets'
ZeRO group (``edp = dp * cp / ep`` ranks, :func:`expert_dp`, :func:`expert_group`) and the step
time of their grads, reduced with dp's (:func:`merge_expert_grads`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatronish.model.build import chunk_layer_ranges
from megatronish.model.flops import layer_matmul_params
from megatronish.moe.fp8_grouped import ALIGN_ROWS
from megatronish.plan import dense
from megatronish.plan.context_parallel import rank_seq_length
from megatronish.plan.hardware import Hardware, comm_time
from megatronish.plan.layout import Layout
from megatronish.plan.recompute import segments
from megatronish.spec import ModelSpec

FP32, INT64 = 4, 8


def chunk_flags(spec: ModelSpec, layout: Layout) -> list[tuple[bool, ...]]:
    """Per global chunk, whether each of its blocks is a mixture of experts."""
    ranges = chunk_layer_ranges(layout.chunk_layers(spec.num_layers))
    return [tuple(spec.is_moe_layer(i) for i in r) for r in ranges]


def block_flags(spec: ModelSpec, layout: Layout) -> list[tuple[bool, ...]]:
    """:func:`chunk_flags`, or empty tuples (every block dense) for a dense model."""
    if spec.moe is None:
        return [()] * len(layout.chunk_layers(spec.num_layers))
    return chunk_flags(spec, layout)


def routed_tokens(spec: ModelSpec, layout: Layout) -> int:
    """``T``: tokens one block routes per microbatch on a rank (this cp rank's, all tp's)."""
    return rank_seq_length(spec, layout) * layout.micro_batch_size


def dispatched_rows(spec: ModelSpec, layout: Layout) -> int:
    """``N``: rows a rank's experts compute per block and microbatch (on average): ``T k``, or
    at most every expert's capacity when tokens may be dropped (under ``ep_first`` each tp rank
    drops among its own ``T / tp`` tokens)."""
    return sent_rows(spec, layout) * (layout.tp if ep_first(layout) else 1)


def sent_rows(spec: ModelSpec, layout: Layout) -> int:
    """Rows a rank sends over ep per block and microbatch (on average, the rows it receives):
    those of the tokens it dispatches, ``T`` (``tp_first``) or its own ``T / tp``
    (``ep_first``), times ``k``, or at most every expert's capacity."""
    moe, tokens = spec.moe, routed_tokens(spec, layout)
    if ep_first(layout):
        tokens //= layout.tp
    rows = tokens * moe.top_k
    if moe.capacity_factor is None:
        return rows
    capacity = math.ceil(tokens * moe.top_k / moe.num_experts * moe.capacity_factor)
    return min(rows, moe.num_experts * capacity)


def ep_first(layout: Layout) -> bool:
    """Whether blocks dispatch in Megatron-LM's order (the all-to-all first, then the rows
    gathered over tp): ``parallel.moe_dispatch_order=ep_first`` under sequence parallelism."""
    return layout.moe_dispatch_order == "ep_first" and layout.sequence_parallel


# -- activations ------------------------------------------------------------------------------


def mlp_bytes(spec: ModelSpec, layout: Layout) -> int:
    """Bytes a mixture-of-experts MLP keeps for backward per microbatch, in place of the dense
    MLP's (its input saved by the first linear and its intermediates):

    the router's fp32 input ``T_r h`` (and its weight's fp32 copy under bf16), logits, scores
    and the sort's int64 indices ``T_r E`` each, the chosen scores ``T_r k``, the logsumexp of
    the z-loss; the
    dispatch indices (``2 N`` int64, twice more under ep), the rows each expert computes
    ``N h``, SwiGLU's ``4 N f'`` (GELU ``2 N f'``), the rows coming back ``N h`` and the slots
    weighted in combine ``T k h`` with their weights; shared experts as a dense MLP of
    ``shared * f`` units. In Megatron-LM's order (:func:`ep_first`) a tp rank routes, sends,
    gets back and combines only its own ``T_r`` tokens' rows (the indices and the rows coming
    back are ``T_r k``), while its experts compute the rows of the whole tp group."""
    moe, e, h, t = spec.moe, layout.activation_bytes, spec.hidden_size, layout.tp
    tokens, rows = routed_tokens(spec, layout), dispatched_rows(spec, layout)
    own = tokens // t if layout.sequence_parallel else tokens  # T_r
    routed, sent = (own, sent_rows(spec, layout)) if ep_first(layout) else (tokens, rows)
    width = 4 if spec.is_llama else 2
    router = own * spec.hidden_size * FP32 + (moe.num_experts * h * FP32 if e < FP32 else 0)
    routing = own * moe.num_experts * (FP32 + FP32 + INT64)  # logits, scores, sort indices
    # the chosen scores: saved by the rescaling, or by combine itself when there is no tp gather
    routing += own * moe.top_k * FP32 * (int(moe.renormalize) + int(t == 1))
    routing += own * FP32 * (2 if moe.renormalize else 1)  # logsumexp, the top-k sum
    routing += own * FP32 if moe.score == "sigmoid" else 0  # the sigmoids' sum (balancing loss)
    index = sent * INT64 * (4 if layout.ep > 1 else 2)
    experts = rows * h * e + rows * (moe.ffn_hidden_size // t) * width * e
    combine = sent * h * e + routed * moe.top_k * (h * e + e)  # returned rows, slots, weights
    shared = 0
    if moe.shared_experts:
        f = moe.shared_experts * moe.ffn_hidden_size // t
        gathered = layout.sequence_parallel or e < FP32  # else the router's input itself
        shared = (tokens * h * e if gathered else 0) + tokens * f * width * e
    return router + routing + index + experts + combine + shared


def _block_backward_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Temporaries of a mixture-of-experts block's backward: the incoming grad of the whole
    microbatch's tokens, and the slots' grad beside the product that gives the weights' grad."""
    e, h = layout.activation_bytes, spec.hidden_size
    rows = routed_tokens(spec, layout) * spec.moe.top_k
    return routed_tokens(spec, layout) * h * e + 2 * rows * h * e


def fp8_expert_backward_peak(
    rows: int, padded_rows: int, k: int, n: int, experts: int, e: int
) -> int:
    """The most bytes an fp8 expert linear's backward (:mod:`megatronish.moe.fp8_grouped`)
    holds at once beyond what it is given: ``rows`` grouped rows (``padded_rows`` in the weight
    grad's groups of 16), input width ``k``, output width ``n``, ``experts`` local experts, ``e``
    bytes an activation. Its phases: the output grad scaled in bf16 and cast (``3 N n``; a
    quantization holds its bf16 product and the fp8 copy), the weight stack likewise beside it
    and its column-major copy, the input grad GEMM (``N k e``); then beside the input grad the
    padded groups' int64 rows, each padded operand quantized (``3.25 P c``: the bf16 padded copy,
    the fp8 one, per-block maxima and scales) and the weight grad GEMM (``E n k e``)."""
    # bytes per column of a padded quantization
    quantized = 13 * padded_rows // 4
    input_grad = max(
        3 * rows * n,
        rows * n + 3 * experts * n * k,
        rows * n + experts * n * k + rows * k * e,
    )
    weight_grad = rows * k * e + max(
        3 * INT64 * rows + quantized * n,
        INT64 * rows + padded_rows * n + quantized * k,
        INT64 * rows + padded_rows * (n + k) + experts * n * k * e,
    )
    return max(input_grad, weight_grad)


def fp8_experts_workspace(spec: ModelSpec, layout: Layout) -> int:
    """What fp8 experts (``trainer.fp8``) add to a mixture-of-experts block's backward
    temporaries: the larger of fc1's and fc2's :func:`fp8_expert_backward_peak` beyond the two
    grads it returns (a bf16 expert returns them too), every local group padded by 16 rows (at
    most what padding adds)."""
    if layout.fp8 is None:
        return 0
    moe, e, h = spec.moe, layout.activation_bytes, spec.hidden_size
    rows, experts = dispatched_rows(spec, layout), moe.num_experts // layout.ep
    f = moe.ffn_hidden_size // layout.tp
    padded = rows + ALIGN_ROWS * experts
    extra = 0
    for k, n in ((h, 2 * f if spec.is_llama else f), (f, h)):
        peak = fp8_expert_backward_peak(rows, padded, k, n, experts, e)
        extra = max(extra, peak - rows * k * e - experts * n * k * e)
    return extra


def backward_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Temporaries of the largest block backward of the model: a dense block's
    (:func:`~megatronish.plan.dense.backward_workspace`) or a mixture-of-experts one's (with
    :func:`fp8_experts_workspace`)."""
    if spec.moe is None:
        return dense.backward_workspace(spec, layout)
    kinds = {spec.is_moe_layer(i) for i in range(spec.num_layers)}
    moe_block = _block_backward_workspace(spec, layout) + fp8_experts_workspace(spec, layout)
    return max(moe_block if k else dense.backward_workspace(spec, layout) for k in kinds)


def block_bytes(spec: ModelSpec, layout: Layout, moe_block: bool, core: bool = True) -> int:
    """:func:`~megatronish.plan.dense.layer_bytes` of a dense block, or of a mixture-of-experts
    one (its MLP and the MLP's input replaced by what the router, dispatch and experts keep)."""
    layer = dense.layer_bytes(spec, layout, core)
    if not moe_block:
        return layer
    dense_mlp = dense.mlp_bytes(spec, layout) + dense.fp8_mlp_bytes(spec, layout)
    return layer - dense_mlp + mlp_bytes(spec, layout)  # fp8 experts keep their bf16 inputs


def blocks_bytes(
    spec: ModelSpec, layout: Layout, flags: tuple[bool, ...], core: bool = True
) -> int:
    """:func:`block_bytes` of a run of blocks (``flags``: which are mixtures of experts)."""
    return sum(block_bytes(spec, layout, f, core) for f in flags)


def mlp_weight_grad_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What a mixture-of-experts MLP's W keeps from its B per microbatch: the router's fp32
    input and logits' grad (``T_r h``, ``T_r E``), every expert linear's input and output grad
    (``N h`` and ``N f'`` in, SwiGLU's ``2 N f'`` (GELU ``N f'``) and ``N h`` out), and the
    shared experts' as a dense MLP of ``shared * f`` units."""
    moe, e, h, t = spec.moe, layout.activation_bytes, spec.hidden_size, layout.tp
    tokens, rows = routed_tokens(spec, layout), dispatched_rows(spec, layout)
    own = tokens // t if layout.sequence_parallel else tokens
    width = 2 if spec.is_llama else 1
    f = moe.ffn_hidden_size // t
    router = own * (h + moe.num_experts) * FP32
    experts = rows * (h + f) * e + rows * (width * f + h) * e
    shared = 0
    if moe.shared_experts:
        f_shared = moe.shared_experts * moe.ffn_hidden_size // t
        shared = tokens * (h + f_shared) * e + tokens * (width * f_shared + h) * e
    return router + experts + shared


def blocks_weight_grad_bytes(spec: ModelSpec, layout: Layout, flags: tuple[bool, ...]) -> int:
    """What the W of a run of blocks keeps from their B (``flags``: which are mixtures of
    experts; :func:`~megatronish.plan.dense.attention_weight_grad_bytes` and the MLP's)."""
    attention = dense.attention_weight_grad_bytes(spec, layout)
    mlp = {False: dense.mlp_weight_grad_bytes(spec, layout)}
    if any(flags):
        mlp[True] = mlp_weight_grad_bytes(spec, layout)
    return sum(attention + mlp[f] for f in flags)


def mean_block_bytes(spec: ModelSpec, layout: Layout, core: bool = True) -> float:
    """Bytes a block keeps per microbatch: a dense block's, or the mean over the model's."""
    if spec.moe is None:
        return dense.layer_bytes(spec, layout, core=core)
    flags = [spec.is_moe_layer(i) for i in range(spec.num_layers)]
    return blocks_bytes(spec, layout, tuple(flags), core) / spec.num_layers


# -- FLOPs ------------------------------------------------------------------------------------


def stage_flops_per_token(spec: ModelSpec, layers: list[int], head: bool) -> float:
    """Model FLOPs per token of the pipeline's tokens that the blocks ``layers`` (and the head)
    do: a mixture-of-experts model's blocks differ (their own active weights), a dense model's
    are :func:`~megatronish.plan.dense.stage_flops_per_token`."""
    if spec.moe is None:
        return dense.stage_flops_per_token(spec, layers, head)
    s, h = spec.attention_span, spec.hidden_size
    own = sum(6.0 * layer_matmul_params(spec, i) + 12.0 * s * spec.attention_width for i in layers)
    return own + (6.0 * (spec.padded_vocab_size * h) if head else 0.0)


# -- communication ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankBlocks:
    """A rank's mixture-of-experts blocks, and what full recompute reruns of them."""

    moe: int = 0  # mixture-of-experts blocks on the rank (all its chunks)
    redo: int = 0  # of them, the ones full recompute reruns
    moe_ending_groups: int = 0  # checkpointed groups whose last block is a mixture of experts


def rank_blocks(spec: ModelSpec, layout: Layout, pp_rank: int) -> RankBlocks:
    """The mixture-of-experts blocks of the chunks of pipeline rank ``pp_rank``."""
    if spec.moe is None:
        return RankBlocks()
    flags = chunk_flags(spec, layout)
    moe = redo = ending = 0
    for c in layout.stage_chunks(pp_rank):
        blocks = flags[c]
        moe += sum(blocks)
        for start, end, checkpointed in segments(layout, len(blocks)):
            if checkpointed:
                redo += sum(blocks[start:end])
                ending += blocks[end - 1]
    return RankBlocks(moe, redo, ending)


def ep_volume(spec: ModelSpec, layout: Layout, blocks: RankBlocks) -> dict[str, tuple[int, int]]:
    """``{"ep/all_to_all": (calls, bytes)}`` of one step (the ep group's mean per rank)."""
    if layout.ep == 1 or not blocks.moe:
        return {}
    m, counts = layout.num_microbatches, spec.moe.num_experts * INT64
    rows = sent_rows(spec, layout) * spec.hidden_size * layout.activation_bytes
    forwards = blocks.moe + blocks.redo
    calls = m * (3 * forwards + 2 * blocks.moe)
    return {"ep/all_to_all": (calls, m * (forwards * (counts + 2 * rows) + blocks.moe * 2 * rows))}


def overlapped_dispatch_time(
    spec: ModelSpec, layout: Layout, hw: Hardware, pp_rank: int, rate: float
) -> float:
    """Seconds of the ep term the shared experts hide (``parallel.moe_shared_expert_overlap``):
    each forward of a block (recompute's reruns too) posts its rows' all-to-all, runs the shared
    experts' forward on its ``T`` tokens (``2 w h f_s / t`` FLOPs each at ``rate``; SwiGLU
    ``w = 3``, GELU 2), then waits, hiding the shorter of the two. None on shared cores, where
    compute and communication take the same cores."""
    moe = spec.moe
    if moe is None or layout.ep == 1 or not moe.shared_experts or hw.shared_cores:
        return 0.0
    if not layout.moe_shared_expert_overlap:
        return 0.0
    blocks = rank_blocks(spec, layout, pp_rank)
    forwards = layout.num_microbatches * (blocks.moe + blocks.redo)
    rows = sent_rows(spec, layout) * spec.hidden_size * layout.activation_bytes
    exchange = comm_time(layout, hw, "ep/all_to_all", 1, rows)
    width = 3 if spec.is_llama else 2
    f_shared = moe.shared_experts * moe.ffn_hidden_size // layout.tp
    shared = 2.0 * width * spec.hidden_size * f_shared * routed_tokens(spec, layout) / rate
    return forwards * min(exchange, shared)


def cp_counts_volume(
    spec: ModelSpec, layout: Layout, blocks: RankBlocks
) -> dict[str, tuple[int, int]]:
    """``{"cp/all_reduce": ...}``: each forward of a block sums its expert counts over cp."""
    if layout.cp == 1 or not blocks.moe:
        return {}
    calls = layout.num_microbatches * (blocks.moe + blocks.redo)
    return {"cp/all_reduce": (calls, calls * spec.moe.num_experts * INT64)}


def tp_extra_volume(
    spec: ModelSpec, layout: Layout, blocks: RankBlocks
) -> dict[str, tuple[int, int]]:
    """What mixture-of-experts blocks add to a dense model's sequence-parallel collectives:
    the routing's gathers (and the weights' grads), the shared experts' MLP, and the final
    reduce-scatter of groups ending in a block that full recompute reruns to its end."""
    if not layout.sequence_parallel or not blocks.moe:
        return {}
    if ep_first(layout):
        return _ep_first_tp_volume(spec, layout, blocks)
    moe, m = spec.moe, layout.num_microbatches
    act = routed_tokens(spec, layout) * spec.hidden_size * layout.activation_bytes
    slots = routed_tokens(spec, layout) * moe.top_k
    forwards = blocks.moe + blocks.redo
    shared = (2 * blocks.moe + blocks.redo) if moe.shared_experts else 0
    gathers = (m * (2 * forwards + shared), m * (forwards * slots * (FP32 + INT64) + shared * act))
    scatters = m * (blocks.moe + shared + blocks.moe_ending_groups)
    scatter_bytes = m * (blocks.moe * slots * FP32 + (shared + blocks.moe_ending_groups) * act)
    return {"tp/all_gather": gathers, "tp/reduce_scatter": (scatters, scatter_bytes)}


def _ep_first_tp_volume(
    spec: ModelSpec, layout: Layout, blocks: RankBlocks
) -> dict[str, tuple[int, int]]:
    """:func:`tp_extra_volume` in Megatron-LM's order. Per block forward: the counts sent and
    received of every tp rank gathered (``2 E`` int64 each), the received rows gathered and the
    experts' partial outputs reduce-scattered (``N h`` on average, :func:`dispatched_rows`); per
    backward the two mirrored. The block has none of a dense MLP's four sequence-parallel
    collectives (counted by :func:`~megatronish.plan.dense.tp_volume`, so taken off here), nor
    ``tp_first``'s routing gathers; full recompute reruns its gathers, and its reduce-scatter
    but where the dense count already skips a group's last one."""
    moe, m, t = spec.moe, layout.num_microbatches, layout.tp
    act = routed_tokens(spec, layout) * spec.hidden_size * layout.activation_bytes
    rows = dispatched_rows(spec, layout) * spec.hidden_size * layout.activation_bytes
    counts = t * 2 * moe.num_experts * INT64
    forwards = blocks.moe + blocks.redo
    shared = (2 * blocks.moe + blocks.redo) if moe.shared_experts else 0
    not_gathered = 2 * blocks.moe + blocks.redo  # the dense MLP's input gathers
    not_scattered = 2 * blocks.moe + blocks.redo - blocks.moe_ending_groups
    gathers = 2 * forwards + blocks.moe + shared - not_gathered
    gather_bytes = forwards * (counts + rows) + blocks.moe * rows + (shared - not_gathered) * act
    scatters = forwards + blocks.moe + shared - not_scattered
    scatter_bytes = (forwards + blocks.moe) * rows + (shared - not_scattered) * act
    return {
        "tp/all_gather": (m * gathers, m * gather_bytes),
        "tp/reduce_scatter": (m * scatters, m * scatter_bytes),
    }


# -- the experts' grads -----------------------------------------------------------------------


def expert_dp(layout: Layout) -> dict:
    """The buckets' ``expert_dp`` argument: experts sharded over ``dp * cp / ep`` ranks (as
    the trainer passes it, also without expert parallelism: dp x cp, which hybrid sharding
    does not cut for them)."""
    return {"expert_dp": (layout.edp, 0)}


def expert_group(layout: Layout) -> str | None:
    """The CommStats name of the group that reduces expert grads: dp's own group without
    expert parallelism, ``edp`` with it, None when a single rank holds each expert."""
    return layout.group("edp") if layout.edp > 1 else None


def merge_expert_grads(times: dict, volume: dict, layout: Layout, group: str) -> tuple[dict, dict]:
    """``times`` and ``volume`` with the entries of the group expert grads are reduced over
    added to those of ``group`` (the dense ones'): expert grads are reduced and gathered with
    the dense ones and overlap as they do."""
    experts = expert_group(layout)
    ops = ("reduce_scatter", "all_gather", "all_reduce")
    keys = [f"{experts}/{op}" for op in ops if experts != group and f"{experts}/{op}" in volume]
    if not keys:
        return times, volume
    times, volume = dict(times), dict(volume)
    for key in keys:
        op = f"{group}/{key.partition('/')[2]}"
        times[op] = times.get(op, 0.0) + times.pop(key)
        (calls, nbytes), (more, extra) = volume.get(op, (0, 0)), volume.pop(key)
        volume[op] = (calls + more, nbytes + extra)
    return times, volume
