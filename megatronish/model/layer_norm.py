"""LayerNorm as ``F.layer_norm`` computes it, with the weight and bias grads through a store.

Forward is ``aten::native_layer_norm`` (what ``F.layer_norm`` runs); backward is
``aten::native_layer_norm_backward`` twice, with output masks ``[True, False, False]`` for the
input's grad (B) and ``[False, True, True]`` for the weight's and bias's (W, see
:mod:`megatronish.tensor_parallel.weight_grad`). The kernels compute each grad on its own, so
the grads are bit for bit those of ``F.layer_norm``'s one masked call. Under autocast the inputs
are cast to fp32 first, as autocast runs ``layer_norm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.tensor_parallel.weight_grad import (
    GradPairs,
    WeightGradStore,
    grad_of,
    weight_grads,
)

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        w, b = weight, bias
        if torch.is_autocast_enabled(x.device.type):  # autocast runs layer_norm in fp32
            x, w, b = x.float(), w.float(), b.float()
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)
        ctx.save_for_backward(x, w, b, mean, rstd)
        ctx.params, ctx.store = (weight, bias), store
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, w, b, mean, rstd = ctx.saved_tensors
        weight, bias = ctx.params
        shape = [x.shape[-1]]
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        backward = torch.ops.aten.native_layer_norm_backward
        grad_x = None
        if want_x:
            grad_x = backward(grad, x, shape, mean, rstd, w, b, [True, False, False])[0]
        if not (want_w or want_b):
            return grad_x, None, None, None, None

        def job() -> GradPairs:
            _, gw, gb = backward(grad, x, shape, mean, rstd, w, b, [False, want_w, want_b])
            return [(p, g) for p, g in ((weight, gw), (bias, gb)) if g is not None]

        grads = weight_grads(ctx.store, job)
        return grad_x, grad_of(grads, weight), grad_of(grads, bias), None, None


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """``F.layer_norm`` over the last dim whose weight and bias grads go through ``store``
    (None: ``F.layer_norm`` itself)."""
    wanted = x.requires_grad or weight.requires_grad or bias.requires_grad
    if store is None or not (torch.is_grad_enabled() and wanted):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps, store)
