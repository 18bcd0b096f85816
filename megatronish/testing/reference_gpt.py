"""A plain-PyTorch llama-style GPT (nanoGPT style): the independent reference the parity tests
train beside megatronish, and the baseline the benchmarks compare with.

RMSNorm, SwiGLU, rotary positions (rotate-half), grouped-query attention through SDPA,
``[b, s, h]`` activations, an untied output head, fp32. ``fused=True`` computes q|k|v and
gate|up with one matmul each (as nanoGPT does); ``fused=False`` keeps separate ``wq wk wv`` and
``w1 w3`` projections, the layout torch's DTensor tensor-parallel plans shard (as in torchtitan).
The attention and MLP modules read their head counts from attributes, so a tensor-parallel plan
can set them to the local counts (``n_heads // tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RefConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    seq_length: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    fused: bool = True
    # Fused rows grouped per tensor-parallel rank ([q0 k0 v0 | q1 k1 v1], [gate0 up0 | gate1 up1]),
    # so a plain column split of wqkv / w13 gives each rank its own heads and units.
    tp_groups: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_spec(cls, spec, fused: bool = True, tp_groups: int = 1) -> RefConfig:
        """The shape of a megatronish ``ModelSpec`` (padded vocabulary, as its head computes)."""
        return cls(
            vocab_size=spec.padded_vocab_size,
            hidden_size=spec.hidden_size,
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            ffn_hidden_size=spec.ffn_hidden_size,
            seq_length=spec.seq_length,
            norm_eps=spec.norm_eps,
            rope_theta=spec.rope_theta,
            fused=fused,
            tp_groups=tp_groups,
        )


def rope_cache(cfg: RefConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[s, d]`` for the rotate-half convention."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(cfg.seq_length, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[b, heads, s, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.fused = (
            cfg.num_heads,
            cfg.num_kv_heads,
            d,
            cfg.fused,
        )
        if cfg.fused:
            self.wqkv = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        else:
            self.wq = nn.Linear(h, cfg.num_heads * d, bias=False)
            self.wk = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
            self.wv = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        if self.fused:
            q, k, v = self.wqkv(x).split(
                [self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1
            )
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(b, s, -1, d).transpose(1, 2)  # [b, heads, s, d]; -1: local heads under TP
        k = k.view(b, s, -1, d).transpose(1, 2)
        v = v.view(b, s, -1, d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.fused = cfg.fused
        if cfg.fused:
            self.w13 = nn.Linear(h, 2 * f, bias=False)
        else:
            self.w1 = nn.Linear(h, f, bias=False)
            self.w3 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class ReferenceGPT(nn.Module):
    """``forward(ids [b, s], targets [b, s]) -> mean loss`` (logits when targets is None)."""

    def __init__(self, cfg: RefConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_cache(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith(("wo.weight", "w2.weight")):  # GPT-2 scaled residual init
                    p.data.mul_(1.0 / (2 * cfg.num_layers) ** 0.5)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool | None = True,
) -> torch.optim.AdamW:
    """AdamW with decay on matrices (embedding, projections, head) and none on norm weights.

    ``fused`` (default): torch's fused kernel, one call per group, as a user would choose for
    speed (megatronish's own update uses the same kernel); None lets torch choose (foreach).
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


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
        q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        if cfg.fused:
            g = cfg.tp_groups
            out[p + "attention.wqkv.weight"] = _grouped([q, k, v], g)
            out[p + "feed_forward.w13.weight"] = _grouped(list(fc1.chunk(2)), g)
        else:
            out[p + "attention.wq.weight"] = q
            out[p + "attention.wk.weight"] = k
            out[p + "attention.wv.weight"] = v
            gate, up = fc1.chunk(2)
            out[p + "feed_forward.w1.weight"] = gate
            out[p + "feed_forward.w3.weight"] = up
    return out


def _grouped(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Rows of ``parts`` concatenated group by group: part 0's first 1/groups, part 1's, ..."""
    split = [t.chunk(groups) for t in parts]
    return torch.cat([piece[g] for g in range(groups) for piece in split])


def load_megatronish_weights(model: ReferenceGPT, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (megatronish global names) into ``model``; every tensor must match."""
    model.load_state_dict({k: v.clone() for k, v in reference_state(weights, model).items()})
