"""Weight-gradient work of a backward pass, run at once or queued for later (split backward).

Zero-bubble pipeline schedules (Qi et al., 2023) split each backward into B, the gradient with
respect to the chunk's input (the previous stage waits for it), and W, the gradients of the
weights (nobody waits for them), and run W later to fill the pipeline's bubble. Every layer with
weights computes its input gradient in its own backward and hands the weight gradient to a
:class:`WeightGradStore` as a *job*: a function that computes it from what the backward saw (the
layer's saved input and the gradient of its output) and returns ``(param, grad)`` pairs. A layer
without a store (``weight_grad_store = None``: every schedule but the zero-bubble ones) runs
torch's own ops and autograd formulas instead; the split functions are Python autograd nodes,
tens of microseconds of host time each, that only a split backward needs.

Outside :meth:`WeightGradStore.deferring` a job runs inside the backward and its grads go back to
autograd as the op's weight grads, exactly as a plain backward would produce them. Inside, the
job is queued under the key (microbatch, chunk) and :meth:`WeightGradStore.run` later computes
every queued job of a key and hands all their grads to autograd's accumulation at once (one
``torch.autograd.backward`` on the params), so a parameter used twice gets the sum of its grads
and its post-accumulate hook (ZeRO's bucket counting) fires once per W, as it does per backward.
A job's "param" is the tensor its op was given: the parameter, or a cast of it (the router's
``.float()``), through which that backward reaches the parameter; autograd casts a grad to the
dtype of the tensor it belongs to in both cases, as it does for an op's returned grads.

In B a parameter whose grads are all deferred gets no grad, but torch (2.13 at least) still
runs its accumulation step for the missing grad, and with it the parameter's hooks: its tensor
hook sees None and its post-accumulate hook runs with ``.grad`` unchanged. A hook that counts
arrivals (ZeRO's bucket readiness) must skip such a call; W's accumulation brings the grad.

A job holds what its backward unpacked (the saved input, recomputed ones included under
activation recompute, and the output grad), so W never reruns a forward; those tensors live
from B to W instead of to the end of B.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

import torch

GradPairs = list[tuple[torch.Tensor, torch.Tensor]]
WeightGradJob = Callable[[], GradPairs]


class WeightGradStore:
    """Weight-gradient jobs of backward passes: run at once, or queued per key while deferring."""

    def __init__(self) -> None:
        self._queued: dict[Hashable, list[WeightGradJob]] = {}
        self._key: Hashable | None = None

    @property
    def deferring_now(self) -> bool:
        """True inside :meth:`deferring`: a backward's weight grads are queued, not returned."""
        return self._key is not None

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Queue the weight-gradient jobs of the backward run inside under ``key``."""
        if self._key is not None:
            raise RuntimeError(f"already deferring weight grads for {self._key}; not for {key}")
        if key in self._queued:
            raise RuntimeError(f"the weight grads of {key} are already queued and not yet run")
        self._key = key
        self._queued[key] = []
        try:
            yield
        finally:
            self._key = None

    def defer(self, job: WeightGradJob) -> None:
        """Queue ``job`` under the current key (only inside :meth:`deferring`)."""
        if self._key is None:
            raise RuntimeError("weight-grad jobs are queued only inside WeightGradStore.deferring")
        self._queued[self._key].append(job)

    def run(self, key: Hashable) -> None:
        """Compute the queued weight grads of ``key`` and accumulate them into the params."""
        jobs = self._queued.pop(key, None)
        if jobs is None:
            raise RuntimeError(f"no weight grads were queued for {key}")
        with torch.no_grad():
            pairs = [pair for job in jobs for pair in job()]
        if pairs:
            params, grads = zip(*pairs, strict=True)
            torch.autograd.backward(list(params), list(grads))

    @property
    def pending(self) -> list[Hashable]:
        """Keys whose weight grads are queued and not yet run (in queueing order)."""
        return list(self._queued)


def weight_grads(
    store: WeightGradStore | None, job: WeightGradJob
) -> dict[int, torch.Tensor] | None:
    """In a layer's backward: the grads of ``job`` by ``id(param)`` to return to autograd now,
    or None when ``store`` is deferring (the job is queued for the schedule's W)."""
    if store is not None and store.deferring_now:
        store.defer(job)
        return None
    return {id(p): g for p, g in job()}


def grad_of(
    grads: dict[int, torch.Tensor] | None, param: torch.Tensor | None
) -> torch.Tensor | None:
    """What a backward returns for ``param`` from :func:`weight_grads`' answer: its grad, or
    None (deferred, not wanted, or no such input)."""
    if grads is None or param is None:
        return None
    return grads.get(id(param))


def attach_weight_grad_store(module: torch.nn.Module, store: WeightGradStore | None) -> None:
    """Give every layer under ``module`` that has weights (it declares a
    ``weight_grad_store`` attribute) ``store``; None: weight grads always at once."""
    for m in module.modules():
        if hasattr(m, "weight_grad_store"):
            m.weight_grad_store = store
