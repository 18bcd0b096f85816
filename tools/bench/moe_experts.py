"""The experts' backward alone as the number of local experts grows at fixed rows (part of
``moe.py``): the loop the experts used before (a slice of the rows and an index of each stack
per expert) against ``GroupedExperts`` as it picks (``torch._grouped_mm`` where this torch has
it) and forced onto its per-expert loop (:class:`~megatronish.moe.grouped_mm.ExpertLoop`).
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

    def backward(self, impl: str, counted: AllocatedBytes | None = None) -> float:
        """Seconds of one backward of ``impl`` (its forward untimed), inside ``counted``."""
        self.experts[impl].zero_grad(set_to_none=True)
        y = self.forward(impl)
        t0 = time.perf_counter()
        with counted or contextlib.nullcontext():
            y.backward(self.upstream)
        return time.perf_counter() - t0

    def stack_grad_bytes(self, impl: str) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.experts[impl].parameters())

    def grouped_mm_used(self) -> bool:
        fc = self.experts[GROUPED]
        return all(grouped_mm_supported(self.x, w, self.counts) for w in (fc.fc1, fc.fc2))


def run_experts(rows: int, hidden: int, ffn: int, locals_: tuple[int, ...], repeats: int) -> dict:
    """Per number of local experts and implementation: the backward's seconds (each repeat
    times every implementation once, interleaved, odd repeats in reverse), the bytes it
    allocates (counted in one more backward) and the stacks' grads among them."""
    out: dict = {"seconds": {}, "bytes": {}, "stack_grad_bytes": {}, "grouped_mm_used": {}}
    gen = torch.Generator().manual_seed(0)
    for local in locals_:
        case, key = Case(local, rows, hidden, ffn, gen), str(local)
        for impl in IMPLS:
            case.backward(impl)  # warm-up
        times: dict[str, list[float]] = {i: [] for i in IMPLS}
        for r in range(repeats):
            for impl in IMPLS if r % 2 == 0 else reversed(IMPLS):
                times[impl].append(case.backward(impl))
        out["seconds"][key] = times
        out["bytes"][key], out["stack_grad_bytes"][key] = {}, {}
        for impl in IMPLS:
            counted = AllocatedBytes()
            case.backward(impl, counted)
            out["bytes"][key][impl] = counted.total
            out["stack_grad_bytes"][key][impl] = case.stack_grad_bytes(impl)
        out["grouped_mm_used"][key] = case.grouped_mm_used()
    return out
