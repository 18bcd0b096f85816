"""The context-parallel exchange's rules: ``parallel.cp_comm_type`` against the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig


def cp_exchange_errors(cfg: TrainConfig) -> list[str]:
    """Every rule of ``parallel.cp_comm_type`` that ``cfg`` breaks (none without cp)."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return []
    errors: list[str] = []
    heads = m.num_attention_heads
    kv_local = max(1, (m.num_query_groups or heads) // p.tp)  # replicated below one per rank
    if p.cp_comm_type == "a2a" and ((heads // p.tp) % p.cp or kv_local % p.cp):
        errors.append(
            f"parallel.cp_comm_type=a2a gives each cp rank 1/cp of the heads: the "
            f"{heads // p.tp} query and {kv_local} kv heads per tp rank must be divisible by "
            f"parallel.cp={p.cp}; use cp_comm_type=all_gather or a cp that divides both"
        )
    if p.cp_comm_type == "ring" and m.attention_dropout > 0:
        errors.append(
            f"parallel.cp_comm_type=ring runs no attention dropout: set "
            f"model.attention_dropout=0 (it is {m.attention_dropout}) or use "
            f"cp_comm_type=all_gather"
        )
    return errors
