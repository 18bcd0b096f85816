"""The decoding loop: a prompt through the model once, then one token at a time with a KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatronish.generate.sampling import Sampling, next_token
from megatronish.model.blocks import KVCache
from megatronish.model.gpt import GPTChunk


@dataclass
class Generated:
    """What :func:`generate` returns."""

    ids: torch.Tensor  # [b, prompt + new tokens]; rows that ended early are padded with EOS
    new_tokens: int  # tokens added to every row
    stopped_at_eos: bool  # every row ended with the EOS token before max_new_tokens
    seconds: float  # wall time of the loop


def new_cache(model: GPTChunk, batch: int, capacity: int) -> list[KVCache]:
    """An empty KV cache of ``capacity`` tokens for every layer of ``model``."""
    p = model.embedding.word.weight
    return [KVCache(model.spec, batch, capacity, p.device, p.dtype) for _ in model.layers]


@torch.no_grad()
def generate(
    model: GPTChunk,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> Generated:
    """Continue each row of ``prompt`` ``[b, s]`` by up to ``max_new_tokens`` tokens.

    ``model`` is the whole model on one rank (see :meth:`GPTChunk.decode`), in eval mode. A row
    ends at ``eos_id`` (kept); the loop stops when every row has ended. Tokens are drawn from the
    first ``vocab_size`` ids (default: the model's real vocabulary; padding ids never win).
    """
    b, s = prompt.shape
    limit = model.spec.seq_length
    if s == 0 or s + max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({s} tokens) and max_new_tokens={max_new_tokens} must fit the model's "
            f"context of {limit} tokens (model.seq_length), with at least one prompt token"
        )
    vocab = vocab_size or model.spec.vocab_size
    start = time.perf_counter()
    cache = new_cache(model, b, s + max_new_tokens)
    tokens, ended = [prompt], torch.zeros(b, dtype=torch.bool, device=prompt.device)
    ids = prompt
    for _ in range(max_new_tokens):
        logits = model.decode(ids, cache)[:, -1, :vocab]
        ids = next_token(logits, sampling or Sampling(), generator)
        if eos_id is not None:
            ids = ids.masked_fill(ended, eos_id)
            ended |= ids == eos_id
        ids = ids[:, None]
        tokens.append(ids)
        if eos_id is not None and bool(ended.all()):
            break
    out = torch.cat(tokens, dim=1)
    return Generated(
        ids=out,
        new_tokens=out.shape[1] - s,
        stopped_at_eos=bool(ended.all()) and eos_id is not None,
        seconds=time.perf_counter() - start,
    )
