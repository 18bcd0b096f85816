"""Data parallelism's rules: hybrid sharding (``parallel.zero_shard_size``) and gradient
compression (``parallel.grad_compression``) against the layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatronish.config.derived import model_widths, pad_vocab

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig

# PowerSGD compresses a matrix only where that saves this many times (torch's powerSGD_hook's
# min_compression_rate); megatronish.data_parallel.powersgd chooses its matrices by it.
POWERSGD_MIN_RATE = 2.0


def data_parallel_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """Every data-parallel rule ``cfg`` breaks on ``dp`` data-parallel ranks."""
    return hybrid_shard_errors(cfg, dp) + compression_errors(cfg, dp)


def compression_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """The rules of ``parallel.grad_compression``."""
    p = cfg.parallel
    kind = p.grad_compression
    errors = []
    if kind != "powersgd" and p.powersgd_compress_vocab:
        errors.append(
            "parallel.powersgd_compress_vocab=true chooses the matrices PowerSGD compresses, and "
            f"parallel.grad_compression={kind or 'null'} is not powersgd: set it to false, or "
            "grad_compression=powersgd"
        )
    if kind is None:
        start = getattr(p, "grad_compression_start_step", 0)
        if start:
            errors.append(
                f"parallel.grad_compression_start_step={start} delays a compression that is not "
                "set: set parallel.grad_compression (powersgd or int8) or leave it at 0"
            )
        return errors
    if errors:
        return errors
    key = f"parallel.grad_compression={kind}"
    if dp * p.cp == 1:
        return [
            f"{key} compresses the data-parallel reduction, and dp x cp = 1 has none: set it "
            "to null"
        ]
    if kind == "powersgd" and p.zero_stage > 1:
        return [
            f"{key} compresses the all-reduce of ZeRO 0 and 1, not parallel.zero_stage="
            f"{p.zero_stage}'s reduce-scatter of every microbatch: use zero_stage 0 or 1, or "
            "grad_compression=int8"
        ]
    if kind == "int8" and p.zero_stage == 0:
        return [
            f"{key} quantizes ZeRO's reduce-scatter, and parallel.zero_stage=0 all-reduces: use "
            "zero_stage 1, 2 or 3, or grad_compression=powersgd"
        ]
    if kind == "powersgd" and (error := powersgd_rank_error(cfg)):
        errors.append(error)
    if getattr(p, "zero_shard_size", None) not in (None, dp):
        errors.append(
            f"{key} compresses the reduction over every dp rank; with parallel.zero_shard_size "
            "the link between nodes carries only the shards' all-reduce, which it does not "
            "compress: use one of them"
        )
    if p.grad_reduce_dtype != "fp32":
        errors.append(
            f"{key} sends its own compressed format: set parallel.grad_reduce_dtype=fp32 (it is "
            f"{p.grad_reduce_dtype})"
        )
    return errors


def hybrid_shard_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """The rules of ``parallel.zero_shard_size``."""
    p = cfg.parallel
    shard = getattr(p, "zero_shard_size", None)
    if shard is None:
        return []
    if p.zero_stage == 0:
        return [
            f"parallel.zero_shard_size={shard} sizes the groups ZeRO shards over, but "
            "parallel.zero_stage=0 shards nothing: set zero_stage to 1, 2 or 3, or "
            "zero_shard_size to null"
        ]
    if dp % shard:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        return [
            f"parallel.zero_shard_size={shard} must divide the data-parallel size dp={dp} "
            f"(shard groups of consecutive dp ranks, replicated across): use one of "
            f"{', '.join(map(str, divisors))}"
        ]
    return []


def powersgd_matrices(cfg: TrainConfig) -> dict[str, tuple[int, int]]:
    """``name -> (n, m)``: every weight of a rank's model PowerSGD may compress, as it views
    it (the first dimension by the rest; this tp rank's slice, this ep rank's experts), the
    vocabulary's only with ``parallel.powersgd_compress_vocab``."""
    m, p = cfg.model, cfg.parallel
    moe = m.moe
    h, tp, llama = m.hidden_size, p.tp, m.arch == "llama"
    ffn, kv, d = model_widths(m)
    q_local, kv_local = m.num_attention_heads // tp, max(1, kv // tp)
    out = {
        "attention q|k|v": ((q_local + 2 * kv_local) * d, h),
        "attention output": (h, q_local * d),
    }
    gated = 2 if llama else 1  # SwiGLU's gate and up share fc1
    if not moe.num_experts or (moe.layer_freq > 1 and m.num_layers > 1):  # a dense MLP block
        out |= {"mlp fc1": (gated * ffn // tp, h), "mlp fc2": (h, ffn // tp)}
    if moe.num_experts:
        local, expert_ffn = moe.num_experts // p.ep, moe.ffn_hidden_size or ffn
        out |= {
            "router": (moe.num_experts, h),
            "experts' fc1": (local, gated * expert_ffn // tp * h),
            "experts' fc2": (local, h * expert_ffn // tp),
        }
        if moe.shared_experts:
            shared = moe.shared_experts * expert_ffn
            out |= {"shared fc1": (gated * shared // tp, h), "shared fc2": (h, shared // tp)}
    if m.arch == "gpt2":
        out["position embedding"] = (m.max_position_embeddings or m.seq_length, h)
    if getattr(p, "powersgd_compress_vocab", False):
        vocab = m.vocab_size or cfg.data.vocab_size
        out["word embedding and output layer"] = (
            pad_vocab(vocab, m.make_vocab_size_divisible_by) // tp,
            h,
        )
    return out


def largest_powersgd_rank(n: int, m: int) -> int:
    """The largest rank at which PowerSGD compresses an ``n x m`` matrix: it sends ``(n + m) r``
    values instead of ``n m``, and only where that saves :data:`POWERSGD_MIN_RATE` times."""
    return (n * m - 1) // int(POWERSGD_MIN_RATE * (n + m))


def powersgd_rank_error(cfg: TrainConfig) -> str | None:
    """``parallel.powersgd_rank`` too high for every matrix of the model (nothing would be
    compressed), or None."""
    rank = cfg.parallel.powersgd_rank
    mats = powersgd_matrices(cfg)
    name, (n, m) = max(mats.items(), key=lambda item: largest_powersgd_rank(*item[1]))
    most = largest_powersgd_rank(n, m)
    if rank <= most:
        return None
    fix = (
        f"use parallel.powersgd_rank <= {most}"
        if most >= 1
        else "no rank compresses one: set parallel.grad_compression=null"
    )
    return (
        f"parallel.powersgd_rank={rank} compresses none of this model's matrices (PowerSGD "
        f"compresses an n x m grad where (n + m) * rank * {POWERSGD_MIN_RATE:g} < n * m; the "
        f"most compressible, the {name} per rank, {n} x {m}, takes rank {most} at most): {fix}"
    )


def data_parallel_notes(cfg: TrainConfig, cuda_available: bool | None = None) -> list[str]:
    """Data-parallel settings that do nothing in ``cfg``: optimizer offload on the CPU, a
    compression that starts after the last step. ``cuda_available``: whether this machine has
    a GPU (None: unknown, as in dry runs; then only ``trainer.device=cpu`` is a CPU run)."""
    p, t = cfg.parallel, cfg.trainer
    notes = []
    on_cpu = t.device == "cpu" or (t.device == "auto" and cuda_available is False)
    if getattr(p, "optimizer_offload", False) and on_cpu:
        notes.append(
            "parallel.optimizer_offload=true moves nothing on the CPU (trainer.device="
            f"{t.device}): the optimizer's state already is in host memory"
        )
    start = getattr(p, "grad_compression_start_step", 0)
    if getattr(p, "grad_compression", None) is not None and start >= t.max_steps:
        notes.append(
            f"parallel.grad_compression_start_step={start} is not before trainer.max_steps="
            f"{t.max_steps}: every step reduces its grads uncompressed (parallel.grad_compression="
            f"{p.grad_compression} never starts)"
        )
    return notes
