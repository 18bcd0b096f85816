"""The plain-PyTorch reference of the throughput section, on the trainer's device.

``megatronish/testing/reference_gpt.py``'s llama (nn.RMSNorm, fused q|k|v and gate|up, RoPE,
SDPA with grouped-query attention, untied head) loaded with the megatronish model's weights,
trained on the same batches with bf16 autocast (on CUDA), torch's fused AdamW with the same
groups and hyperparameters, and the same grad clipping: the same work as a megatronish step.
``compile_backend``: each block compiled with ``torch.compile`` (the compiled-blocks section).
"""

from __future__ import annotations

import contextlib

import torch

from megatronish.testing.reference_gpt import (
    RefConfig,
    ReferenceGPT,
    build_adamw,
    load_megatronish_weights,
)


class ReferenceRun:
    """``step()``: the next global batch -> forward -> backward -> clip -> AdamW; its loss."""

    def __init__(self, trainer, bf16: bool, compile_backend: str | None = None):
        self.trainer = trainer  # for its data and batch layout only
        device = trainer.topo.device
        with torch.device(device):
            self.model = ReferenceGPT(RefConfig.from_spec(trainer.spec, fused=True))
        weights = {n: p.detach() for n, p in trainer.chunks[0].named_parameters()}
        load_megatronish_weights(self.model, weights)
        if compile_backend is not None:  # each block, as torchtitan and trainer.compile do
            for block in self.model.layers:
                block.compile(backend=compile_backend)
        o = trainer.cfg.optimizer
        self.optimizer = build_adamw(
            self.model, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps, fused=True
        )
        self.params = list(self.model.parameters())
        self.clip = trainer.cfg.optimizer.grad_clip
        self.bf16 = bf16
        self.index = 0

    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.trainer.topo.device.type, dtype=torch.bfloat16)

    def step(self) -> float:
        t = self.trainer
        first = self.index * t.cfg.trainer.global_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        batches = t.microbatches(t.train_data, first)
        for inputs, targets in batches:
            with self.autocast():
                loss = self.model(inputs, targets) / len(batches)
            loss.backward()
            losses.append(loss.detach())
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.index += 1
        return torch.stack(losses).sum().item()
