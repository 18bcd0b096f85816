"""The ``trainer.fp8`` rules: precision, the blocks kept in bf16, and what fp8 does not
compose with yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatronish.config.derived import model_widths
from megatronish.config.pipeline_rules import SPLIT_BACKWARD_SCHEDULES

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig


FP8_MULTIPLE = 16  # torch._scaled_mm and _scaled_grouped_mm on CUDA: the operands' widths


def fp8_gemm_sizes(cfg: TrainConfig) -> dict[str, int]:
    """The dimensions of a rank's fp8 GEMMs (the tokens of a micro batch, as a column-parallel
    linear sees them: all-gathered under sp; the widths of this tp rank's slices); empty when a
    width does not split over tp (another rule says so)."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    heads = m.num_attention_heads
    ffn, kv, head_dim = model_widths(m)
    widths = {
        "q|k|v": (heads + 2 * kv) * head_dim,
        "attention output": heads * head_dim,
        "ffn": ffn,
    }
    expert_ffn = m.moe.ffn_hidden_size or ffn
    if m.moe.num_experts:  # the experts' grouped GEMMs are split over tp as the MLP is
        widths["experts' ffn"] = expert_ffn
    if m.moe.num_experts and m.moe.shared_experts:
        widths["shared experts' ffn"] = m.moe.shared_experts * expert_ffn
    if any(w % p.tp for w in widths.values()) or m.seq_length % p.cp:
        return {}
    sizes = {f"{name} / tp": w // p.tp for name, w in widths.items()}
    sizes["hidden"] = m.hidden_size
    sizes["tokens per micro batch"] = t.micro_batch_size * m.seq_length // p.cp
    return sizes


def fp8_errors(cfg: TrainConfig, schedule: str | None) -> list[str]:
    """Every ``trainer.fp8`` rule ``cfg`` breaks (``schedule``: the resolved pipeline schedule;
    the recipe's name is checked with the other choices)."""
    t, layers = cfg.trainer, cfg.model.num_layers
    skip = t.fp8_skip_first_last
    if skip < 0:
        return [f"trainer.fp8_skip_first_last={skip} must be >= 0"]
    if t.fp8 is None:
        return []
    errors = []
    if t.precision != "bf16":
        errors.append(
            f"trainer.fp8={t.fp8} needs trainer.precision=bf16 (fp8 GEMMs take and give bf16 "
            "activations; weights and optimizer stay as bf16 training keeps them)"
        )
    if 2 * skip >= layers:
        errors.append(
            f"trainer.fp8_skip_first_last={skip} keeps all {layers} blocks in bf16 (the first and "
            f"last {skip}); lower it below {(layers + 1) // 2} or set trainer.fp8=null"
        )
    if sizes := fp8_gemm_sizes(cfg):
        odd = ", ".join(f"{name} {size}" for name, size in sizes.items() if size % FP8_MULTIPLE)
        if odd:
            errors.append(
                f"trainer.fp8 needs every fp8 GEMM dimension on a rank to be a multiple of "
                f"{FP8_MULTIPLE} (cuBLASLt's and CUTLASS's fp8 kernels), but {odd}; change the "
                "model's widths, parallel.tp, or the tokens per micro batch"
            )
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        errors.append(
            f"trainer.fp8 does not split its backward for parallel.pipeline_schedule={schedule} "
            "yet; use 1f1b or interleaved, or trainer.fp8=null"
        )
    return errors


def fp8_notes(cfg: TrainConfig) -> list[str]:
    """``trainer.fp8_skip_first_last`` without ``trainer.fp8`` (no block runs in fp8)."""
    t = cfg.trainer
    if t.fp8 is None and t.fp8_skip_first_last > 0:
        return [
            f"trainer.fp8_skip_first_last={t.fp8_skip_first_last} has no effect without "
            "trainer.fp8 (no block runs in fp8 to keep in bf16)"
        ]
    return []
