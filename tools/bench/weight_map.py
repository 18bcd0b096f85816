"""Load megatronish's global weights into the reference GPT, so both start from one model.

With equal weights, data and optimizer the two runs compute the same losses (to fp32
round-off): the benchmarks then time the same work, and the first losses double as a check.
"""

from __future__ import annotations

import torch
from reference_gpt import ReferenceGPT


def reference_state(weights: dict[str, torch.Tensor], model: ReferenceGPT) -> dict:
    """A ``model.state_dict()`` made from megatronish's names (``layers.i.attn.qkv.weight``...)."""
    cfg = model.cfg
    d = cfg.head_dim
    out = {
        "tok_embeddings.weight": weights["embedding.word.weight"],
        "norm.weight": weights["head.norm.weight"],
        "output.weight": weights["head.weight"],
    }
    for i in range(cfg.num_layers):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in weights.items()}
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = w["attn_norm.weight"]
        out[p + "ffn_norm.weight"] = w["mlp_norm.weight"]
        out[p + "attention.wo.weight"] = w["attn.proj.weight"]
        out[p + "feed_forward.w2.weight"] = w["mlp.fc2.weight"]
        qkv, fc1 = w["attn.qkv.weight"], w["mlp.fc1.weight"]
        if cfg.fused:
            out[p + "attention.wqkv.weight"] = qkv
            out[p + "feed_forward.w13.weight"] = fc1
        else:
            q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
            out[p + "attention.wq.weight"] = q
            out[p + "attention.wk.weight"] = k
            out[p + "attention.wv.weight"] = v
            gate, up = fc1.chunk(2)
            out[p + "feed_forward.w1.weight"] = gate
            out[p + "feed_forward.w3.weight"] = up
    return out


def load_megatronish_weights(model: ReferenceGPT, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (megatronish global names) into ``model``; every tensor must match."""
    model.load_state_dict({k: v.clone() for k, v in reference_state(weights, model).items()})
