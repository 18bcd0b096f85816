"""The parallel layout and run shape a plan is made for (plain values, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from megatronish.config.derived import derive
from megatronish.config.pipeline_rules import V_SHAPE_SCHEDULES, resolve_pipeline_schedule
from megatronish.config.schema import TrainConfig
from megatronish.distributed.parallel_grid import ParallelGrid
from megatronish.model.build import chunk_ids_of_stage
from megatronish.plan.documents import planned_attention_span
from megatronish.spec import ModelSpec


@dataclass(frozen=True)
class Layout:
    """Everything about a job that decides memory, FLOPs and communication per rank."""

    tp: int
    pp: int
    vpp: int
    dp: int
    sp: bool
    zero_stage: int
    micro_batch_size: int
    global_batch_size: int
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"  # uniform | block
    recompute_num_layers: int = 1
    layers_per_chunk: tuple[int, ...] = ()  # empty: an even split
    bucket_size_mb: float = 25.0
    zero3_keep_gathered: bool = False
    precision: str = "fp32"  # fp32 | bf16 (bf16 params and activations; fp32 main params,
    # grads and Adam moments)
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16: the dp grad reduction
    cp: int = 1  # context parallel: each sequence split over cp ranks
    cp_comm_type: str = "all_gather"  # parallel.cp_comm_type: all_gather | a2a | ring | a2a_ring
    cp_a2a_size: int = 1  # parallel.cp_a2a_size under a2a_ring (1 otherwise)
    document_masks: bool = False  # data.reset_attention_mask: attention within documents
    ep: int = 1  # expert parallel: experts split over ep ranks carved out of dp x cp
    device_type: str = "cuda"  # cuda | cpu: SDPA's kernels differ (plan/dense.py)
    # parallel.pipeline_schedule: None for the default of vpp (1f1b, interleaved), or a
    # zero-bubble one (zb-h1 with vpp = 1, zbv with vpp = 2)
    pipeline_schedule: str | None = None
    moe_dispatch_order: str = "tp_first"  # parallel.moe_dispatch_order (tp > 1 only)
    moe_shared_expert_overlap: bool = True  # parallel.moe_shared_expert_overlap
    zero_shard_size: int | None = None  # parallel.zero_shard_size: hybrid sharding's dp ranks
    grad_compression: str | None = None  # parallel.grad_compression: powersgd | int8
    powersgd_rank: int = 4  # parallel.powersgd_rank (grad_compression=powersgd)
    powersgd_compress_vocab: bool = False  # parallel.powersgd_compress_vocab
    optimizer_offload: bool = False  # parallel.optimizer_offload: the update on the host
    fp8: str | None = None  # trainer.fp8: tensorwise | rowwise (the blocks' linears in fp8)
    fp8_skip_first_last: int = 0  # trainer.fp8_skip_first_last: blocks kept in bf16 each end

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same params: grads are reduced and ZeRO shards spread over them."""
        return self.dp * self.cp

    @property
    def zero_shard_ranks(self) -> int:
        """Ranks ZeRO shards the dense params' state over: dp x cp, or cp x zero_shard_size
        under hybrid sharding."""
        return self.cp * (self.zero_shard_size or self.dp)

    @property
    def zero_replicas(self) -> int:
        """Shard groups holding the same shards (hybrid sharding; 1 otherwise)."""
        return self.dp_cp // self.zero_shard_ranks

    @property
    def compression_name(self) -> str | None:
        """The gradient compression in a layout's words (``powersgd/4``, ``int8``), or None."""
        if self.grad_compression == "powersgd":
            vocab = "+vocab" if self.powersgd_compress_vocab else ""
            return f"powersgd/{self.powersgd_rank}{vocab}"
        return self.grad_compression

    @cached_property
    def grid(self) -> ParallelGrid:
        """The runtime's rank grid of this layout (its named groups, the experts' view)."""
        return ParallelGrid.of(
            tp=self.tp,
            cp=self.cp,
            dp=self.dp,
            pp=self.pp,
            ep=self.ep,
            cp_a2a=self.cp_a2a_size,
            zero_shard=self.zero_shard_size,
        )

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert grads reduced, their ZeRO shards spread)."""
        return self.grid.size("edp")

    def group(self, name: str) -> str:
        """The CommStats name of the runtime's group ``name`` on this layout (dp_cp is dp's
        group when cp = 1, edp dp_cp's when ep = 1)."""
        return self.grid.communicator(name)

    @property
    def stage_ranks(self) -> int:
        """Ranks sharing the work of one pipeline stage of a model replica: tp x cp."""
        return self.tp * self.cp

    def replica_tokens(self, seq_length: int) -> float:
        """Tokens per step of one model replica (its dp rank's share of the batch)."""
        return self.global_batch_size * seq_length / self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of activations and of the model's params: bf16 or fp32."""
        return 2 if self.precision == "bf16" else 4

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per element of the dp grad reduction."""
        return 2 if self.grad_reduce_dtype == "bf16" else 4

    @property
    def schedule(self) -> str:
        """The pipeline schedule this layout runs (the default of its vpp when not set)."""
        return resolve_pipeline_schedule(self.pipeline_schedule, self.vpp)

    @property
    def v_shape(self) -> bool:
        """Whether the chunks sit in a V (zbv: the first and the last chunk on stage 0)."""
        return self.schedule in V_SHAPE_SCHEDULES

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    def chunk_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers of every global chunk (``pp * vpp`` of them)."""
        if self.layers_per_chunk:
            return self.layers_per_chunk
        chunks = self.pp * self.vpp
        return (num_layers // chunks,) * chunks

    def stage_chunks(self, pp_rank: int) -> list[int]:
        """The global chunks pipeline rank ``pp_rank`` holds (the trainer's rule)."""
        return chunk_ids_of_stage(pp_rank, self.pp, self.vpp, self.v_shape)

    def rank_key(self, num_layers: int, pp_rank: int) -> tuple:
        """The fields that decide what a rank of pipeline stage ``pp_rank`` holds and its
        tensors' shapes: its chunks' layers, their tp / ep shards and the experts' dispatch
        order, the sequence split (sp, cp) and its exchange, and the dtype (the planner's caches
        add the fields each feature's terms read)."""
        return (
            self.tp,
            self.sp,
            self.cp,
            self.cp_comm_type,
            self.cp_a2a_size,
            self.document_masks,
            self.ep,
            self.moe_dispatch_order,
            self.precision,
            self.pp,
            self.vpp,
            self.chunk_layers(num_layers),
            self.layers_per_chunk,
            pp_rank,
            self.v_shape,
        )

    def describe(self) -> str:
        cp = [f"cp={self.cp}"] if self.cp > 1 else []
        if self.cp > 1 and self.cp_comm_type != "all_gather":
            cp.append(f"cp-{self.cp_comm_type}")
        if self.cp_comm_type == "a2a_ring":
            cp[-1] += f"/{self.cp_a2a_size}"
        parts = [f"tp={self.tp}", *cp, f"pp={self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.schedule != resolve_pipeline_schedule(None, self.vpp):
            parts.append(f"schedule={self.schedule}")
        parts.append(f"dp={self.dp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"zero={self.zero_stage}")
        if self.zero_replicas > 1:
            parts[-1] += f"/shard{self.zero_shard_size}"
        if self.compression_name is not None:
            parts.append(self.compression_name)
        if self.optimizer_offload:
            parts.append("offload")
        if self.sequence_parallel:
            parts.append("sp")
            if self.moe_dispatch_order == "ep_first":
                parts.append("ep-first")
        if self.recompute != "none":
            rc = self.recompute
            if rc == "full":
                rc += f"/{self.recompute_method}{self.recompute_num_layers}"
            parts.append(f"recompute={rc}")
        parts.append(f"mbs={self.micro_batch_size}")
        return " ".join(parts)

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)


def layout_from_config(cfg: TrainConfig, world_size: int) -> Layout:
    """The layout a validated config describes on ``world_size`` ranks."""
    p, t = cfg.parallel, cfg.trainer
    d = derive(cfg, world_size)
    schedule = getattr(p, "pipeline_schedule", None)
    if schedule == resolve_pipeline_schedule(None, p.vpp):
        schedule = None  # the default, as a layout without one
    return Layout(
        tp=p.tp,
        cp=p.cp,
        pp=p.pp,
        vpp=p.vpp,
        dp=d.dp,
        sp=bool(p.sp),
        zero_stage=p.zero_stage,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        recompute=t.recompute,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        layers_per_chunk=tuple(p.pipeline_layer_split or ()),
        bucket_size_mb=p.bucket_size_mb,
        zero3_keep_gathered=p.zero3_keep_gathered,
        precision=t.precision,
        grad_reduce_dtype=p.grad_reduce_dtype,
        ep=getattr(p, "ep", 1),
        device_type="cpu" if t.device == "cpu" else "cuda",  # auto: plan for the GPU
        pipeline_schedule=schedule,
        moe_dispatch_order=getattr(p, "moe_dispatch_order", "tp_first"),
        moe_shared_expert_overlap=getattr(p, "moe_shared_expert_overlap", True),
        cp_comm_type=getattr(p, "cp_comm_type", "all_gather"),
        cp_a2a_size=getattr(p, "cp_a2a_size", None) or 1,
        document_masks=bool(getattr(cfg.data, "reset_attention_mask", False)),
        zero_shard_size=_hybrid_shard(getattr(p, "zero_shard_size", None), d.dp),
        grad_compression=getattr(p, "grad_compression", None),
        powersgd_rank=getattr(p, "powersgd_rank", 4),
        powersgd_compress_vocab=bool(getattr(p, "powersgd_compress_vocab", False)),
        optimizer_offload=bool(getattr(p, "optimizer_offload", False)),
        fp8=getattr(t, "fp8", None),
        fp8_skip_first_last=getattr(t, "fp8_skip_first_last", 0),
    )


def _hybrid_shard(zero_shard_size: int | None, dp: int) -> int | None:
    """``parallel.zero_shard_size``, None when it shards over every dp rank (plain ZeRO)."""
    return None if zero_shard_size == dp else zero_shard_size


def spec_of(cfg: TrainConfig, vocab_size: int | None = None) -> ModelSpec:
    """The model shape of ``cfg`` (``vocab_size`` when the config leaves it to the tokenizer);
    with document masks, the attention span its data's documents give
    (:mod:`megatronish.plan.documents`)."""
    vocab = cfg.model.vocab_size or vocab_size or cfg.data.vocab_size
    spec = ModelSpec.from_config(cfg.model, vocab)
    return replace(spec, attended_keys=planned_attention_span(cfg))
