"""The split-backward check: B (a backward inside :meth:`WeightGradStore.deferring`) leaves every
parameter's grad None and gives the plain backward's input grad; W (:meth:`WeightGradStore.run`)
gives the plain backward's parameter grads, bit for bit, microbatch after microbatch. The plain
backward runs without a store, i.e. autograd's own formulas of ``F.linear``, ``F.rms_norm``,
``F.embedding``... (a layer without a store takes torch's ops, not its split functions).

A layer that computes a weight grad outside its store shows up by name: its parameter has a grad
after B.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatronish.tensor_parallel.weight_grad import WeightGradStore, attach_weight_grad_store

# One microbatch's forward: (the input leaf whose grad B must give, or None, and the output).
Forward = Callable[[], tuple[torch.Tensor | None, torch.Tensor]]


def output_grad(out: torch.Tensor, microbatch: int) -> torch.Tensor:
    """The grad fed to ``out``: a loss scale for a loss, a fixed random tensor otherwise."""
    if out.dim() == 0:
        return torch.full_like(out, 1.0 / (microbatch + 2))
    gen = torch.Generator().manual_seed(1000 + microbatch)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)


def _backward(forward: Forward, microbatch: int) -> torch.Tensor | None:
    x, out = forward()
    out.backward(output_grad(out, microbatch))
    return None if x is None or x.grad is None else x.grad.clone()


def assert_split_backward(module: nn.Module, forwards: list[Forward]) -> None:
    """Run ``forwards`` (one per microbatch; each called twice, so it must reproduce its
    forward) with plain backwards, then each forward's backward deferred under key ``i`` and the
    keys run in order; assert B and W against the plain backwards (see the module docstring)."""
    params = dict(module.named_parameters())
    store = WeightGradStore()
    attach_weight_grad_store(module, None)
    try:
        module.zero_grad(set_to_none=True)
        plain_inputs, plain_grads = [], []
        for i, forward in enumerate(forwards):
            plain_inputs.append(_backward(forward, i))
            plain_grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        missing = sorted(set(params) - set(plain_grads[-1]))
        assert not missing, f"no grad even in a plain backward: {missing}"

        module.zero_grad(set_to_none=True)
        attach_weight_grad_store(module, store)
        for i, forward in enumerate(forwards):
            with store.deferring(i):
                input_grad = _backward(forward, i)
            early = sorted(n for n, p in params.items() if p.grad is not None)
            assert not early, f"weight grads computed in B, not deferred: {early}"
            if plain_inputs[i] is None:
                assert input_grad is None, "B gave an input grad the plain backward did not"
            else:
                assert input_grad is not None and torch.equal(input_grad, plain_inputs[i]), (
                    f"microbatch {i}: B's input grad differs from the plain backward's"
                )
        assert store.pending == list(range(len(forwards)))
        for i in range(len(forwards)):
            store.run(i)
            differ = sorted(
                n
                for n, p in params.items()
                if p.grad is None or not torch.equal(p.grad, plain_grads[i][n])
            )
            assert not differ, f"after W of microbatch {i}, grads differ: {differ}"
        assert store.pending == []
    finally:
        attach_weight_grad_store(module, None)
