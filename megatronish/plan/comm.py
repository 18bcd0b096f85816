"""Communication volume per step per rank, by group and collective (pure).

Bytes follow :class:`~megatronish.distributed.comm.CommStats`: the size of the tensor handed to
the collective (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the full
input; send / recv: the message), not the bytes on the wire, which depend on the algorithm
(a ring all-reduce moves ``2 (n - 1) / n`` of the tensor per rank). Scalars (loss, grad norm,
timers, routing statistics) are left out. Mixture-of-experts blocks: see
:mod:`~megatronish.plan.moe`; their expert buckets are reduced over the expert-data-parallel
group (``edp``), which is dp's own group without expert parallelism.
"""

from __future__ import annotations

from megatronish.data_parallel.buckets import Bucket
from megatronish.model.spec import ModelSpec
from megatronish.plan import moe
from megatronish.plan.layout import Layout
from megatronish.plan.states import FP32, meta_chunks
from megatronish.plan.zero3_gather import ChunkUnits, gathers_per_microbatch
from megatronish.tensor_parallel.sharding import param_info


def _rank_layers(spec: ModelSpec, layout: Layout, pp_rank: int):
    """``(layers per chunk, this rank's chunks, its layers, layers full recompute reruns,
    checkpointed groups)``."""
    layers = layout.chunk_layers(spec.num_layers)
    mine = [pp_rank + v * layout.pp for v in range(layout.vpp)]
    groups = redo = 0
    if layout.recompute == "full":
        for c in mine:
            n = min(layout.recompute_num_layers, layers[c])
            uniform = layout.recompute_method == "uniform"
            redo += layers[c] if uniform else n
            groups += -(-layers[c] // n) if uniform else n
    return layers, mine, sum(layers[c] for c in mine), redo, groups


def tp_volume(
    spec: ModelSpec, layout: Layout, pp_rank: int, chunks: list | None = None
) -> dict[str, tuple[int, int]]:
    """``{"tp/op": (calls, bytes)}`` of one step's forward and backward on this rank
    (``chunks``: its :func:`~megatronish.plan.states.meta_chunks`, when already built)."""
    if layout.tp == 1:
        return {}
    layers, mine, n_layers, redo, groups = _rank_layers(spec, layout, pp_rank)
    first, last = 0 in mine, len(layers) - 1 in mine
    m, b, h = layout.num_microbatches, layout.micro_batch_size, spec.hidden_size
    s = spec.seq_length // layout.cp  # this cp rank's tokens
    act = s * b * h * layout.activation_bytes
    # Full recompute repeats a checkpointed group's forward collectives (two per layer) up to
    # the last saved tensor it must rebuild: the group's final reduction is skipped.
    per_mb = 4 * n_layers + int(first) + int(last)
    out: dict[str, tuple[int, int]] = {}
    if layout.sequence_parallel:
        ag, rs = per_mb + 2 * redo, per_mb + 2 * redo - groups
        out["tp/all_gather"] = (m * ag, m * ag * act)
        out["tp/reduce_scatter"] = (m * rs, m * rs * act)
        if chunks is None:
            chunks = meta_chunks(spec, layout, pp_rank)
        replicated = _sequence_parallel_numel(chunks)
        if replicated:
            out["tp/all_reduce"] = (1, replicated * FP32)
    else:
        ar = per_mb + 2 * redo - groups
        out["tp/all_reduce"] = (m * ar, m * ar * act)
    if last:  # the vocabulary-parallel cross entropy: max, target logit, sum of exp
        calls, nbytes = out.get("tp/all_reduce", (0, 0))
        out["tp/all_reduce"] = (calls + 3 * m, nbytes + 3 * m * s * b * 4)
    if spec.moe is not None:
        out = moe.add_volumes(
            out, moe.tp_extra_volume(spec, layout, moe.rank_blocks(spec, layout, pp_rank))
        )
    return out


def cp_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """``{"cp/op": (calls, bytes)}``: per layer and microbatch one all-gather of k|v (the whole
    sequence's ``[s, b, 2 kv_heads / tp, d]``) in forward, repeated when full recompute reruns
    the layer, and one reduce-scatter of their grads in backward."""
    if layout.cp == 1:
        return {}
    _, _, n_layers, redo, _ = _rank_layers(spec, layout, pp_rank)
    m = layout.num_microbatches
    kv = spec.seq_length * layout.micro_batch_size * 2 * (spec.num_kv_heads // layout.tp)
    kv_bytes = kv * spec.head_dim * layout.activation_bytes
    gathers = m * (n_layers + redo)
    return {
        "cp/all_gather": (gathers, gathers * kv_bytes),
        "cp/reduce_scatter": (m * n_layers, m * n_layers * kv_bytes),
        **moe.cp_counts_volume(spec, layout, moe.rank_blocks(spec, layout, pp_rank)),
    }


def _sequence_parallel_numel(chunks: list) -> int:
    """Elements of replicated params fed by sequence shards (grads summed over tp once)."""
    return sum(p.numel() for c in chunks for p in c.parameters() if param_info(p).sequence_parallel)


def dp_volume(
    layout: Layout, buckets: list[list[Bucket]], units: list[ChunkUnits] | None = None
) -> dict[str, tuple[int, int]]:
    """``{"dp/op": (calls, bytes)}``: grad reductions and param gathers, one call per bucket
    (``buckets``: this rank's, per chunk; ``units``: its chunks' units, needed for zero 3).
    With context parallelism the group is dp x cp, reported as ``dp_cp/op``.

    Zero 0/1 reduce each bucket once per step, zero 2/3 once per microbatch (the buckets reduced
    after a model-parallel sum once per step). Zero 1/2 gather the updated params once after the
    step; zero 3 gathers each unit before its forward and its backward (the loss's unit once),
    or once per step when kept gathered.
    """
    if layout.dp_cp == 1:
        return {}
    group = "dp_cp" if layout.cp > 1 else "dp"
    flat = [b for bs in buckets for b in bs]
    if layout.ep == 1:  # experts, if any, are reduced over dp x cp too
        return _reduce_volume(layout, group, flat, units, None)
    experts = moe.expert_group(layout)
    dense = _reduce_volume(layout, group, [b for b in flat if not b.expert], units, False)
    if experts is None:  # each expert on one rank of the dp x cp group: nothing to reduce
        return dense
    mine = [b for b in flat if b.expert]
    return moe.add_volumes(dense, _reduce_volume(layout, experts, mine, units, True))


def _reduce_volume(
    layout: Layout, group: str, flat: list[Bucket], units: list[ChunkUnits] | None, experts
) -> dict[str, tuple[int, int]]:
    """:func:`dp_volume` of the buckets ``flat`` reduced over ``group`` (``experts``: which
    buckets of the zero-3 units they are; None: all)."""
    if not flat:
        return {}
    n, numel = len(flat), sum(b.numel for b in flat)
    if layout.zero_stage == 0:
        return {f"{group}/all_reduce": (n, numel * layout.grad_reduce_bytes)}
    rounds = [1 if b.late or layout.zero_stage < 2 else layout.num_microbatches for b in flat]
    reduced = sum(r * b.numel for r, b in zip(rounds, flat)) * layout.grad_reduce_bytes
    out = {f"{group}/reduce_scatter": (sum(rounds), reduced)}
    calls, gathered = n, numel  # model params
    if layout.zero_stage == 3 and not layout.zero3_keep_gathered:
        if units is None:
            raise ValueError("zero 3 needs the chunks' units to count its gathers")
        per_mb = [gathers_per_microbatch(cu, experts) for cu in units]
        calls = layout.num_microbatches * sum(c for c, _ in per_mb)
        gathered = layout.num_microbatches * sum(e for _, e in per_mb)
    out[f"{group}/all_gather"] = (calls, gathered * layout.activation_bytes)
    return out


def pp_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """``{"pp/send"|"pp/recv": (calls, bytes)}``: activations forward, their grads backward."""
    if layout.pp == 1:
        return {}
    n = layout.pp * layout.vpp
    s = spec.seq_length // layout.cp
    s_r = s // layout.tp if layout.sequence_parallel else s
    msg = s_r * layout.micro_batch_size * spec.hidden_size * layout.activation_bytes
    m = layout.num_microbatches
    mine = [pp_rank + v * layout.pp for v in range(layout.vpp)]
    sends = sum((c < n - 1) + (c > 0) for c in mine)  # activation out, grad back
    return {"pp/send": (m * sends, m * sends * msg), "pp/recv": (m * sends, m * sends * msg)}


def embedding_volume(spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, int]]:
    """The tied embedding's grad all-reduce between the first and the last stage."""
    if not spec.tie_embeddings or layout.pp == 1 or pp_rank not in (0, layout.pp - 1):
        return {}
    numel = spec.padded_vocab_size // layout.tp * spec.hidden_size
    return {"embedding/all_reduce": (1, numel * FP32)}
