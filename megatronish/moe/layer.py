"""The mixture-of-experts block: router, dispatch over ep, grouped experts, combine.

Under sequence parallelism (tp > 1) each tp rank routes its own sequence shard (the router's
grads are summed over tp like a norm's), then tokens and routing are gathered over tp, so every
tp rank holds the microbatch's tokens and computes its tp slice of every expert; the weighted
sum over slots is reduce-scattered back to the sequence shards, as the dense MLP's output is.

The balancing and z losses enter the gradient through the block's output (Megatron-LM's
auxiliary-loss scaler): the forward is the identity, the backward gives the loss the gradient
the language-model loss has (``loss_scale``, set by the trainer each step), so no extra tensor
travels through the pipeline.

A forward reads the device once, in :func:`~megatronish.moe.dispatch.dispatch` (every count it
needs in one copy); the routing statistics (``stats``) stay on the device until a log step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatronish.context_parallel.attention import CPContext
from megatronish.distributed.comm import all_gather_dim0, all_reduce
from megatronish.moe.context import EPContext
from megatronish.moe.dispatch import combine, dispatch, dispatch_ep_first
from megatronish.moe.experts import GroupedExperts
from megatronish.moe.routing import (
    count_per_expert,
    expert_capacity,
    load_balancing_loss,
    route,
    sort_assignments,
    z_loss,
)
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.tensor_parallel.mappings import gather_from_sp, in_backward, reduce_scatter_to_sp
from megatronish.tensor_parallel.sharding import mark_param
from megatronish.tensor_parallel.split_linear import linear
from megatronish.tensor_parallel.weight_grad import WeightGradStore

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

AUX, Z, DROPPED = -3, -2, -1  # the last entries of MoELayer.stats (the first E: assignments)


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x``; in backward ``loss`` receives gradient 1 (its scale is inside it)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, loss: torch.Tensor):
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        return grad, torch.ones((), device=grad.device, dtype=torch.float32)


class MoELayer(nn.Module):
    """Top-k mixture of experts (+ shared experts) in place of a block's MLP."""

    def __init__(
        self,
        spec: ModelSpec,
        tp: TPContext,
        cp: CPContext,
        ep: EPContext,
        device: torch.device | str | None = None,
        shared: nn.Module | None = None,
        layer_id: int = 0,
    ):
        """``shared``: the always-on experts' MLP (input and output like the block's);
        ``layer_id``: the global index of the block (the row of its routing statistics)."""
        super().__init__()
        moe = spec.moe
        if tp.size > 1 and not tp.sequence_parallel:
            raise ValueError("mixture-of-experts blocks with tp > 1 need sequence parallelism")
        if moe.num_experts % ep.size:
            raise ValueError(f"{moe.num_experts} experts do not split over ep={ep.size}")
        self.spec, self.moe, self.tp, self.cp, self.ep = spec, moe, tp, cp, ep
        self.layer_id = layer_id
        self.router = mark_param(
            nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size, device=device)),
            std=spec.init_std,
            sequence_parallel=tp.sequence_parallel,
        )
        local = moe.num_experts // ep.size
        self.experts = GroupedExperts(spec, tp.size, local, ep.rank * local, device)
        self.shared = shared
        self.ep_first = ep.dispatch_order == "ep_first"  # Megatron's order (tp > 1 only)
        self.weight_grad_store: WeightGradStore | None = None  # the router's
        self.loss_scale = 1.0  # the language-model loss's scale per microbatch (the trainer's)
        # Since the last reset: assignments per expert, balancing loss, z-loss, dropped slots
        # (this rank's parts; summed over ranks they are the step's totals).
        self.stats = torch.zeros(moe.num_experts + 3, dtype=torch.float64, device=device)
        # Aux-loss-free balancing's bias (fp32, the same on every rank: moved only by
        # :func:`~megatronish.moe.balancing.update_expert_bias` from the global counts).
        bias = None
        if moe.bias_update_rate is not None:
            bias = torch.zeros(moe.num_experts, dtype=torch.float32, device=device)
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, tp, ep = self.moe, self.tp, self.ep.group
        s, b, h = x.shape
        store = self.weight_grad_store
        logits = linear(x.reshape(-1, h).float(), self.router.float(), store=store)
        groups = None if moe.num_groups is None else (moe.num_groups, moe.max_groups)
        probs, weights, experts = route(
            logits, moe.top_k, moe.renormalize, moe.score, self.expert_bias, groups
        )
        if tp.sequence_parallel and self.ep_first:
            return self._forward_ep_first(x, logits, probs, weights, experts)
        tokens = x.reshape(-1, h)
        all_weights, all_experts = weights, experts
        if tp.sequence_parallel:  # the microbatch's tokens (of this cp rank) on every tp rank
            tokens = gather_from_sp(x, tp.group).reshape(-1, h)
            all_weights = gather_from_sp(weights.view(s, b, -1), tp.group).reshape(-1, moe.top_k)
            all_experts = all_gather_dim0(experts.view(s, b, -1), tp.group).reshape(-1, moe.top_k)
        order, counts, dropped = sort_assignments(
            all_experts, all_weights, moe.num_experts, self._capacity(tokens.shape[0])
        )
        during = self._shared_during(x)
        rows, record = dispatch(tokens, order, counts, moe.top_k, ep, during)  # one host read
        outputs = self.experts(rows, record.local_counts, offsets=record.local_ends)
        out = combine(outputs, record, all_weights, ep).view(-1, b, h)
        if tp.sequence_parallel:
            out = reduce_scatter_to_sp(out, tp.group)
        if self.shared is not None:
            out = out + (record.during_result if during else self.shared(x))
        if self.training and torch.is_grad_enabled():
            counts = count_per_expert(all_experts, moe.num_experts)
            dropped = dropped if tp.group.rank == 0 else None  # every tp rank drops alike
            out = self._auxiliary_losses(out, logits, probs, counts, experts, dropped)
        return out

    def _capacity(self, tokens: int) -> int | None:
        """Assignments an expert keeps of ``tokens`` routed together (None: dropless)."""
        moe = self.moe
        if moe.capacity_factor is None:
            return None
        return expert_capacity(tokens, moe.num_experts, moe.top_k, moe.capacity_factor)

    def _shared_during(self, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """The shared experts' forward, to run while the tokens travel over ep
        (``parallel.moe_shared_expert_overlap``); None when there are none, nothing travels or
        the overlap is off."""
        if self.shared is None or self.ep.size == 1 or not self.ep.overlap_shared:
            return None
        return functools.partial(self.shared, x)

    def _forward_ep_first(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        probs: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
    ) -> torch.Tensor:
        """Megatron-LM's dispatch order (``parallel.moe_dispatch_order=ep_first``): this tp
        rank's own tokens go over ep, the received rows are gathered over tp, the experts'
        tp-partial outputs are reduce-scattered back and return over ep to this rank's tokens,
        so the block's output is the sequence shard with no reduce-scatter of its own."""
        moe, tp = self.moe, self.tp
        s, b, h = x.shape
        tokens = x.reshape(-1, h)
        # capacity over this rank's own tokens, as each Megatron rank drops among its own
        capacity = self._capacity(tokens.shape[0])
        order, counts, dropped = sort_assignments(experts, weights, moe.num_experts, capacity)
        during = self._shared_during(x)
        rows, record, tp_counts = dispatch_ep_first(
            tokens, order, counts, moe.top_k, self.ep.group, tp.group, during
        )  # the one host read
        outputs = self.experts(rows, record.local_counts, offsets=record.local_ends)
        out = combine(outputs, record, weights, self.ep.group).view(s, b, h)
        if self.shared is not None:
            out = out + (record.during_result if during else self.shared(x))
        if self.training and torch.is_grad_enabled():
            out = self._auxiliary_losses(out, logits, probs, tp_counts, experts, dropped)
        return out

    def _auxiliary_losses(
        self,
        out: torch.Tensor,
        logits: torch.Tensor,
        probs: torch.Tensor,
        counts: torch.Tensor,
        experts: torch.Tensor,
        dropped: torch.Tensor | None,
    ):
        """Attach the balancing and z losses to ``out``'s gradient; record the step's stats.
        ``counts``: the assignments per expert of this cp rank's tokens of the microbatch (every
        tp rank's); ``dropped``: the slots this rank counts as dropped (None: another rank)."""
        moe, cp = self.moe, self.cp
        total = experts.shape[0] * self.tp.size * cp.size  # the microbatch's tokens
        all_reduce(counts, cp.group)
        aux = load_balancing_loss(probs, counts, total, moe.top_k, moe.aux_loss_coef)
        zl = z_loss(logits, total, moe.z_loss_coef)
        if moe.aux_loss_coef or moe.z_loss_coef:
            # cp ranks hold parts of one sequence whose grads are averaged over cp: x cp.
            out = _AttachLoss.apply(out, (aux + zl) * (self.loss_scale * cp.size))
        if not in_backward():  # not again when full recompute reruns the forward
            with torch.no_grad():
                mine = count_per_expert(experts, moe.num_experts)
                self.stats[: moe.num_experts] += mine.to(self.stats.dtype)
                self.stats[AUX] += aux.detach().double()
                self.stats[Z] += zl.detach().double()
                if dropped is not None:
                    self.stats[DROPPED] += dropped.to(self.stats.dtype)
        return out
