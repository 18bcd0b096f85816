"""The fraction of peak a rank's matmuls reach, from their shapes (a roofline model).

A matmul of an ``[M, K]`` and a ``[K, N]`` operand does ``2 M K N`` FLOPs and moves at least
``e (M K + K N + M N)`` bytes (``e`` bytes per element: both operands read and the output
written once). Its arithmetic intensity is ``I = 2 M K N / (e (M K + K N + M N))`` FLOP per
byte. At ``top`` of the peak ``P`` (``Hardware.efficiency``) its math takes ``FLOPs / (top P)``
and moving its operands at the memory bandwidth ``B`` takes ``bytes / B``; counting both (no
overlap: the roofline of Williams, Waterman and Patterson, CACM 52(4), 2009, read
conservatively near its ridge point)::

    efficiency(I) = top / (1 + ridge / I),    ridge = top P / B

It rises with ``I``, never exceeds ``top`` and is half of it at ``I = ridge``: 148 FLOP/B for
an H100 SXM at 0.5 of its 989 TFLOP/s with 3.35 TB/s (datasheet numbers,
:data:`megatronish.plan.devices.GPUS`). ``I`` grows with the smallest of ``M``, ``K`` and
``N``, so the small matmuls of a tiny micro batch, of a short context split over cp ranks or of
weights split over many tp ranks run below ``top``; large ones approach it.

A rank's matmuls per microbatch (``M = micro batch * seq / cp`` token rows: under sequence
parallelism the column-parallel matmuls see the sequence gathered over tp, so tp splits ``N``
(qkv, gate|up, the head) or ``K`` (proj, down), never ``M``): each linear layer's forward, input
grad and weight grad have the same three dimensions, so one intensity serves all three. An
expert of a mixture-of-experts block multiplies the rows routed to it, ``M top_k ep / experts``
with even routing; the router's matmul (``E h`` per token, under 1% of the FLOPs) is left out.
The attention products (``12 s h`` per token and layer: fused kernels on one head's tiles, not
memory bound) run at ``top``. A stage's efficiency is that of its FLOPs taken together: their
time at each matmul's efficiency (a FLOP-weighted harmonic mean).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatronish.plan.layout import Layout
from megatronish.spec import ModelSpec

if TYPE_CHECKING:
    from megatronish.plan.step_time import Hardware

# (rows M, K, N, copies): one of a rank's matmuls per microbatch, ``copies`` times.
Matmul = tuple[float, int, int, int]


def intensity(m: float, k: int, n: int, element_bytes: int) -> float:
    """FLOP per byte of an ``[m, k] @ [k, n]`` matmul that reads and writes each operand once."""
    return 2.0 * m * k * n / (element_bytes * (m * k + k * n + m * n))


def matmul_efficiency(m: float, k: int, n: int, element_bytes: int, hw: Hardware) -> float:
    """The fraction of ``hw.peak_flops`` an ``[m, k] @ [k, n]`` matmul reaches (see above)."""
    ridge = hw.efficiency * hw.peak_flops / hw.memory_bw
    return hw.efficiency / (1.0 + ridge / intensity(m, k, n, element_bytes))


def token_rows(spec: ModelSpec, layout: Layout) -> int:
    """Rows of a rank's dense matmuls per microbatch: its micro batch's tokens of one cp rank."""
    return layout.micro_batch_size * spec.seq_length // layout.cp


def _mlp(rows: float, h: int, ffn: int, tp: int, llama: bool, copies: int = 1) -> list[Matmul]:
    up = (2 if llama else 1) * ffn // tp  # llama: gate and up in one matmul
    return [(rows, h, up, copies), (rows, ffn // tp, h, copies)]


def block_matmuls(spec: ModelSpec, layout: Layout, layer: int) -> list[Matmul]:
    """The rank's matmuls of block ``layer`` per microbatch (qkv, proj and the MLP's or the
    experts')."""
    h, d, tp = spec.hidden_size, spec.head_dim, layout.tp
    rows = token_rows(spec, layout)
    qkv = (spec.num_heads // tp + 2 * spec.kv_heads_per_rank(tp)) * d
    out = [(rows, h, qkv, 1), (rows, spec.attention_width // tp, h, 1)]
    if not spec.is_moe_layer(layer):
        return out + _mlp(rows, h, spec.ffn_hidden_size, tp, spec.is_llama)
    moe = spec.moe
    local = moe.num_experts // layout.ep
    routed = rows * moe.top_k * layout.ep / moe.num_experts
    out += _mlp(routed, h, moe.ffn_hidden_size, tp, spec.is_llama, copies=local)
    if moe.shared_experts:
        out += _mlp(rows, h, moe.shared_experts * moe.ffn_hidden_size, tp, spec.is_llama)
    return out


def head_matmuls(spec: ModelSpec, layout: Layout) -> list[Matmul]:
    """The output head's matmul on the last pipeline stage (vocabulary split over tp)."""
    rows = token_rows(spec, layout)
    return [(rows, spec.hidden_size, spec.padded_vocab_size // layout.tp, 1)]


def efficiency(
    spec: ModelSpec, layout: Layout, hw: Hardware, layers: list[int], head: bool
) -> float:
    """The fraction of peak the FLOPs of ``layers`` (and the head) reach together on a rank."""
    e = layout.activation_bytes
    flops = time = 0.0
    kinds: dict[bool, tuple[float, float]] = {}  # dense / MoE block: (FLOPs, FLOPs / eff)
    for layer in layers:
        moe = spec.is_moe_layer(layer)
        if moe not in kinds:
            mms = block_matmuls(spec, layout, layer)
            attention = 12.0 * spec.seq_length * spec.attention_width * token_rows(spec, layout)
            attention /= layout.tp
            kinds[moe] = _add(mms, e, hw, attention, attention / hw.efficiency)
        flops, time = flops + kinds[moe][0], time + kinds[moe][1]
    if head:
        head_flops, head_time = _add(head_matmuls(spec, layout), e, hw, 0.0, 0.0)
        flops, time = flops + head_flops, time + head_time
    return flops / time if time else hw.efficiency


def _add(matmuls: list[Matmul], e: int, hw: Hardware, flops: float, time: float):
    """``(flops, flops / efficiency)`` summed over ``matmuls`` (forward and backward: 6 m k n)
    onto the given ones."""
    for m, k, n, copies in matmuls:
        f = 6.0 * m * k * n * copies
        flops += f
        time += f / matmul_efficiency(m, k, n, e, hw)
    return flops, time


def model_efficiency(spec: ModelSpec, layout: Layout, hw: Hardware) -> float:
    """The efficiency of all the model's FLOPs at ``layout``'s shapes (the advisor's column)."""
    return efficiency(spec, layout, hw, list(range(spec.num_layers)), head=True)
