"""The bf16 head's weight grad reaches the fp32 main grad without a bf16 rounding in between.

One process, bf16, 3 microbatches a step: after the step's backward, the head weight's main
grad must equal, within fp32 summation round-off, the sum over microbatches of
``scale * grad.T @ x`` computed in fp64 from the bf16 operands of the head's weight-grad GEMM
(the logits' bf16 grad and the bf16 hidden states, recorded as the head ran): products of bf16
values are exact, so an fp32-output GEMM is off by the fp32 sums only (bound below), where a
GEMM with a bf16 output (up to 2^-9 relative per chunk) or autograd's cast of each
microbatch's grad to bf16 (the same again) is far outside it. ZeRO 0 keeps one buffer for the
step; ZeRO 2 and 3 create it lazily per microbatch and reduce it into the shard; gpt2 ties the
head to the embedding on the same chunk, so the lookup's grad joins the head's in autograd
(rows no input token uses hold the head's alone). The buckets' readiness counting is what
makes ZeRO 2/3 reduce at all.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.model import gpt
from megatronish.model.linear_cross_entropy import linear_cross_entropy
from megatronish.testing.runs import build_trainer

MICROBATCHES = 3
BF16 = ["trainer.precision=bf16", f"trainer.global_batch_size={2 * MICROBATCHES}"]


def _main_grad(zero, param) -> torch.Tensor:
    """``param``'s part of its bucket's reduced grad (one rank: the whole bucket)."""
    for b in zero.buckets:
        for (_, p), offset in zip(b.params, b.offsets):
            if p is param:
                return zero.owned_grad(b)[offset : offset + p.numel()].view_as(p)
    raise AssertionError("the head weight is in no bucket")


def _record_lookups(trainer) -> list:
    """``(ids, grad of the looked-up rows)`` of every microbatch of a tied embedding."""
    lookups = []

    def record(module, args, out):
        entry = [args[0].detach().clone()]
        lookups.append(entry)
        out.register_hook(lambda g: entry.append(g.detach().clone()))

    trainer.chunks[0].embedding.word.register_forward_hook(record)
    return lookups


class WeightGradOperands(TorchDispatchMode):
    """Records the two operands of every matmul whose output has ``shape`` (the head weight's):
    inside the head's forward that is its weight-grad GEMM, one per token chunk."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.operands = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in ("aten::mm", "aten::addmm") and tuple(out.shape) == self.shape:
            self.operands.append(tuple(t.detach().clone() for t in args[-2:]))
        return out


@pytest.mark.parametrize(
    "arch,stage", [("llama", 0), ("llama", 2), ("llama", 3), ("gpt2", 0), ("gpt2", 3)]
)
def test_head_weight_main_grad_is_the_fp32_sum_of_microbatch_grads(monkeypatch, arch, stage):
    trainer = build_trainer(0, 1, [*BF16, f"model.arch={arch}", f"parallel.zero_stage={stage}"], 1)
    heads = []

    def recording(x, weight, target, vocab_size, **kw):
        with WeightGradOperands(weight.shape) as seen:
            loss = linear_cross_entropy(x, weight, target, vocab_size, **kw)
        heads.append((x.shape[0], seen.operands, vocab_size))
        return loss

    monkeypatch.setattr(gpt, "linear_cross_entropy", recording)
    tied = arch == "gpt2"
    lookups = _record_lookups(trainer) if tied else [None] * MICROBATCHES
    batches = trainer._to_device(trainer.prefetcher.get(0, False))
    assert len(batches) == MICROBATCHES
    trainer.zero.start_step(MICROBATCHES)
    trainer.forward_backward(
        trainer.chunks, batches, loss_scale=1.0 / MICROBATCHES, param_hooks=trainer.zero
    )
    trainer.zero.finish_reduction()  # one rank: the reduction is the identity

    head = trainer.chunks[-1].head.output_weight
    assert head.dtype == torch.bfloat16 and head.grad is None
    assert len(heads) == len(lookups) == MICROBATCHES
    want = torch.zeros(head.shape, dtype=torch.float64)
    size = torch.zeros(head.shape, dtype=torch.float64)  # sum of |terms|: the round-off scale
    for (tokens, operands, _), lookup in zip(heads, lookups):
        assert operands, "the head ran no weight-grad GEMM of the weight's shape"
        scale = 1.0 / MICROBATCHES / tokens
        for a, b in operands:
            assert a.dtype == b.dtype  # both bf16 values (bf16, or upcast to fp32 exactly)
            for t in (a, b):
                assert torch.equal(t, t.bfloat16().to(t.dtype))
            want += scale * (a.double() @ b.double())  # exact products, fp64 sums
            size += scale * (a.double().abs() @ b.double().abs())
        if tied:  # the lookup's own grad is bf16 (its kernel's), added after the head's
            ids, grad = lookup
            w = torch.zeros(head.shape, dtype=torch.bfloat16, requires_grad=True)
            torch.nn.functional.embedding(ids, w).backward(grad)
            want += w.grad.double()
            size += w.grad.double().abs()
    got = _main_grad(trainer.zero, head)
    # fp32 sums of at most 2 * 16 tokens a microbatch, 3 microbatches, the lookup: under 64
    # roundings of 2^-24 each relative to the sum of |terms|. A bf16 rounding is 2^-9.
    err = (got.double() - want).abs()
    assert (err <= 64 * 2**-24 * size + 1e-30).all(), (err / size.clamp_min(1e-30)).max()
    vocab = heads[0][2]
    assert torch.equal(got[vocab:], torch.zeros_like(got[vocab:]))  # padding rows
