"""Tiny megatronish and transformers models side by side, for the HF conversion tests.

Both run one fp32 model in one process on the CPU; logits are compared over the real
vocabulary (megatronish's padding rows cut).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file

from megatronish.hf.common import model_spec
from megatronish.model.gpt import GPTChunk
from megatronish.model.init import init_parameters
from megatronish.model.parallel_context import ParallelContext

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 100, 16  # the vocabulary pads to 128
TOL = 1e-5  # max |megatronish - transformers| logits (fp32)


def tool(name: str) -> ModuleType:
    """tools/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ids() -> torch.Tensor:
    """The tokens every comparison feeds: ``[2, SEQ]`` below ``VOCAB``."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights away from 1, so swapped or missing norms show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def our_model(cfg: dict, tensors: dict | None = None) -> GPTChunk:
    """The whole model of config section ``cfg`` in one chunk: ``tensors`` loaded, or
    initialised (padding rows zero, norms perturbed)."""
    spec = model_spec(cfg, cfg["vocab_size"])
    chunk = GPTChunk(spec, ParallelContext(), range(spec.num_layers), first=True, last=True)
    if tensors is not None:
        chunk.load_state_dict(tensors, strict=True)
        return chunk.eval()
    with torch.no_grad():
        init_parameters(chunk, 11, 0, 1)
        chunk.embedding.word.weight[VOCAB:] = 0  # cut by the export, zeros after an import
        chunk.head.weight[VOCAB:] = 0
    perturb_norms(chunk, 12)
    return chunk.eval()


@torch.no_grad()
def our_logits(chunk: GPTChunk) -> torch.Tensor:
    """``[2, SEQ, VOCAB]`` logits of :func:`ids`."""
    return chunk.head.logits(chunk(ids())).transpose(0, 1)[..., :VOCAB]


def tensors_of(chunk: GPTChunk) -> dict[str, torch.Tensor]:
    """Copies of the chunk's parameters by global name."""
    return {n: p.detach().clone() for n, p in chunk.named_parameters()}


@torch.no_grad()
def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    """A transformers causal LM's logits of :func:`ids`."""
    return model(ids()).logits


def load_hf(config: dict, state: dict[str, torch.Tensor], path: Path) -> torch.nn.Module:
    """``config`` + ``state`` written as a model directory and loaded by transformers, every
    tensor used and none missing."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()
