"""Activation memory per rank: what autograd keeps for backward, per layer and per schedule.

The per-layer terms list the tensors megatronish's blocks actually save (fp32 or the bf16
dtype; ``s`` sequence, ``b`` micro batch, ``h`` hidden, ``t`` tp, ``a``/``g`` query/kv heads of
size ``d``, ``f`` ffn hidden; ``s_r`` = s/t under sequence parallelism, else s):

- each of the two norms: RMSNorm its input and the normalised tensor (``2 s_r b h``) plus the
  rsqrt per token, LayerNorm its input (``s_r b h``) plus mean and rstd per token; the
  column-parallel linear after it keeps its input, the full-sequence ``s b h`` (all-gathered
  under sp);
- attention: the fused qkv output ``s b (a + 2g) d / t`` (V is a view of it), RoPE's rotated
  Q and K (llama), the SDPA output ``s b a d / t`` (also the projection's input) and its
  logsumexp ``b a s / t``; a fused SDPA kernel keeps no ``s x s`` matrix, the math kernel does
  (on a CPU with attention dropout), and K/V expanded for a fused kernel (fp32 grouped-query
  attention on CUDA) add ``2 b a s d / t`` (:func:`attention_core_bytes`);
- MLP: SwiGLU keeps gate|up ``2 s b f / t``, SiLU(gate) and the product (``s b f / t`` each);
  GELU keeps its input and output (``s b f / t`` each);
- dropout (p > 0): a 1-byte mask per element of each dropped tensor;
- context parallelism (cp > 1): every term above counts the rank's ``s = seq / cp`` tokens, and
  attention also keeps the whole sequence's gathered K and V (``cp s b 2g d``).

Korthikanti et al. (2022) count the same things for a 16-bit GeLU model with dropout
(``sbh (34 + 5as/h)`` per layer without parallelism); ``korthikanti_per_layer`` gives their
formulas for comparison. Recompute: ``selective`` drops the attention core's saved tensors (the
logsumexp, expanded K/V and any ``s x s`` tensors), ``full`` keeps one ``s_r b h`` input per
checkpointed group and rebuilds the group's activations during its backward.

Mixture-of-experts blocks keep their routing and experts' tensors in place of the dense MLP's
(:func:`megatronish.plan.moe.mlp_bytes`).

In-flight microbatches come from walking the rank's pipeline schedule (a forward adds its chunk's
activations, the matching backward frees them), which gives Megatron's interleaving factor
``1 + (p - 1) / (p v)`` on the first stage for free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatronish.context_parallel.attention_kernel import attention_kernel
from megatronish.model.linear_cross_entropy import chunk_tokens
from megatronish.model.spec import ModelSpec
from megatronish.pipeline.schedule import schedule_ops
from megatronish.plan import moe
from megatronish.plan.layout import Layout

INT64 = 8


@dataclass(frozen=True)
class LayerShape:
    s: int
    b: int
    h: int
    t: int
    a: int  # query heads per tp rank
    g: int  # kv heads per tp rank
    d: int
    f: int  # ffn hidden per tp rank
    s_r: int  # sequence held in the replicated regions (norms, residual)
    cp: int = 1  # context parallel: ``s`` is this rank's seq / cp tokens


def layer_shape(spec: ModelSpec, layout: Layout) -> LayerShape:
    t = layout.tp
    s = spec.seq_length // layout.cp  # this cp rank's tokens of each sequence
    return LayerShape(
        s=s,
        b=layout.micro_batch_size,
        h=spec.hidden_size,
        t=t,
        a=spec.num_heads // t,
        g=spec.num_kv_heads // t,
        d=spec.head_dim,
        f=spec.ffn_hidden_size // t,
        s_r=s // t if layout.sequence_parallel else s,
        cp=layout.cp,
    )


def _norm_bytes(spec: ModelSpec, x: LayerShape, e: int) -> int:
    """A norm and the column-parallel linear it feeds: RMSNorm keeps its input, the normalised
    tensor (fp32 only) and the rsqrt; LayerNorm its input, mean and rstd; the linear its
    full-sequence input."""
    tokens_r = x.s_r * x.b
    if spec.is_llama and e < 4:  # model/rms_norm.py: the input and the rsqrt
        own = tokens_r * x.h * e + tokens_r * 4
    elif spec.is_llama:
        own = 2 * tokens_r * x.h * e + tokens_r * 4
    else:
        own = tokens_r * x.h * e + 2 * tokens_r * 4
    return own + x.s * x.b * x.h * e


def attention_core_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What SDPA keeps for backward besides its inputs and output, by the kernel the table of
    :func:`~megatronish.context_parallel.attention_kernel.attention_kernel` picks for the plan's
    device (CUDA: an sm80+ GPU on torch <= 2.13): the logsumexp; K and V expanded to the query
    heads (``2 b a (cp s) d``, the whole sequence's under cp) where the rule expands them (fp32
    grouped-query attention on CUDA); the ``s x s`` scores only where the math kernel runs (a
    CPU with attention dropout; on CUDA dropout runs in the fused kernels)."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    cuda, dropout = layout.device_type == "cuda", spec.attention_dropout
    mask = ("lower_right" if cuda else "tensor") if x.cp > 1 else "causal"
    dtype = torch.bfloat16 if e == 2 else torch.float32
    kernel = attention_kernel(layout.device_type, dtype, x.g != x.a, dropout, mask, x.d)
    out = x.b * x.a * x.s * 4  # logsumexp
    if kernel.expand_kv:
        out += 2 * x.b * x.a * x.cp * x.s * x.d * e
    if kernel.name == "math":  # softmax (and with dropout its mask and the dropped softmax)
        out += x.b * x.a * x.s * x.s * (2 * e + 1 if dropout > 0 else e)
    return out


def layer_bytes(spec: ModelSpec, layout: Layout, core: bool = True) -> int:
    """Bytes one transformer layer keeps for backward per microbatch (no recompute).

    ``core=False`` leaves out the attention core's own saved tensors (selective recompute).
    """
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens_r, tokens = x.s_r * x.b, x.s * x.b
    norms = 2 * _norm_bytes(spec, x, e)
    attn = tokens * (x.a + 2 * x.g) * x.d * e + tokens * x.a * x.d * e  # qkv out, SDPA out
    if spec.is_llama:
        attn += tokens * (x.a + x.g) * x.d * e  # rotated Q and K
    if x.cp > 1:  # the whole sequence's K and V, gathered over cp
        attn += x.cp * tokens * 2 * x.g * x.d * e
    if core:
        attn += attention_core_bytes(spec, layout)
    mlp = tokens * x.f * e * (4 if spec.is_llama else 2)
    dropout = 2 * tokens_r * x.h if spec.hidden_dropout > 0 else 0
    return norms + attn + mlp + dropout


def block_bytes(spec: ModelSpec, layout: Layout, moe_block: bool, core: bool = True) -> int:
    """:func:`layer_bytes` of a dense block, or of a mixture-of-experts one (its MLP and the
    MLP's input replaced by what the router, dispatch and experts keep)."""
    dense = layer_bytes(spec, layout, core)
    if not moe_block:
        return dense
    x, e = layer_shape(spec, layout), layout.activation_bytes
    mlp = x.s * x.b * x.f * e * (4 if spec.is_llama else 2) + x.s * x.b * x.h * e
    return dense - mlp + moe.mlp_bytes(spec, layout)


def _blocks(spec: ModelSpec, layout: Layout, flags: tuple[bool, ...], core: bool = True) -> int:
    return sum(block_bytes(spec, layout, f, core) for f in flags)


def embedding_bytes(spec: ModelSpec, layout: Layout) -> int:
    """The first chunk's token ids (and masks under tp / dropout)."""
    x = layer_shape(spec, layout)
    out = x.s * x.b * INT64
    if x.t > 1:
        out += x.s * x.b * (INT64 + 1)  # local ids and the out-of-range mask
    if spec.hidden_dropout > 0:
        out += x.s_r * x.b * x.h
    return out


def head_bytes(spec: ModelSpec, layout: Layout) -> int:
    """The last chunk's final norm and what the loss keeps: at tp = 1 the grads of the head's
    input and weight (computed in forward, ``model/linear_cross_entropy.py``), at tp > 1 the
    head input and the vocab-parallel softmax."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens = x.s * x.b
    norm = _norm_bytes(spec, x, e)
    if x.t == 1:  # the grad of the head input takes the place of the input itself
        return norm + spec.padded_vocab_size * x.h * 4
    return norm + tokens * (spec.padded_vocab_size // x.t) * 4 + tokens * (INT64 + 1)


def loss_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Temporaries alive while the last chunk computes the loss (logits and their copies)."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens = x.s * x.b
    if x.t == 1:  # one chunk's logits and fp32 log-probabilities (bf16: and the logits in fp32)
        v = spec.padded_vocab_size  # the GEMM runs over the padded rows (linear_cross_entropy)
        chunk = chunk_tokens(tokens, x.h, v)
        return chunk * v * (e + 4) + (chunk * v * 4 if e < 4 else 0)
    # logits, their copy with padding masked (on the rank holding padding), shifted (then exp)
    buffers = 3 if spec.padded_vocab_size > spec.vocab_size else 2
    return buffers * tokens * (spec.padded_vocab_size // x.t) * 4


def backward_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Temporaries of one layer's backward: the incoming activation grad and the grad of the
    MLP's first projection output, the largest intermediate grad."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    width = 2 * x.f if spec.is_llama else x.f
    dense = x.s * x.b * x.h * e + x.s * x.b * width * e
    if spec.moe is None:
        return dense
    kinds = {spec.is_moe_layer(i) for i in range(spec.num_layers)}
    return max(moe.backward_workspace(spec, layout) if k else dense for k in kinds)


def p2p_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Pipeline buffers beside a compute. Groups complete before the next compute, so 1F1B holds
    none there (a received grad is the backward's incoming grad); interleaved 1F1B receives a
    pair's grad before its forward and sends the forward's output after its backward: one
    activation (``pipeline/grouping.py``)."""
    if layout.pp == 1 or layout.vpp == 1:
        return 0
    x = layer_shape(spec, layout)
    return x.s_r * x.b * x.h * layout.activation_bytes


def sp_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Under sp, the full-sequence buffers of a layer's collectives in backward (a gathered
    grad and a reduce-scatter input), as measured with gloo."""
    if not layout.sequence_parallel:
        return 0
    x = layer_shape(spec, layout)
    return 2 * x.s * x.b * x.h * layout.activation_bytes


def chunk_bytes(
    spec: ModelSpec, layout: Layout, layers: int, first: bool, last: bool, flags: tuple = ()
) -> int:
    """Bytes one microbatch's forward of a chunk keeps until its backward (``flags``: which of
    its blocks are mixtures of experts; empty: none)."""
    x, flags = layer_shape(spec, layout), flags or (False,) * layers
    group_input = x.s_r * x.b * x.h * layout.activation_bytes
    if layout.recompute == "full":
        n = layout.recompute_num_layers
        if layout.recompute_method == "uniform":
            body = math.ceil(layers / n) * group_input
        else:
            body = min(n, layers) * group_input + _blocks(spec, layout, flags[n:])
    else:
        body = _blocks(spec, layout, flags, core=layout.recompute != "selective")
    return (
        body
        + (embedding_bytes(spec, layout) if first else 0)
        + (head_bytes(spec, layout) if last else 0)
    )


def recompute_workspace(
    spec: ModelSpec, layout: Layout, layers: int, last: bool, flags: tuple = ()
) -> int:
    """Net bytes a chunk's backward adds while it rebuilds its first checkpointed group (full
    recompute): that group's activations, less what the chunk's backward freed before it (the
    head's tensors, and under ``block`` the layers kept after the checkpointed ones); with
    mixture-of-experts blocks (``flags``), the largest group's."""
    freed = head_bytes(spec, layout) if last else 0
    if layout.recompute != "full":
        return -freed
    n, flags = min(layout.recompute_num_layers, layers), flags or (False,) * layers
    runs = [flags[i : i + n] for i in range(0, layers, max(n, 1))]  # the checkpointed groups
    if layout.recompute_method == "block":  # one layer at a time, the rest kept
        runs = [flags[i : i + 1] for i in range(n)]
        freed += _blocks(spec, layout, flags[n:])
    rebuilt = max((_blocks(spec, layout, r) for r in runs), default=0)
    x = layer_shape(spec, layout)
    group_input = x.s_r * x.b * x.h * layout.activation_bytes  # already kept by the checkpoint
    return rebuilt - group_input - freed


def peak_in_flight(pp: int, vpp: int, microbatches: int, pp_rank: int, sizes: dict) -> float:
    """Peak of ``sum(sizes[chunk])`` over forwards whose backward has not run yet, walking the
    rank's schedule; without a pipeline one microbatch of every chunk at a time."""
    mine = [pp_rank + v * pp for v in range(vpp)]
    if pp == 1:
        return sum(sizes[c] for c in mine)
    live = peak = 0
    for op in schedule_ops(pp, vpp, microbatches, pp_rank):
        if op.kind == "fwd":
            live += sizes[op.chunk]
            peak = max(peak, live)
        elif op.kind == "bwd":
            live -= sizes[op.chunk]
    return peak


def kept_per_layer(spec: ModelSpec, layout: Layout) -> float:
    """Bytes a layer keeps per microbatch under the recompute policy (full recompute: its
    share of a checkpointed group's input)."""
    core = layout.recompute != "selective"
    if layout.recompute != "full" and spec.moe is not None:  # the mean over the model's blocks
        flags = [spec.is_moe_layer(i) for i in range(spec.num_layers)]
        return _blocks(spec, layout, tuple(flags), core) / spec.num_layers
    if layout.recompute != "full":
        return layer_bytes(spec, layout, core=core)
    x = layer_shape(spec, layout)
    group_input = x.s_r * x.b * x.h * layout.activation_bytes
    n = layout.recompute_num_layers
    return group_input / n if layout.recompute_method == "uniform" else group_input


@dataclass(frozen=True)
class ActivationPlan:
    per_layer: float  # bytes a layer keeps per microbatch under the recompute policy
    in_flight: float  # peak microbatches (in units of this rank's whole model part) alive
    saved_peak: int  # peak bytes kept for backward over the step
    workspace: int  # temporaries on top of the saved peak
    peak: int  # saved_peak + workspace


def activation_plan(spec: ModelSpec, layout: Layout, pp_rank: int) -> ActivationPlan:
    """Peak activation memory of a rank of pipeline stage ``pp_rank`` during a step."""
    layers = layout.chunk_layers(spec.num_layers)
    n_chunks = len(layers)
    flags = moe.chunk_flags(spec, layout) if spec.moe is not None else [()] * n_chunks
    sizes = {
        c: chunk_bytes(spec, layout, layers[c], c == 0, c == n_chunks - 1, flags[c])
        for c in range(n_chunks)
    }
    mine = [pp_rank + v * layout.pp for v in range(layout.vpp)]
    peak = peak_in_flight(layout.pp, layout.vpp, layout.num_microbatches, pp_rank, sizes)
    # The peak is either at the loss (the last chunk's logits on top of everything kept) or in
    # the first layers' backward (the head's tensors freed, a recomputed group rebuilt).
    holds_loss = n_chunks - 1 in mine
    at_loss = loss_workspace(spec, layout) if holds_loss else 0
    in_backward = backward_workspace(spec, layout) + max(
        recompute_workspace(spec, layout, layers[c], c == n_chunks - 1, flags[c]) for c in mine
    )
    in_backward += sp_workspace(spec, layout)
    work = max(at_loss, in_backward, 0) + p2p_workspace(spec, layout)
    per_rank_part = sum(sizes[c] for c in mine)
    return ActivationPlan(
        per_layer=kept_per_layer(spec, layout),
        in_flight=peak / per_rank_part if per_rank_part else 0.0,
        saved_peak=peak,
        workspace=work,
        peak=peak + work,
    )


def korthikanti_per_layer(spec: ModelSpec, layout: Layout) -> float:
    """Korthikanti et al.'s published bytes per layer (16-bit, dropout, GeLU MLP of 4h)."""
    s, b, h = spec.seq_length, layout.micro_batch_size, spec.hidden_size
    a, t = spec.num_heads, layout.tp
    sbh = s * b * h
    if layout.recompute == "full":
        return 2 * sbh / (t if layout.sequence_parallel else 1)
    if layout.recompute == "selective":
        return sbh * 34 / t if layout.sequence_parallel else sbh * (10 + 24 / t)
    if layout.sequence_parallel:
        return sbh * (34 / t + 5 * a * s / (h * t))
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def interleaving_factor(pp: int, vpp: int) -> float:
    """Korthikanti et al.'s factor on the first stage's ``pp`` in-flight microbatches under the
    interleaved schedule (vpp > 1); plain 1F1B keeps exactly ``pp``."""
    return 1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0
