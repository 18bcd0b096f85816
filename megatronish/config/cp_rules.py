"""The context-parallel exchange's rules: ``parallel.cp_comm_type`` against the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig

RINGS = ("ring", "a2a_ring")  # the exchanges whose attention runs block by block (no dropout)


def cp_exchange_errors(cfg: TrainConfig) -> list[str]:
    """Every rule of ``parallel.cp_comm_type`` (and ``parallel.cp_a2a_size``) that ``cfg``
    breaks."""
    m, p = cfg.model, cfg.parallel
    a2a_size = getattr(p, "cp_a2a_size", None)
    if p.cp_comm_type != "a2a_ring" and a2a_size is not None:
        return [
            f"parallel.cp_a2a_size={a2a_size} sizes the all-to-all groups of "
            f"cp_comm_type=a2a_ring, not of cp_comm_type={p.cp_comm_type}: set it to null or "
            "use cp_comm_type=a2a_ring"
        ]
    if p.cp == 1:
        # every exchange is the same (none) without context parallelism
        if a2a_size is None:
            return []
        return [
            f"parallel.cp_a2a_size={a2a_size} groups cp ranks for cp_comm_type=a2a_ring, and "
            "parallel.cp=1 has none to group (context parallelism is off): set cp_a2a_size to "
            f"null, or parallel.cp to a multiple of {a2a_size} above it (e.g. cp={2 * a2a_size})"
        ]
    errors: list[str] = []
    heads = m.num_attention_heads
    kv_local = max(1, (m.num_query_groups or heads) // p.tp)  # replicated below one per rank
    if p.cp_comm_type == "a2a_ring":
        if a2a_size is None or not 1 < a2a_size < p.cp or p.cp % a2a_size:
            return [
                f"parallel.cp_comm_type=a2a_ring needs parallel.cp_a2a_size, the cp ranks of "
                f"each all-to-all group, to divide parallel.cp={p.cp} strictly between 1 and "
                f"cp (it is {a2a_size}); size 1 is cp_comm_type=ring, size cp is a2a"
            ]
    exchanged = {"a2a": p.cp, "a2a_ring": a2a_size}.get(p.cp_comm_type)
    if exchanged and ((heads // p.tp) % exchanged or kv_local % exchanged):
        key = "cp" if p.cp_comm_type == "a2a" else "cp_a2a_size"
        errors.append(
            f"parallel.cp_comm_type={p.cp_comm_type} exchanges heads over {exchanged} cp ranks: "
            f"the {heads // p.tp} query and {kv_local} kv heads per tp rank must be divisible "
            f"by parallel.{key}={exchanged}; use cp_comm_type=all_gather (or ring) or a "
            f"{key} that divides both"
        )
    if p.cp_comm_type in RINGS and m.attention_dropout > 0:
        errors.append(
            f"parallel.cp_comm_type={p.cp_comm_type} runs no attention dropout: set "
            f"model.attention_dropout=0 (it is {m.attention_dropout}) or use "
            f"cp_comm_type=all_gather"
        )
    return errors
