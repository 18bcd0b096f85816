"""Choosing the next token from logits: greedy, or drawn after temperature, top-k and top-p.

Pure functions of the logits and a seeded :class:`torch.Generator`. The filters run in Hugging
Face's order (temperature, then top-k, then top-p) and keep the same tokens as its warpers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: the most likely one (``greedy``), or drawn from the softmax
    of the logits divided by ``temperature``, restricted to the ``top_k`` most likely tokens
    (0: all) and to the smallest set of them whose probability reaches ``top_p`` (1: all)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # inf would draw uniformly from every token, nan from none: neither is a temperature.
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature={self.temperature} must be a finite number > 0, e.g. "
                "temperature=0.8 (lower: closer to greedy)"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:  # nan is refused too
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    def describe(self) -> str:
        """One phrase for logs, e.g. ``sampling (temperature 0.8, top_k 40)``."""
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top_k {self.top_k}"] * (self.top_k > 0)
        parts += [f"top_p {self.top_p:g}"] * (self.top_p < 1)
        return f"sampling ({', '.join(parts)})"


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` ``[..., V]`` with every value below the ``k``-th largest set to -inf (ties
    with it are kept); ``k`` = 0 or >= V keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` ``[..., V]`` keeping only the smallest set of most likely tokens whose
    probability sums to at least ``p`` (at least one token); ``p`` = 1 keeps all."""
    if p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the more likely tokens
    drop = before >= p
    drop[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The logits ``[..., V]`` a token is drawn from: scaled by the temperature, then top-k
    and top-p filtered (-inf for tokens that cannot be drawn)."""
    scaled = logits.float() / sampling.temperature
    return top_p_filter(top_k_filter(scaled, sampling.top_k), sampling.top_p)


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token ``[b]`` of each row of ``logits`` ``[b, V]``: the argmax when greedy,
    else drawn with ``generator`` (on the logits' device) from the filtered softmax."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
