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


class PackedPatternTokens(PatternTokens):
    """:class:`PatternTokens` windows holding packed documents that end at ``eod`` tokens.

    Sample ``i`` by ``i % 4``: no EOD (one document longer than the window); documents ending
    at indices 3 and 7 (boundaries on every chunk boundary of cp 2 and 4 at ``seq_length`` 16);
    EODs at 5, 6, 7 and ``seq_length - 1`` (one-token documents, documents shorter than a cp
    chunk, and a last input that ends its document); EODs at random (each token one in four).
    No other token equals ``eod``.
    """

    def __init__(self, vocab_size: int, seq_length: int, eod: int, seed: int = 0):
        super().__init__(vocab_size, seq_length, seed)
        self.eod = eod

    def __getitem__(self, i: int) -> torch.Tensor:
        seq = super().__getitem__(i)
        seq[seq == self.eod] = (self.eod + 1) % self.vocab_size
        s, kind = self.seq_length, i % 4
        if kind == 1:
            seq[[3, 7]] = self.eod
        elif kind == 2:
            seq[[5, 6, 7, s - 1]] = self.eod
        elif kind == 3:
            g = torch.Generator().manual_seed(self.seed * 7_000_003 + i)
            seq[torch.rand(s + 1, generator=g) < 0.25] = self.eod
        return seq
