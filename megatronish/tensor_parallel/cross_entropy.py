"""Cross entropy over vocabulary-parallel logits, without gathering the full logits.

Each rank holds logits for its slice of the (padded) vocabulary. The softmax normaliser and the
target logit are combined with three all-reduces of ``[s, b]`` tensors (max, sum of exp, target
logit). Logits of padding ids (``>= vocab_size``) are excluded, so the loss is the same for every
tp and equals the loss of the unpadded model. At tp = 1 the model's head uses the chunked
projection + loss of ``megatronish/model/linear_cross_entropy.py`` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.distributed.comm import ParallelGroup, all_reduce

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ParallelGroup,
        vocab_size: int,
    ) -> torch.Tensor:
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        logits = logits.float()
        pad_from = vocab_size - start  # local index of the first padding id
        if pad_from < per_rank:
            logits = logits.clone()
            logits[..., max(pad_from, 0) :] = float("-inf")

        logits_max = logits.max(dim=-1).values
        all_reduce(logits_max, group, op="max")
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= per_rank)
        idx = local_target.masked_fill(outside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(target_logit, group)

        exp = shifted.exp_()  # shifted is not needed again: one [tokens, V/tp] buffer in all
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, outside)
        return loss

    @staticmethod
    def backward(ctx: FunctionCtx, grad_loss: torch.Tensor):
        softmax, idx, outside = ctx.saved_tensors
        grad = softmax  # reused in place: the saved tensor is not needed again
        update = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, idx, -update)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: ParallelGroup, vocab_size: int
) -> torch.Tensor:
    """Per-token loss from local logits ``[..., V/tp]`` and global target ids ``[...]``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
