"""The autograd hooks that add each parameter's grad into its bucket's fp32 main grad, count the
bucket's grads still to come and start its reduction when the last one arrives.

A hook is held in C++ by its parameter, out of the garbage collector's sight: strong references
back to the data-parallel owner or the bucket (which holds the parameter) would keep the model,
its buffers and any pending work handle alive after the run, so both are held weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatronish.data_parallel.buckets import Bucket

if TYPE_CHECKING:
    from megatronish.data_parallel.zero import ZeroDataParallel


def note_arrival(p: nn.Parameter) -> Callable[[torch.Tensor | None], None]:
    """A tensor hook on ``p`` noting whether the grad autograd is about to accumulate exists.

    Autograd runs a parameter's accumulation, and its hooks, also when the op that used it
    returned no grad for it: a split backward's B (:mod:`megatronish.tensor_parallel.
    weight_grad`) leaves the weight grads to W. Only a grad that arrived counts."""
    param = weakref.ref(p)

    def hook(grad: torch.Tensor | None) -> None:
        if (p := param()) is not None:
            p.grad_arrived = grad is not None

    return hook


def make_grad_hook(zero: ZeroDataParallel, b: Bucket) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of a parameter of ``b``."""
    owner, bucket = weakref.ref(zero), weakref.ref(b)

    def hook(p: nn.Parameter) -> None:
        zero, b = owner(), bucket()
        if zero is None or b is None:
            return
        if not getattr(p, "grad_arrived", True):  # no grad this time (B of a split backward)
            return
        p.grad_arrived = True
        grad = p.grad
        if b.grad_flat is None:  # zero 2/3: the first grad of this bucket's microbatch
            zero.new_grad_buffer(b)
        if getattr(p, "grad_added_to_main_grad", False):  # a placeholder: already summed
            p.grad_added_to_main_grad = False
            p.grad = None
        elif grad.dtype != p.main_grad.dtype:  # a bf16 microbatch grad, summed in fp32
            p.main_grad.add_(grad)
            p.grad = None
        elif grad.data_ptr() != p.main_grad.data_ptr():
            # Autograd made a new tensor: this microbatch's grad into a fresh (zero) buffer,
            # or the view's value plus it.
            p.main_grad.copy_(grad)
            p.grad = p.main_grad
        b.pending -= 1
        if b.pending == 0 and not b.late:
            zero.launch_reduction(b)
        if zero.gatherer is not None and zero.zero_stage.shards_params:
            zero.gatherer.grad_ready(p)

    return hook


def make_main_grad_adder(
    zero: ZeroDataParallel, b: Bucket, p: nn.Parameter
) -> Callable[[torch.Tensor, bool], None]:
    """``p.accumulate_main_grad(grad, grad_is_placeholder)``: add an fp32 ``grad`` of ``p``
    to its main grad now, without rounding it to ``p``'s dtype (Megatron's
    gradient-accumulation fusion). The op still returns a grad for ``p``, so the hook runs
    and counts it; ``grad_is_placeholder``: that grad holds nothing more and is dropped."""
    owner, bucket, param = weakref.ref(zero), weakref.ref(b), weakref.ref(p)

    def accumulate(grad: torch.Tensor, grad_is_placeholder: bool) -> None:
        zero, b, p = owner(), bucket(), param()
        if b.grad_flat is None:  # zero 2/3: the first grad of this bucket's microbatch
            zero.new_grad_buffer(b)
        p.main_grad.add_(grad)
        p.grad_added_to_main_grad = grad_is_placeholder

    return accumulate
