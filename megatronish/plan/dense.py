"""The dense transformer blocks in the plan: what attention and the MLP keep for backward, the
embedding and the head, and their tensor-parallel (tp, sp) collectives.

The per-layer terms list the tensors megatronish's blocks actually save (fp32 or the bf16
dtype; ``s`` the rank's tokens of a sequence (:func:`~megatronish.plan.context_parallel.
rank_seq_length`), ``b`` micro batch, ``h`` hidden, ``t`` tp, ``a``/``g`` query/kv heads of size
``d``, ``f`` ffn hidden; ``s_r`` = s/t under sequence parallelism, else s):

- each of the two norms: RMSNorm its input and the normalised tensor (``2 s_r b h``) plus the
  rsqrt per token, LayerNorm its input (``s_r b h``) plus mean and rstd per token; the
  column-parallel linear after it keeps its input, the full-sequence ``s b h`` (all-gathered
  under sp);
- attention: the fused qkv output ``s b (a + 2g) d / t`` (V is a view of it), RoPE's rotated
  Q and K (llama; with ``model.qk_norm`` the per-head norms' statistics and, in fp32,
  normalised values), the SDPA output ``s b a d / t`` (also the projection's input) and its
  logsumexp ``b a s / t``; a fused SDPA kernel keeps no ``s x s`` matrix, the math kernel does
  (on a CPU with attention dropout), and K/V expanded for a fused kernel (fp32 grouped-query
  attention on CUDA) add ``2 b a s d / t`` (:func:`attention_core_bytes`); under cp the gathered
  K and V (:mod:`~megatronish.plan.context_parallel`);
- MLP: SwiGLU keeps gate|up ``2 s b f / t``, SiLU(gate) and the product (``s b f / t`` each);
  GELU keeps its input and output (``s b f / t`` each);
- dropout (p > 0): a 1-byte mask per element of each dropped tensor.

Korthikanti et al. (2022) count the same things for a 16-bit GeLU model with dropout
(``sbh (34 + 5as/h)`` per layer without parallelism); :func:`korthikanti_per_layer` gives their
formulas for comparison.

Communication (:func:`tp_volume`, CommStats' bytes): per layer and microbatch two collectives in
forward and two in backward (all-reduces, or under sp all-gathers and reduce-scatters of the
full-sequence activation), the embedding's and the head's, the vocabulary-parallel cross
entropy's three all-reduces, and under sp (or with per-head Q/K norms) one all-reduce of the
replicated params' partial grads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.context_parallel.attention_kernel import attention_kernel
from megatronish.model.flops import matmul_params
from megatronish.model.linear_cross_entropy import chunk_tokens
from megatronish.plan.context_parallel import (
    attention_mask,
    exchanged_bytes,
    gathered_kv_bytes,
    heads_exchanged,
    kv_length,
    rank_seq_length,
    ring,
)
from megatronish.plan.layout import Layout
from megatronish.plan.rank_model import meta_chunks
from megatronish.plan.recompute import reruns
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.sharding import param_info

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class LayerShape:
    s: int  # this rank's tokens of each sequence
    b: int
    h: int
    t: int
    a: int  # query heads per tp rank
    g: int  # kv heads per tp rank
    d: int
    f: int  # ffn hidden per tp rank
    s_r: int  # sequence held in the replicated regions (norms, residual)


def layer_shape(spec: ModelSpec, layout: Layout) -> LayerShape:
    t = layout.tp
    s = rank_seq_length(spec, layout)
    return LayerShape(
        s=s,
        b=layout.micro_batch_size,
        h=spec.hidden_size,
        t=t,
        a=spec.num_heads // t,
        g=spec.kv_heads_per_rank(t),
        d=spec.head_dim,
        f=spec.ffn_hidden_size // t,
        s_r=s // t if layout.sequence_parallel else s,
    )


def hidden_bytes(spec: ModelSpec, layout: Layout) -> int:
    """One microbatch's hidden state on a rank (``s_r b h``): a checkpointed group's input, a
    pipeline message."""
    x = layer_shape(spec, layout)
    return x.s_r * x.b * x.h * layout.activation_bytes


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
    CPU with attention dropout; on CUDA dropout runs in the fused kernels). Ring attention
    keeps the logsumexp alone, whichever kernel its blocks run (their temporaries:
    :func:`~megatronish.plan.context_parallel.ring_workspace`)."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    if ring(layout):
        return x.b * x.a * x.s * 4
    dropout = spec.attention_dropout
    dtype = torch.bfloat16 if e == 2 else torch.float32
    kernel = attention_kernel(
        layout.device_type, dtype, x.g != x.a, dropout, attention_mask(layout), x.d
    )
    out = x.b * x.a * x.s * 4  # logsumexp
    if kernel.expand_kv:
        out += 2 * x.b * x.a * kv_length(spec, layout) * x.d * e
    if kernel.name == "math":  # softmax (and with dropout its mask and the dropped softmax)
        out += x.b * x.a * x.s * x.s * (2 * e + 1 if dropout > 0 else e)
    return out


def mlp_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What the dense MLP keeps (its intermediates and the input its first linear saves): the
    part a mixture-of-experts block replaces."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    return x.s * x.b * x.f * e * (4 if spec.is_llama else 2) + x.s * x.b * x.h * e


def layer_bytes(spec: ModelSpec, layout: Layout, core: bool = True) -> int:
    """Bytes one transformer layer keeps for backward per microbatch (no recompute).

    ``core=False`` leaves out the attention core's own saved tensors (selective recompute).
    """
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens_r, tokens = x.s_r * x.b, x.s * x.b
    norms = 2 * _norm_bytes(spec, x, e)
    attn = tokens * (x.a + 2 * x.g) * x.d * e + tokens * x.a * x.d * e  # qkv out, SDPA out
    if heads_exchanged(layout):
        attn += exchanged_bytes(tokens, x.a, x.d, e)
    elif spec.is_llama or spec.qk_norm:
        attn += tokens * (x.a + x.g) * x.d * e  # rotated (or normalised) Q and K
    attn += _qk_norm_bytes(spec, x, e)
    attn += gathered_kv_bytes(tokens, x.g, x.d, e, layout)
    if core:
        attn += attention_core_bytes(spec, layout)
    mlp = tokens * x.f * e * (4 if spec.is_llama else 2)
    dropout = 2 * tokens_r * x.h if spec.hidden_dropout > 0 else 0
    fp8 = fp8_attention_bytes(spec, layout) + fp8_mlp_bytes(spec, layout)
    return norms + attn + mlp + dropout + fp8


def fp8_attention_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What fp8 linears (``trainer.fp8=tensorwise``) change in attention's saved bytes: the qkv
    linear keeps its full-sequence input in fp8 (1 byte an element, not ``e``); the projection
    keeps an fp8 copy of its input beside the SDPA output it shares in bf16. Rowwise keeps the
    bf16 inputs (backward casts them along other axes): no change. With
    ``fp8_skip_first_last`` the plan counts only the copies, not the savings: it stays an
    upper bound for the stages that hold bf16 blocks."""
    if layout.fp8 != "tensorwise":
        return 0
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens = x.s * x.b
    copy = tokens * x.a * x.d
    return copy if layout.fp8_skip_first_last else copy - tokens * x.h * (e - 1)


def fp8_mlp_bytes(spec: ModelSpec, layout: Layout) -> int:
    """The dense MLP's part of :func:`fp8_attention_bytes`: fc1's full-sequence input and fc2's
    input (the product or GELU output only fc2 keeps) in fp8."""
    if layout.fp8 != "tensorwise" or layout.fp8_skip_first_last:
        return 0
    x, e = layer_shape(spec, layout), layout.activation_bytes
    return -x.s * x.b * (x.h + x.f) * (e - 1)


def _qk_norm_bytes(spec: ModelSpec, x: LayerShape, e: int) -> int:
    """``model.qk_norm``: what the per-head norms of Q and K keep besides their input (a view of
    the qkv output): RMSNorm the rsqrt per head and token and in fp32 the normalised tensor,
    LayerNorm the mean and rstd."""
    if not spec.qk_norm:
        return 0
    rows = x.s * x.b * (x.a + x.g)
    if not spec.is_llama:
        return 2 * rows * FP32
    return rows * FP32 + (rows * x.d * e if e == FP32 else 0)


def attention_weight_grad_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What the weight-gradient work (W of a split backward) of a block's norms and attention
    keeps from the block's B to its W, per microbatch: each layer's saved tensors (the two norms'
    own, the qkv and projection inputs; the MLP's are :func:`mlp_weight_grad_bytes`) and the
    grad of its output (``s_r b h`` per norm,
    ``s b (a + 2g) d / t`` and ``s b h``)."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens_r, tokens = x.s_r * x.b, x.s * x.b
    saved = 2 * _norm_bytes(spec, x, e) - tokens * x.h * e + tokens * x.a * x.d * e
    grads = 2 * tokens_r * x.h * e + tokens * (x.a + 2 * x.g) * x.d * e + tokens * x.h * e
    if spec.qk_norm:  # the per-head norms' output grads
        grads += tokens * (x.a + x.g) * x.d * e
    return saved + grads + _qk_norm_bytes(spec, x, e)


def mlp_weight_grad_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What the dense MLP's W keeps from B: its linears' inputs (``s b h``, ``s b f / t``) and
    output grads (``s b f / t``, twice that for SwiGLU's gate|up, and ``s b h``): the part a
    mixture-of-experts block replaces."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens = x.s * x.b
    width = 2 if spec.is_llama else 1
    return tokens * (x.h + x.f) * e + tokens * (width * x.f + x.h) * e


def head_weight_grad_bytes(spec: ModelSpec, layout: Layout) -> int:
    """What the head's W keeps from B: the final norm's tensors and output grad; at tp > 1 the
    vocab-parallel logits' grad (``s b V / t``) beside the projection's input; at tp = 1 the
    weight's grad, computed in forward and already counted (:func:`head_bytes`)."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    norm = _norm_bytes(spec, x, e) + x.s_r * x.b * x.h * e
    if x.t == 1:
        return norm - x.s * x.b * x.h * e  # the projection's input is the grad computed ahead
    return norm + x.s * x.b * (spec.padded_vocab_size // x.t) * e


def embedding_numel(spec: ModelSpec, layout: Layout) -> int:
    """Elements of a tp rank's shard of the (vocabulary-parallel) word embedding."""
    return spec.padded_vocab_size // layout.tp * spec.hidden_size


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
    """Temporaries alive while the last chunk computes the loss, beside what it keeps.

    At tp > 1 the vocabulary-parallel cross entropy (``tensor_parallel/cross_entropy.py``)
    shifts the fp32 logits into a new buffer and turns it into the softmax in place: that is the
    softmax :func:`head_bytes` already counts, not a temporary. Beside it (per element of the
    rank's ``[s b, V / t]`` logits): the logits in the activation dtype, and one fp32 buffer on
    the rank holding padding (the copy with the padding masked) or under bf16 (the logits in
    fp32, which the masked copy replaces); an fp32 rank without padding holds the logits alone.
    """
    x, e = layer_shape(spec, layout), layout.activation_bytes
    tokens = x.s * x.b
    if x.t == 1:  # one chunk's logits and fp32 log-probabilities (bf16: and the logits in fp32)
        v = spec.padded_vocab_size  # the GEMM runs over the padded rows (linear_cross_entropy)
        chunk = chunk_tokens(tokens, x.h, v)
        return chunk * v * (e + 4) + (chunk * v * 4 if e < 4 else 0)
    copy = FP32 if spec.padded_vocab_size > spec.vocab_size or e < FP32 else 0
    return tokens * (spec.padded_vocab_size // x.t) * (e + copy)


def backward_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Temporaries of one layer's backward: the incoming activation grad and the grad of the
    MLP's first projection output, the largest intermediate grad."""
    x, e = layer_shape(spec, layout), layout.activation_bytes
    width = 2 * x.f if spec.is_llama else x.f
    return x.s * x.b * x.h * e + x.s * x.b * width * e


def sp_workspace(spec: ModelSpec, layout: Layout) -> int:
    """Under sp, the full-sequence buffers of a layer's collectives in backward (a gathered
    grad and a reduce-scatter input), as measured with gloo."""
    if not layout.sequence_parallel:
        return 0
    x = layer_shape(spec, layout)
    return 2 * x.s * x.b * x.h * layout.activation_bytes


def tp_volume(
    spec: ModelSpec, layout: Layout, pp_rank: int, chunks: list | None = None
) -> dict[str, tuple[int, int]]:
    """``{"tp/op": (calls, bytes)}`` of one step's forward and backward on pipeline rank
    ``pp_rank`` (``chunks``: its :func:`~megatronish.plan.rank_model.meta_chunks`, when
    already built)."""
    if layout.tp == 1:
        return {}
    layers = layout.chunk_layers(spec.num_layers)
    mine = layout.stage_chunks(pp_rank)
    n_layers = sum(layers[c] for c in mine)
    redo, groups = reruns(spec, layout, pp_rank)
    first, last = 0 in mine, len(layers) - 1 in mine
    m, b, h = layout.num_microbatches, layout.micro_batch_size, spec.hidden_size
    s = rank_seq_length(spec, layout)
    act = s * b * h * layout.activation_bytes
    # Full recompute repeats a checkpointed group's forward collectives (two per layer) up to
    # the last saved tensor it must rebuild: the group's final reduction is skipped.
    per_mb = 4 * n_layers + int(first) + int(last)
    out: dict[str, tuple[int, int]] = {}
    if layout.sequence_parallel:
        ag, rs = per_mb + 2 * redo, per_mb + 2 * redo - groups
        out["tp/all_gather"] = (m * ag, m * ag * act)
        out["tp/reduce_scatter"] = (m * rs, m * rs * act)
    else:
        ar = per_mb + 2 * redo - groups
        out["tp/all_reduce"] = (m * ar, m * ar * act)
    # Partial grads summed over tp in one all-reduce per step: replicated params fed by
    # sequence shards or per-head norms, and the whole k|v blocks where kv heads are replicated
    # (each rank's copy placed at its head).
    partial = replicated_kv_grad_numel(spec, layout) * n_layers
    if layout.sequence_parallel or spec.qk_norm:
        if chunks is None:
            chunks = meta_chunks(spec, layout, pp_rank)
        partial += _partial_grad_numel(chunks)
    if partial:
        calls, nbytes = out.get("tp/all_reduce", (0, 0))
        out["tp/all_reduce"] = (calls + 1, nbytes + partial * FP32)
    if last:  # the vocabulary-parallel cross entropy: max, target logit, sum of exp
        calls, nbytes = out.get("tp/all_reduce", (0, 0))
        out["tp/all_reduce"] = (calls + 3 * m, nbytes + 3 * m * s * b * 4)
    return out


def _partial_grad_numel(chunks: list) -> int:
    """Elements of replicated params whose grads are partial on each tp rank (fed by sequence
    shards, or per-head norms of each rank's heads)."""
    return sum(p.numel() for c in chunks for p in c.parameters() if param_info(p).sequence_parallel)


def replicated_kv_grad_numel(spec: ModelSpec, layout: Layout) -> int:
    """Per block, the elements of the k and v blocks (weights and biases) whose replicated
    copies' grads are summed over tp; 0 unless there are fewer kv heads than tp ranks."""
    if spec.num_kv_heads >= layout.tp:
        return 0
    return 2 * spec.num_kv_heads * spec.head_dim * (spec.hidden_size + int(spec.bias))


def stage_flops_per_token(spec: ModelSpec, layers: list[int], head: bool) -> float:
    """Model FLOPs per token of the pipeline's tokens that the blocks ``layers`` (and the head)
    do, every block alike (``6 N + 12 s a d`` per token, :mod:`megatronish.model.flops`)."""
    L, s, h = spec.num_layers, spec.attention_span, spec.hidden_size
    vocab = spec.padded_vocab_size * h
    per_layer = 6.0 * (matmul_params(spec) - vocab) / L + 12.0 * s * spec.attention_width
    return len(layers) * per_layer + (6.0 * vocab if head else 0.0)


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
