"""A checkpoint's model in one process (tp = cp = pp = 1), whatever layout saved it.

Only the model tensors are read (no optimizer state, no RNG): each parameter of a one-rank
model built from the checkpoint's resolved config is filled with its global tensor, read from
the shards of every rank that wrote a piece of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.checkpoint.format import (
    BUFFER,
    CheckpointError,
    Metadata,
    read_metadata,
    resolve_step_dir,
)
from megatronish.checkpoint.parts import model_buffers
from megatronish.checkpoint.shard_reader import ShardReader
from megatronish.hf.common import model_spec
from megatronish.model.gpt import GPTChunk
from megatronish.model.parallel_context import ParallelContext
from megatronish.spec import ModelSpec


@dataclass
class Loaded:
    """A checkpoint's model, ready to decode."""

    model: GPTChunk  # the whole model, eval mode
    spec: ModelSpec
    meta: Metadata
    step_dir: str

    def describe(self) -> str:
        """One line: the step, the model and the layout that saved it."""
        lay = self.meta.layout
        saved = " ".join(f"{k}={lay[k]}" for k in ("tp", "cp", "pp", "dp") if k in lay)
        params = sum(p.numel() for p in self.model.parameters())
        return (
            f"{self.step_dir}: step {self.meta.step}, {self.spec.arch} "
            f"({params / 1e6:.2f}M params, vocab {self.spec.vocab_size}, context "
            f"{self.spec.seq_length}), saved at {saved}"
        )


def spec_of(meta: Metadata, where: str) -> ModelSpec:
    """The model of a checkpoint's resolved config (the padded embedding's rows as the
    vocabulary when the config does not record it)."""
    model_cfg = meta.config.get("model")
    emb = meta.tensors.get("model/embedding.word.weight")
    if not model_cfg or emb is None:
        raise CheckpointError(f"{where} has no model config or no embedding: not a GPT checkpoint")
    try:
        return model_spec(model_cfg, model_cfg.get("vocab_size") or emb.shape[0])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: its model config cannot be built: {e}") from e


def _check_tensors(model: GPTChunk, meta: Metadata, where: str) -> None:
    """Every parameter is in the checkpoint with its shape, and no model tensor is left over."""
    stored = {n[6:]: e.shape for n, e in meta.tensors.items() if n.startswith("model/")}
    stored.update({n: e.shape for n, e in meta.tensors.items() if n.startswith(BUFFER)})
    wanted = {n: list(p.shape) for n, p in model.named_parameters()}
    wanted.update({f"{BUFFER}{n}": list(b.shape) for n, b in model_buffers([model]).items()})
    wrong = [
        f"{n}: checkpoint {stored[n]}, model {s}"
        for n, s in wanted.items()
        if n in stored and stored[n] != s
    ]
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    parts = wrong + [f"missing: {', '.join(missing)}"] * bool(missing)
    parts += [f"not in the model: {', '.join(extra)}"] * bool(extra)
    if parts:
        raise CheckpointError(f"{where} does not match its own model config: " + "; ".join(parts))


@torch.no_grad()
def load_model(path: str, device: torch.device | str = "cpu", verify: bool = True) -> Loaded:
    """The model of the checkpoint at ``path`` (a ``checkpoint.dir``, i.e. its latest step, or
    one ``step_XXXXXXX`` directory) on ``device``, in fp32; ``verify`` checks each shard's
    CRC32. Raises :class:`CheckpointError` for a missing, damaged or unknown checkpoint."""
    step_dir = resolve_step_dir(path)
    meta = read_metadata(step_dir)
    spec = spec_of(meta, step_dir)
    model = GPTChunk(
        spec, ParallelContext(), range(spec.num_layers), first=True, last=True, device=device
    )
    _check_tensors(model, meta, step_dir)
    with ShardReader(step_dir, meta, verify=verify) as reader:
        requests = [(f"model/{n}", None, p.data) for n, p in model.named_parameters()]
        requests += [(f"{BUFFER}{n}", None, b) for n, b in model_buffers([model]).items()]
        reader.read_many(requests)
    return Loaded(model.eval(), spec, meta, step_dir)
