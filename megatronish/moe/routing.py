"""Top-k routing of tokens to experts and its auxiliary losses (pure tensor functions).

Ties between equal router probabilities go to the lower expert index (a stable sort), so every
layout and every run routes the same tokens to the same experts.
"""

from __future__ import annotations

import math

import torch


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    score: str = "softmax",
    bias: torch.Tensor | None = None,
    groups: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [T, E], weights [T, k], experts [T, k])`` of router ``logits`` ``[T, E]``.

    The scores are the softmax over every expert or each expert's sigmoid (``score``, fp32).
    ``experts`` are the ``top_k`` highest of ``scores + bias`` in descending order (``bias``:
    the aux-loss-free balancing bias, DeepSeek-V3's, which picks experts and weighs nothing);
    with ``groups = (num_groups, max_groups)`` only from each token's ``max_groups`` best groups
    of contiguous experts, a group scored by the sum of its ``top_k / max_groups`` highest.
    ``weights`` are the chosen experts' scores, rescaled to sum to 1 when ``renormalize``.
    ``probs`` is what the balancing loss weighs: the softmax, or the sigmoids normalised to sum
    to 1 per token (Megatron-LM's rule for the sigmoid).
    """
    if score == "sigmoid":
        scores = torch.sigmoid(logits.float())
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        scores = probs = torch.softmax(logits.float(), dim=-1)
    choice = scores.detach() if bias is None else scores.detach() + bias
    if groups is not None:
        choice = _best_groups_only(choice, top_k, *groups)
    order = torch.sort(choice, dim=-1, descending=True, stable=True)[1]
    experts = order[:, :top_k]
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def _best_groups_only(
    choice: torch.Tensor, top_k: int, num_groups: int, max_groups: int
) -> torch.Tensor:
    """``choice`` with every expert outside each token's ``max_groups`` best groups at -inf
    (Megatron-LM's group-limited top-k; ties between groups go to the lower group)."""
    tokens, experts = choice.shape
    per_group = choice.view(tokens, num_groups, experts // num_groups)
    best_in_group = torch.sort(per_group, dim=-1, descending=True, stable=True)[0]
    group_scores = best_in_group[..., : top_k // max_groups].sum(dim=-1)
    chosen = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, :max_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def load_balancing_loss(
    probs: torch.Tensor, counts: torch.Tensor, total_tokens: int, top_k: int, coef: float
) -> torch.Tensor:
    """This rank's part of the Switch-Transformer balancing loss (Megatron-LM's form)::

        coef * E / (k * T^2) * sum_e counts_e * sum_t probs[t, e]

    ``counts`` are the assignments per expert over all ``total_tokens`` tokens of the
    microbatch; ``probs`` this rank's tokens' rows. The loss is linear in ``probs``, so the
    ranks holding parts of a sequence (tp shards, cp chunks) add their parts to get the whole.
    """
    num_experts = probs.shape[-1]
    scale = coef * num_experts / (top_k * total_tokens * total_tokens)
    return scale * (probs.sum(dim=0) * counts.to(probs.dtype)).sum()


def z_loss(logits: torch.Tensor, total_tokens: int, coef: float) -> torch.Tensor:
    """This rank's part of the router z-loss ``coef * mean_t logsumexp(logits_t)^2`` (ST-MoE)."""
    return coef * torch.logsumexp(logits.float(), dim=-1).square().sum() / total_tokens


def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """Assignments an expert takes from ``tokens`` tokens at capacity ``factor``."""
    return math.ceil(tokens * top_k / num_experts * factor)


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert in ``experts`` (expert ids, any shape): ``[num_experts]`` int64.

    A comparison against every id, summed: no host read (``torch.bincount`` sizes its output
    from the largest id, which the host reads from the device on CUDA) and no atomics.
    """
    ids = torch.arange(num_experts, device=experts.device)
    return (experts.reshape(-1, 1) == ids).sum(dim=0)


def sort_assignments(
    experts: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, counts, dropped)``: every flat ``[T * k]`` assignment, those the experts
    compute first, sorted by expert (token order within one), then the dropped ones (token
    order); the count per expert, so ``order[:counts.sum()]`` are the kept ones; and how many
    were dropped (0-dim). Nothing is read on the host: the caller learns the counts with its
    one host copy (:func:`~megatronish.moe.dispatch.dispatch`).

    Dropless when ``capacity`` is None; otherwise each expert keeps its ``capacity`` assignments
    of highest weight (Megatron-LM's ``probs`` drop policy; equal weights: the earlier token).
    """
    flat = experts.reshape(-1)
    counts = count_per_expert(flat, num_experts)
    if capacity is None:
        return torch.argsort(flat, stable=True), counts, counts.new_zeros(())
    by_weight = torch.argsort(-weights.detach().reshape(-1), stable=True)
    by_expert = by_weight[torch.argsort(flat[by_weight], stable=True)]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
    kept = torch.empty_like(flat, dtype=torch.bool)
    kept[by_expert] = rank < capacity  # each assignment's place within its expert, by weight
    # Dropped ones sort after every expert; a stable sort keeps token order within each key.
    order = torch.argsort(torch.where(kept, flat, num_experts), stable=True)
    kept_counts = counts.clamp(max=capacity)
    return order, kept_counts, flat.numel() - kept_counts.sum()
