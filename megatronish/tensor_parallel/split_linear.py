"""A linear and a bias add whose weight grads go through a :class:`WeightGradStore`.

Backward computes the input grad at once and hands the weight (and bias) grads to the store as
one job (see :mod:`megatronish.tensor_parallel.weight_grad`): returned to autograd at once, or
queued while the store is deferring. Forward runs ``F.linear`` (or the add) as a plain model
does; backward runs the matmuls and sums autograd runs for it: for ``x`` flattened to ``x2``
``[tokens, in]`` and the output grad to ``g`` ``[tokens, out]``, ``g @ W`` (input),
``g.T @ x2`` (weight) and ``g`` summed to the bias's shape, so without deferring the grads are
bit for bit those of ``F.linear`` on contiguous inputs (all the model's are). Under autocast the
operands are cast to its dtype first, as autocast runs ``F.linear``; the weight's grad reaches
it in its own dtype through autograd, as from autocast's cast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs a matmul of ``x`` in, or None outside autocast."""
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        return torch.get_autocast_dtype(x.device.type)
    return None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        w, b = weight, bias
        dtype = autocast_dtype(x)
        if dtype is None:
            out = F.linear(x, w, b)
        else:
            x, w = x.to(dtype), w.to(dtype)
            b = None if b is None else b.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(x, w, b)
        ctx.save_for_backward(x, w)
        ctx.params, ctx.store = (weight, bias), store
        # torch's linear adds the bias inside one matmul of the flattened input (the bias grad
        # is a sum over its rows), or after the matmul (a sum over the output's leading dims)
        ctx.flat_bias = x.dim() == 2 or x.is_contiguous()
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g.mm(w).view(*x.shape[:-1], w.shape[1])
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return grad_x, None, None, None
        bias_grad_of = g if ctx.flat_bias else grad

        def job() -> GradPairs:
            pairs = []
            if want_w:
                pairs.append((weight, g.t().mm(x.reshape(-1, x.shape[-1]))))
            if want_b:
                pairs.append((bias, bias_grad_of.sum_to_size(bias.shape)))
            return pairs

        grads = weight_grads(ctx.store, job)
        return grad_x, grad_of(grads, weight), grad_of(grads, bias), None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight and bias grads go through ``store`` (None:
    ``F.linear`` itself, autograd's own backward)."""
    wanted = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if store is None or not (torch.is_grad_enabled() and wanted):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, store)


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, y: torch.Tensor, bias: torch.Tensor, store: WeightGradStore | None
    ) -> torch.Tensor:
        ctx.bias, ctx.store = bias, store
        return y + bias

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        bias = ctx.bias
        if not ctx.needs_input_grad[1]:
            return grad, None, None
        grads = weight_grads(ctx.store, lambda: [(bias, grad.sum_to_size(bias.shape))])
        return grad, grad_of(grads, bias), None


def add_bias(
    y: torch.Tensor, bias: torch.Tensor, store: WeightGradStore | None = None
) -> torch.Tensor:
    """``y + bias`` (broadcast over the leading dims) whose bias grad goes through ``store``
    (None: the plain add)."""
    if store is None or not (torch.is_grad_enabled() and (y.requires_grad or bias.requires_grad)):
        return y + bias
    return _AddBias.apply(y, bias, store)
