"""Named RNG states so dropout is reproducible and right under tensor parallelism.

- ``default``: torch's own generator, seeded identically on every tp rank (replicated
  activations get identical dropout masks).
- ``tp``: seeded differently per tp rank; dropout inside tensor-parallel regions (attention
  probabilities of a rank's own heads, sequence shards) runs in ``tracker.fork("tp")``.

States are plain tensors, so they can be saved in a checkpoint and restored on resume, and
activation recompute replays the same masks (it restores the state it saw in forward).
"""

from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718
CP_SEED_STRIDE = 100_003  # cp ranks hold other tokens of the same samples: their own masks


class RNGTracker:
    """Holds the ``tp`` generator state for one device and swaps it in on :meth:`fork`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def seed(self, seed: int, tp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> None:
        """Seed ``default`` (same on every tp rank) and ``tp`` (different per tp rank); both
        differ per cp rank, whose activations are other positions of the same samples."""
        base = seed + 100 * pp_rank + CP_SEED_STRIDE * cp_rank
        torch.manual_seed(base)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(base)
        saved = self._get()
        torch.manual_seed(base + TP_SEED_OFFSET + tp_rank)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(base + TP_SEED_OFFSET + tp_rank)
        self.states["tp"] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "tp"):
        """Run the block with generator ``name``; its advanced state is kept for next time."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never seeded; call RNGTracker.seed first")
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every state, ``default`` included, as uint8 tensors."""
        return {"default": self._get().clone(), **{k: v.clone() for k, v in self.states.items()}}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self._set(states["default"])
        self.states = {k: v.clone() for k, v in states.items() if k != "default"}
