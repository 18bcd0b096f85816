"""Transformer blocks on ``[s, b, h]`` activations, written as a plain model.

Linear layers are the tensor-parallel ones; with a tp group of one they are ordinary linears, so
this file reads like a single-device GPT. Under sequence parallelism the norms and residual adds
see a sequence shard ``[s/tp, b, h]``; under context parallelism every activation holds this cp
rank's ``s/cp`` tokens and attention gathers the keys and values of the rest.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.context_parallel.attention import (
    CPContext,
    causal_mask,
    cp_causal_attention,
    gather_sequence,
)
from megatronish.context_parallel.attention_kernel import sdpa
from megatronish.context_parallel.document_attention import document_attention
from megatronish.context_parallel.documents import Documents
from megatronish.context_parallel.head_exchange import heads_to_sequence, qkv_to_heads
from megatronish.context_parallel.ring import ring_attention
from megatronish.model.layer_norm import layer_norm
from megatronish.model.parallel_context import ParallelContext
from megatronish.model.rms_norm import rms_norm
from megatronish.moe.layer import MoELayer
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatronish.tensor_parallel.sharding import mark_param
from megatronish.tensor_parallel.weight_grad import WeightGradStore


class Norm(nn.Module):
    """RMSNorm (llama) or LayerNorm (gpt2) over the last ``size`` values (default: the hidden
    size); weights replicated over tp.

    ``per_head``: the norm of each attention head (``model.qk_norm``). Every tp rank holds other
    heads of the same tokens, so its weight's grad is partial there, summed over tp as a
    sequence-parallel norm's is (Megatron-LM sums its q/k layernorm grads over tp alike).
    """

    def __init__(
        self,
        spec: ModelSpec,
        tp: TPContext,
        device: torch.device | str | None = None,
        size: int | None = None,
        per_head: bool = False,
    ):
        super().__init__()
        self.rms, self.eps = spec.is_llama, spec.norm_eps
        size = size or spec.hidden_size
        partial = tp.size > 1 if per_head else tp.sequence_parallel
        self.weight = mark_param(
            nn.Parameter(torch.empty(size, device=device)),
            init="ones",
            sequence_parallel=partial,
            weight_decay=False,
        )
        self.bias = None
        if not self.rms:
            self.bias = mark_param(
                nn.Parameter(torch.empty(size, device=device)),
                init="zeros",
                sequence_parallel=partial,
                weight_decay=False,
            )
        self.weight_grad_store: WeightGradStore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:  # bf16: computed in fp32, rounded once (rms_norm_kernel picks how)
            return rms_norm(x, self.weight, self.eps, self.weight_grad_store)
        return layer_norm(x, self.weight, self.bias, self.eps, self.weight_grad_store)


def rope_tables(
    seq: int, dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables ``[s, 1, 1, dim]`` for the rotate-half convention (as in HF
    Llama); the sin table's first half is negated, so :func:`apply_rope` needs no negation."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    sin = freqs.sin()
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    return emb.cos(), torch.cat([-sin, sin], dim=-1)[:, None, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by position: ``x cos + [-x2, x1] sin`` with ``x1, x2``
    its halves (the sign is in the table)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + swapped.float() * signed_sin).to(x.dtype)


class KVCache:
    """One layer's keys and values of the tokens decoded so far (generation, tp = cp = 1).

    Buffers ``[b, kv_heads, capacity, d]`` are allocated once; each :meth:`extend` writes the
    next tokens' keys and values after the ``length`` held.
    """

    def __init__(
        self,
        spec: ModelSpec,
        batch: int,
        capacity: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value held, once ``k`` and ``v`` ``[b, kv_heads, s, d]`` are appended."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} tokens, {end} are needed")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads split over tp (and, under context
    parallelism, local queries against the keys and values of the whole sequence)."""

    def __init__(
        self,
        spec: ModelSpec,
        tp: TPContext,
        cp: CPContext,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        d, h = spec.head_dim, spec.hidden_size
        self.spec, self.tp, self.cp = spec, tp, cp
        self.q_heads = spec.num_heads // tp.size
        # Fewer kv heads than tp ranks: each kv head on tp / kv ranks, beside its query heads.
        self.kv_heads = spec.kv_heads_per_rank(tp.size)
        sp = tp.sequence_parallel
        out_std = spec.init_std / math.sqrt(2 * spec.num_layers)
        q, kv = spec.num_heads, spec.num_kv_heads
        self.qkv = ColumnParallelLinear(
            h,
            (q + 2 * kv) * d,
            tp.group,
            bias=spec.bias,
            sequence_parallel=sp,
            blocks=(q * d, kv * d, kv * d),
            block_heads=(q, kv, kv),
            init_std=spec.init_std,
            device=device,
        )
        self.proj = RowParallelLinear(
            spec.attention_width,
            h,
            tp.group,
            bias=spec.bias,
            sequence_parallel=sp,
            init_std=out_std,
            device=device,
        )
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = Norm(spec, tp, device, size=d, per_head=True)
            self.k_norm = Norm(spec, tp, device, size=d, per_head=True)
        self.core_runner = None  # selective recompute wraps the attention core
        # The core's view of the sequence: after an all-to-all it holds the whole sequence
        # (of fewer heads), as one process does, or (a2a_ring) a ring's share of it.
        self.core_cp = cp.core_context()

    def core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v with attention dropout, ``[b, heads, s, d]``; K and
        V keep their grouped heads unless the kernel needs them expanded (attention_kernel).
        With ``documents`` whose ``ids`` are set, queries see only their own document."""
        p = self.spec.attention_dropout if self.training else 0.0
        if p > 0 and self.tp.rng is not None and self.tp.size > 1:
            with self.tp.rng.fork("tp"):  # each rank drops its own heads' probabilities
                return self._attend(q, k, v, p, documents)
        return self._attend(q, k, v, p, documents)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: float,
        documents: Documents | None,
    ) -> torch.Tensor:
        if self.core_cp.size > 1 and self.core_cp.comm_type == "ring":  # K/V travel the ring
            return ring_attention(q, k, v, self.core_cp, documents)
        if documents is not None and documents.ids is not None:
            return document_attention(q, k, v, documents, self.core_cp, p)
        if self.core_cp.size > 1:  # local queries, the whole sequence's keys and values
            return cp_causal_attention(q, k, v, self.core_cp, p)
        return sdpa(q, k, v, "causal", dropout_p=p, is_causal=True)

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the last ``q.shape[2]`` positions to every key (no dropout)."""
        s, keys = q.shape[2], k.shape[2]
        if s == keys:  # the prompt, into an empty cache
            return sdpa(q, k, v, "causal", is_causal=True)
        if s == 1:
            return sdpa(q, k, v, "none")
        mask = causal_mask(s, keys, q.device, q.dtype)
        return sdpa(q, k, v, "lower_right" if q.is_cuda else "tensor", attn_mask=mask)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """``rope``: cos and signed sin tables, ``[s, 1, 1, d]`` or, with per-document
        positions, ``[s, b, 1, d]``."""
        d, heads = self.spec.head_dim, self.q_heads + self.kv_heads
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        qk, v = qkv.split([heads * d, self.kv_heads * d], dim=-1)  # local [q | k | v]
        qk = qk.view(s, b, heads, d)
        if self.q_norm is not None:
            q, k = qk.split([self.q_heads, self.kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        if rope is not None:  # q and k rotated in one pass
            qk = apply_rope(qk, rope[0][:s], rope[1][:s])
        q, k = qk.split([self.q_heads, self.kv_heads], dim=2)
        v = v.view(s, b, self.kv_heads, d)
        heads_group = self.cp.heads_group
        if heads_group is not None:  # more of the sequence for fewer heads, in one all-to-all
            q, k, v = qkv_to_heads(q, k, v, heads_group)
        elif self.cp.size > 1 and self.cp.comm_type == "all_gather":  # one k|v all-gather
            kv = gather_sequence(torch.cat([k, v], dim=2), self.cp)
            k, v = kv.split([self.kv_heads, self.kv_heads], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if cache is not None:  # decoding: these queries see every token the cache holds
            out = self._attend_cached(q, *cache.extend(k, v))
        elif self.core_runner is not None:
            out = self.core_runner(self.core, q, k, v, documents)
        else:
            out = self.core(q, k, v, documents)
        out = out.permute(2, 0, 1, 3)  # [s, b, heads, d]
        if heads_group is not None:
            out = heads_to_sequence(out, heads_group)
        return self.proj(out.reshape(s, b, self.q_heads * d))


class MLP(nn.Module):
    """SwiGLU (llama) or GELU (gpt2) feed-forward; hidden units split over tp."""

    def __init__(self, spec: ModelSpec, tp: TPContext, device: torch.device | str | None = None):
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.llama = spec.is_llama
        sp = tp.sequence_parallel
        out_std = spec.init_std / math.sqrt(2 * spec.num_layers)
        blocks = (f, f) if self.llama else (f,)
        self.fc1 = ColumnParallelLinear(
            h,
            sum(blocks),
            tp.group,
            bias=spec.bias,
            sequence_parallel=sp,
            blocks=blocks,
            init_std=spec.init_std,
            device=device,
        )
        self.fc2 = RowParallelLinear(
            f, h, tp.group, bias=spec.bias, sequence_parallel=sp, init_std=out_std, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.llama:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return self.fc2(y)


def moe_layer(
    spec: ModelSpec, ctx: ParallelContext, device: torch.device | str | None = None, layer: int = 0
) -> MoELayer:
    """Block ``layer``'s mixture-of-experts MLP, with its shared experts as one dense MLP (no
    biases)."""
    moe, shared, tp = spec.moe, None, ctx.tp
    if moe.shared_experts:
        size = moe.shared_experts * moe.ffn_hidden_size
        shared = MLP(replace(spec, ffn_hidden_size=size, bias=False), tp, device)
    return MoELayer(spec, tp, ctx.cp, ctx.ep, device, shared=shared, layer_id=layer)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``+ drop(mlp(norm(.)))``; the MLP is a
    mixture of experts in the blocks ``model.moe.layer_freq`` picks."""

    def __init__(
        self,
        spec: ModelSpec,
        ctx: ParallelContext,
        device: torch.device | str | None = None,
        layer: int = 0,
    ):
        super().__init__()
        tp = ctx.tp
        self.spec, self.tp = spec, tp
        self.attn_norm = Norm(spec, tp, device)
        self.attn = Attention(spec, tp, ctx.cp, device)
        self.mlp_norm = Norm(spec, tp, device)
        self.mlp = (
            moe_layer(spec, ctx, device, layer)
            if spec.is_moe_layer(layer)
            else MLP(spec, tp, device)
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        p, split = self.spec.hidden_dropout, self.tp.sequence_parallel
        attn = self.attn(self.attn_norm(x), rope, cache, documents)
        x = x + self.tp.dropout(attn, p, self.training, split)
        return x + self.tp.dropout(self.mlp(self.mlp_norm(x)), p, self.training, split)
