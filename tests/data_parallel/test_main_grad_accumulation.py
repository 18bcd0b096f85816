"""bf16 params' grads are summed over the microbatches of a step in their fp32 main grads.

One process, bf16, 4 microbatches a step: autograd hands each parameter one bf16 grad per
microbatch (recorded here by a tensor hook as it arrives), and the grad hook adds it into the
parameter's fp32 main grad. After the step's backward every main grad must equal the fp64 sum
of the recorded bf16 grads within the round-off of fp32 sums (each addition off by at most
2^-24 of the running sum of |terms|); a sum kept in bf16 (2^-9 per addition) is far outside it,
which the test checks on the same grads. The head's weight, whose fp32 product goes to its main
grad directly, is ``test_head_main_grad.py``'s. ZeRO 0 sums the microbatches in one buffer; ZeRO
2 gives each microbatch a fresh buffer and sums their reductions in the shard.
"""

import pytest
import torch

from megatronish.testing.runs import build_trainer

MICROBATCHES = 4
BF16 = [
    "trainer.precision=bf16",
    "model.num_layers=2",
    f"trainer.global_batch_size={2 * MICROBATCHES}",
]


def _record_microbatch_grads(params) -> dict[int, list[torch.Tensor]]:
    """Every grad autograd is about to accumulate into each of ``params``, by ``id``."""
    seen: dict[int, list[torch.Tensor]] = {id(p): [] for p in params}
    for p in params:
        p.register_hook(_appending_to(seen[id(p)]))
    return seen


def _appending_to(grads: list[torch.Tensor]):
    return lambda g: grads.append(g.detach().clone())


def _bf16_running_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(grads[0])
    for g in grads:
        total = total + g
    return total


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_grads_of_the_microbatches_are_summed_in_fp32(stage):
    trainer = build_trainer(0, 1, [*BF16, f"parallel.zero_stage={stage}"], 1)
    zero = trainer.zero
    head = trainer.chunks[-1].head.output_weight
    placed = [
        (p, b, offset)
        for b in zero.buckets
        for (_, p), offset in zip(b.params, b.offsets)
        if p is not head
    ]
    assert len(placed) > 10 and all(p.dtype == torch.bfloat16 for p, _, _ in placed)
    seen = _record_microbatch_grads([p for p, _, _ in placed])
    batches = trainer.microbatches(trainer.train_data, 0)
    assert len(batches) == MICROBATCHES
    zero.start_step(MICROBATCHES)
    trainer.forward_backward(
        trainer.chunks, batches, loss_scale=1.0 / MICROBATCHES, param_hooks=zero
    )
    zero.finish_reduction()  # one rank: the reduction is the identity

    outside, checked = 0, 0
    for p, b, offset in placed:
        grads = seen[id(p)]
        assert len(grads) == MICROBATCHES and all(g.dtype == torch.bfloat16 for g in grads)
        want = sum(g.double() for g in grads)  # bf16 values: exact in fp64
        size = sum(g.double().abs() for g in grads)  # the round-off scale of the sums
        bound = MICROBATCHES * 2**-24 * size + 1e-30
        got = zero.owned_grad(b)[offset : offset + p.numel()].view_as(p)
        assert got.dtype == torch.float32
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (p.shape, (err / size.clamp_min(1e-30)).max().item())
        # the same grads summed in bf16 miss the bound: the check above can tell them apart
        outside += int(((_bf16_running_sum(grads).double() - want).abs() > bound).sum())
        checked += p.numel()
    assert outside > checked // 4, (outside, checked)
