"""The experts' forward and backward alone as the number of local experts grows at fixed rows
(part of ``moe.py``): the loop the experts used before (a slice of the rows and an index of each
stack per expert) against ``GroupedExperts`` as it picks (``torch._grouped_mm`` where this torch
has it) and forced onto its per-expert loop (:class:`~megatronish.moe.grouped_mm.ExpertLoop`).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from megatronish.moe.experts import GroupedExperts
from megatronish.moe.grouped_mm import grouped_mm_supported
from megatronish.spec import ModelSpec, MoESpec
from megatronish.testing.allocations import AllocatedBytes

SLICED, GROUPED = "before (a slice + an index per expert)", "now (as picked)"
LOOP = "now, ExpertLoop forced"
IMPLS = (SLICED, GROUPED, LOOP)


def sliced_forward(experts: GroupedExperts, rows: torch.Tensor, counts: list[int]):
    """``GroupedExperts.forward`` as it was: each expert's ``rows[a:b]`` and ``fc1[e]``."""
    outputs, start = [], 0
    for e, n in enumerate(counts):
        gate, up = F.linear(rows[start : start + n], experts.fc1[e]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, experts.fc2[e]))
        start += n
    return torch.cat(outputs)


def _experts(local: int, hidden: int, ffn: int, grouped: bool | None) -> GroupedExperts:
    moe = MoESpec(num_experts=local, top_k=2, layer_freq=1, ffn_hidden_size=ffn)
    spec = ModelSpec(
        arch="llama",
        num_layers=4,
        hidden_size=hidden,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=ffn,
        seq_length=256,
        vocab_size=4096,
        padded_vocab_size=4096,
        max_position_embeddings=256,
        moe=moe,
    )
    experts = GroupedExperts(spec, 1, local, 0, grouped=grouped)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(local))
    return experts


class Case:
    """``local`` experts of each implementation on the same rows and upstream gradient."""

    def __init__(self, local: int, rows: int, hidden: int, ffn: int, gen: torch.Generator):
        self.counts = [rows // local] * local
        self.x = torch.randn(rows, hidden, generator=gen)
        self.upstream = torch.randn(rows, hidden, generator=gen)
        loop = _experts(local, hidden, ffn, False)
        self.experts = {SLICED: loop, GROUPED: _experts(local, hidden, ffn, None), LOOP: loop}

    def forward(self, impl: str) -> torch.Tensor:
        x, experts = self.x.clone().requires_grad_(), self.experts[impl]
        if impl == SLICED:
            return sliced_forward(experts, x, self.counts)
        return experts(x, self.counts)

    def step(
        self,
        impl: str,
        forward_counted: AllocatedBytes | None = None,
        backward_counted: AllocatedBytes | None = None,
    ) -> tuple[float, float]:
        """Seconds of one forward and of its backward of ``impl``, each inside its counter."""
        self.experts[impl].zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with forward_counted or contextlib.nullcontext():
            y = self.forward(impl)
        t1 = time.perf_counter()
        with backward_counted or contextlib.nullcontext():
            y.backward(self.upstream)
        return t1 - t0, time.perf_counter() - t1

    def stack_grad_bytes(self, impl: str) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.experts[impl].parameters())

    def grouped_mm_used(self) -> bool:
        fc = self.experts[GROUPED]
        return all(grouped_mm_supported(self.x, w, self.counts) for w in (fc.fc1, fc.fc2))


def run_experts(rows: int, hidden: int, ffn: int, locals_: tuple[int, ...], repeats: int) -> dict:
    """Per number of local experts and implementation: the seconds of the forward and of the
    backward (each repeat times every implementation once, interleaved, odd repeats in
    reverse), the bytes each allocates (counted in one more step) and the stacks' grads among
    the backward's."""
    keys = ("forward_seconds", "seconds", "forward_bytes", "bytes", "stack_grad_bytes")
    out: dict = {k: {} for k in (*keys, "grouped_mm_used")}
    gen = torch.Generator().manual_seed(0)
    for local in locals_:
        case, key = Case(local, rows, hidden, ffn, gen), str(local)
        for impl in IMPLS:
            case.step(impl)  # warm-up
        for k in keys:
            out[k][key] = {i: [] for i in IMPLS} if k.endswith("seconds") else {}
        for r in range(repeats):
            for impl in IMPLS if r % 2 == 0 else reversed(IMPLS):
                forward, backward = case.step(impl)
                out["forward_seconds"][key][impl].append(forward)
                out["seconds"][key][impl].append(backward)
        for impl in IMPLS:
            forward, backward = AllocatedBytes(), AllocatedBytes()
            case.step(impl, forward, backward)
            out["forward_bytes"][key][impl] = forward.total
            out["bytes"][key][impl] = backward.total
            out["stack_grad_bytes"][key][impl] = case.stack_grad_bytes(impl)
        out["grouped_mm_used"][key] = case.grouped_mm_used()
    return out
