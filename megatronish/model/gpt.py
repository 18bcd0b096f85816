"""The GPT as a stack of chunks: embedding on the first, final norm + head + loss on the last.

The unsplit model is the single chunk that holds every layer. Layers are stored under their
global index (``layers.7.attn.qkv.weight``), so parameter names are the same in every pipeline
layout and checkpoints can be keyed by them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megatronish.context_parallel.attention import CPContext
from megatronish.context_parallel.documents import Documents
from megatronish.model.blocks import KVCache, Norm, TransformerBlock, rope_tables
from megatronish.model.linear_cross_entropy import linear_cross_entropy
from megatronish.model.parallel_context import ParallelContext
from megatronish.model.recompute import checkpointed
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatronish.tensor_parallel.layers import VocabParallelEmbedding
from megatronish.tensor_parallel.mappings import copy_to_tp, gather_from_sp
from megatronish.tensor_parallel.sharding import TPShard, mark_param, update_param_info
from megatronish.tensor_parallel.split_linear import linear
from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class _AddPositions(torch.autograd.Function):
    """``x + table[rows].unsqueeze(1)``: the rows of a learned position table added to
    ``[s, b, h]`` activations (``rows`` ``[s, b]``: ``x + table[rows]``, each sample its own
    positions); the table's grad (the ops of the add's, the unsqueeze's and the index's or
    slice's backward) goes through the store."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        table: torch.Tensor,
        rows: torch.Tensor | slice,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.table, ctx.rows, ctx.store = table, rows, store
        return x + _position_rows(table, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        table, rows = ctx.table, ctx.rows
        if not ctx.needs_input_grad[1]:
            return grad, None, None, None

        def job() -> GradPairs:
            per_sample = isinstance(rows, torch.Tensor) and rows.dim() == 2
            g = grad if per_sample else grad.sum_to_size(grad.shape[0], 1, grad.shape[2])[:, 0]
            full = g.new_zeros(table.shape)
            if isinstance(rows, slice):
                full[rows] = g
            else:
                full.index_put_((rows,), g, accumulate=True)
            return [(table, full)]

        return grad, grad_of(weight_grads(ctx.store, job), table), None, None


def _position_rows(table: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """The rows of a position table to add to ``[s, b, h]`` activations: ``[s, 1, h]`` for
    positions shared by the batch, ``[s, b, h]`` for per-sample ones (``rows`` ``[s, b]``)."""
    picked = table[rows]
    return picked if picked.dim() == 3 else picked.unsqueeze(1)


class Embedding(nn.Module):
    """Token embedding (+ learned positions for gpt2), output ``[s, b, h]`` (or its sp shard)."""

    def __init__(
        self,
        spec: ModelSpec,
        tp: TPContext,
        cp: CPContext,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.spec, self.tp, self.cp = spec, tp, cp
        self.word = VocabParallelEmbedding(
            spec.padded_vocab_size,
            spec.hidden_size,
            tp.group,
            sequence_parallel=tp.sequence_parallel,
            init_std=spec.init_std,
            device=device,
        )
        self.position = None
        if not spec.is_llama:
            self.position = mark_param(
                nn.Parameter(
                    torch.empty(spec.max_position_embeddings, spec.hidden_size, device=device)
                ),
                std=spec.init_std,
                sequence_parallel=tp.sequence_parallel,
            )
        self.weight_grad_store: WeightGradStore | None = None

    def forward(
        self, ids: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``offset``: the position of the first token (decoding after cached tokens);
        ``positions``: ``[b, s]`` each token's own position (positions reset per document)."""
        x = self.word(ids.t())  # [b, s] -> [s, b, h]
        if self.position is not None:
            s_local = x.shape[0]
            start = self.tp.group.rank * s_local if self.tp.sequence_parallel else offset
            rows = slice(start, start + s_local)
            if positions is not None:  # this cp rank's tokens' own positions, [s, b]
                rows = positions.t()[rows] if self.tp.sequence_parallel else positions.t()
            elif self.cp.size > 1:  # this cp rank's two chunks of positions
                rows = self.cp.positions(x.device)[rows]
            store = self.weight_grad_store
            if store is not None and torch.is_grad_enabled() and self.position.requires_grad:
                x = _AddPositions.apply(x, self.position, rows, store)
            else:
                x = x + _position_rows(self.position, rows)
        p = self.spec.hidden_dropout
        return self.tp.dropout(x, p, self.training, self.tp.sequence_parallel)


class Head(nn.Module):
    """Final norm, vocab-parallel output projection and the loss.

    With tied embeddings on the same chunk the word embedding is reused; on a separate last stage
    the head keeps its own copy (``tied``), kept equal by all-reducing grads over the embedding
    group.
    """

    def __init__(
        self,
        spec: ModelSpec,
        tp: TPContext,
        embedding: Embedding | None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.norm = Norm(spec, tp, device)
        # Not registered as a submodule: the embedding's weight is owned by the embedding.
        object.__setattr__(self, "embedding", embedding if spec.tie_embeddings else None)
        self.weight = None
        if self.embedding is None:
            self.weight = mark_param(
                nn.Parameter(
                    torch.empty(spec.padded_vocab_size // tp.size, spec.hidden_size, device=device)
                ),
                shard=TPShard(dim=0, blocks=(spec.padded_vocab_size,)),
                std=spec.init_std,
                vocab=True,
            )
            # A tied head on another stage starts equal to (and is initialised as) the embedding.
            tied = "embedding.word.weight" if spec.tie_embeddings else None
            update_param_info(self.weight, tied_to=tied)
        # The output projection's: the head's own weight or the embedding's it reuses.
        self.weight_grad_store: WeightGradStore | None = None

    @property
    def output_weight(self) -> nn.Parameter:
        """The projection to (this rank's slice of) the vocabulary: own or the embedding's."""
        return self.weight if self.embedding is None else self.embedding.word.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Local vocabulary slice of the logits, ``[s, b, V/tp]``."""
        x = self.norm(x)
        if self.tp.sequence_parallel:
            x = gather_from_sp(x, self.tp.group)
        else:
            x = copy_to_tp(x, self.tp.group)
        return linear(x, self.output_weight, store=self.weight_grad_store)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """Mean next-token loss over the microbatch; ``targets`` is ``[b, s]``. With
        ``documents`` holding loss weights: the weighted sum over the tokens divided by its
        ``loss_divisor`` (None: the token count), tokens whose target starts the next
        document weighing 0."""
        weights, divisor = None, None
        if documents is not None and documents.loss_weights is not None:
            weights, divisor = documents.loss_weights.t(), documents.loss_divisor
        if self.tp.size == 1:  # the whole vocabulary here: no [tokens, V] logits at all
            x = self.norm(x).reshape(-1, self.spec.hidden_size)
            target = targets.t().reshape(-1)
            shared = self.embedding is not None  # the lookup adds its grad to the same weight
            return linear_cross_entropy(
                x,
                self.output_weight,
                target,
                self.spec.vocab_size,
                weight_shared=shared,
                store=self.weight_grad_store,
                token_weights=None if weights is None else weights.reshape(-1),
                divisor=divisor,
            )
        logits = self.logits(x)
        losses = vocab_parallel_cross_entropy(
            logits, targets.t(), self.tp.group, self.spec.vocab_size
        )
        if weights is None:
            return losses.mean()
        return (losses * weights).sum() / (losses.numel() if divisor is None else divisor)


class GPTChunk(nn.Module):
    """Layers ``layer_ids`` of the GPT, with the embedding and/or the head when it holds them.

    ``forward(x, targets)``: ``x`` is token ids ``[b, s]`` on the first chunk and the previous
    chunk's hidden states ``[s, b, h]`` otherwise; returns the loss on the last chunk (when
    ``targets`` is given) and the hidden states otherwise.
    """

    def __init__(
        self,
        spec: ModelSpec,
        ctx: ParallelContext,
        layer_ids: range,
        *,
        first: bool,
        last: bool,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.spec, self.parallel, self.first, self.last = spec, ctx, first, last
        self.layer_ids = layer_ids
        self.embedding = Embedding(spec, ctx.tp, ctx.cp, device) if first else None
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(spec, ctx, device, layer=i) for i in layer_ids}
        )
        self.head = Head(spec, ctx.tp, self.embedding, device) if last else None
        # (start, end, checkpointed) runs of layers; see megatronish.model.recompute.
        self.segments = [(0, len(self.layers), False)]
        self.recompute_rng = None
        self._rope = None

    def rope(
        self, device: torch.device, documents: Documents | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and signed sin tables of this cp rank's positions, ``[s, 1, 1, d]``; with
        per-document positions ``[s, b, 1, d]``, built once per microbatch."""
        if not self.spec.is_llama:
            return None
        if documents is not None and documents.positions is not None:
            spec = self.spec

            def per_token() -> tuple[torch.Tensor, torch.Tensor]:
                tables = rope_tables(spec.seq_length, spec.head_dim, spec.rope_theta, device)
                rows = documents.positions.t()  # [s, b]
                return tuple(t[:, 0, 0][rows].unsqueeze(2) for t in tables)

            key = ("rope", self.spec.head_dim, self.spec.rope_theta, str(device))
            return documents.derived(key, per_token)
        if self._rope is None or self._rope[0].device != device:
            cos, sin = rope_tables(
                self.spec.seq_length, self.spec.head_dim, self.spec.rope_theta, device
            )
            if self.parallel.cp.size > 1:  # the rows of this cp rank's positions
                pos = self.parallel.cp.positions(device)
                cos, sin = cos[pos], sin[pos]
            self._rope = (cos, sin)
        return self._rope

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """``documents``: the microbatch's packed-document layout (None: one causal sequence,
        positions from 0)."""
        positions = None if documents is None else documents.positions
        if self.first:
            x = self.embedding(x, positions=positions)
        rope = self.rope(x.device, documents)
        blocks = list(self.layers.values())
        for start, end, recompute in self.segments:

            def run(h: torch.Tensor, group: list[nn.Module] = blocks[start:end]) -> torch.Tensor:
                for block in group:
                    h = block(h, rope, documents=documents)
                return h

            x = checkpointed(run, x, rng=self.recompute_rng) if recompute else run(x)
        if self.last and targets is not None:
            return self.head(x, targets, documents)
        return x

    def decode(self, ids: torch.Tensor, cache: list[KVCache]) -> torch.Tensor:
        """Logits ``[b, s, padded vocab]`` of tokens ``ids`` ``[b, s]`` that follow the tokens
        held in ``cache`` (one :class:`KVCache` per layer), whose keys and values they extend.

        Generation runs the whole model on one rank (tp = cp = pp = 1), in eval mode.
        """
        if not (self.first and self.last) or self.parallel.tp.size > 1 or self.parallel.cp.size > 1:
            raise ValueError("decoding runs the whole model on one rank (tp = cp = pp = 1)")
        start, s = cache[0].length, ids.shape[1]
        if start + s > self.spec.seq_length:
            raise ValueError(f"{start + s} tokens exceed model.seq_length={self.spec.seq_length}")
        x = self.embedding(ids, offset=start)
        rope = self.rope(x.device)
        if rope is not None:
            rope = (rope[0][start : start + s], rope[1][start : start + s])
        for block, layer_cache in zip(self.layers.values(), cache, strict=True):
            x = block(x, rope, layer_cache)
        return self.head.logits(x).transpose(0, 1)
