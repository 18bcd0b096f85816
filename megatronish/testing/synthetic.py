"""Deterministic synthetic token streams for tests and benchmarks (no files needed)."""

from __future__ import annotations

import torch


class PatternTokens:
    """Sample ``i`` is a noisy arithmetic sequence: learnable, so the loss falls quickly.

    Each sample starts at a random token and steps by a random stride from a small set; a few
    positions are replaced by random tokens. Samples depend only on ``(seed, i)``.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0, noise: float = 0.05):
        self.vocab_size, self.seq_length, self.seed, self.noise = (
            vocab_size,
            seq_length,
            seed,
            noise,
        )

    def __len__(self) -> int:
        return 2**31

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = torch.randint(0, self.vocab_size, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        n = self.seq_length + 1
        seq = (start + stride * torch.arange(n)) % self.vocab_size
        flip = torch.rand(n, generator=g) < self.noise
        seq[flip] = torch.randint(0, self.vocab_size, (int(flip.sum()),), generator=g)
        return seq.long()
