"""Dataclass schemas of the training config, registered in Hydra's ConfigStore.

The schemas make the composed config strict: an unknown key or a value of the wrong type is
rejected by Hydra/OmegaConf when the config is composed, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class RouterConfig:
    score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3): the router's scores per expert
    renormalize: bool = True  # the top-k scores rescaled to sum 1 (the experts' weights)
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch / Megatron); 0 disables
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE), e.g. 1e-3; 0 disables
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k
    # choice only, moved by this much each step towards the mean load (e.g. 1e-3); 0 keeps the
    # bias fixed (a checkpoint's), null: no bias
    bias_update_rate: float | None = None
    # Group-limited routing (DeepSeek-V3; Megatron's --moe-router-num-groups, --moe-router-group-
    # topk): each token's top-k from its max_groups best of num_groups contiguous expert groups
    num_groups: int | None = None  # expert groups (>= 1), e.g. the ep degree or nodes; null: none
    max_groups: int | None = None  # groups one token may use (device-limited routing)


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0: dense model
    top_k: int = 2  # experts each token is routed to
    layer_freq: int = 1  # block i is a mixture of experts when i % layer_freq == 0
    ffn_hidden_size: int | None = None  # of one expert; null: model.ffn_hidden_size
    shared_experts: int = 0  # always-on experts (one MLP of shared_experts * ffn_hidden_size)
    capacity_factor: float | None = None  # null: dropless; else tokens over capacity dropped
    router: RouterConfig = field(default_factory=RouterConfig)


@dataclass
class ModelConfig:
    arch: str = "llama"  # llama | gpt2
    num_layers: int = 4  # transformer blocks
    hidden_size: int = 256  # the model width h
    num_attention_heads: int = 4  # query heads
    num_query_groups: int | None = None  # kv heads (GQA); null = num_attention_heads
    head_dim: int | None = None  # width of one attention head; null = hidden_size / heads
    # RMSNorm (gpt2: LayerNorm) of each query and key head before RoPE (Qwen3, OLMo 2 style;
    # Megatron-LM's --qk-layernorm)
    qk_norm: bool = False
    ffn_hidden_size: int | None = None  # null: llama 8h/3 rounded up to 64, gpt2 4h
    seq_length: int = 256  # tokens per sample: the context length
    vocab_size: int | None = None  # null: taken from the tokenizer
    make_vocab_size_divisible_by: int = 128  # embedding and head rows padded to this
    max_position_embeddings: int | None = None  # gpt2 learned positions; null = seq_length
    norm_eps: float = 1e-5  # epsilon of RMSNorm (llama) or LayerNorm (gpt2)
    rope_theta: float = 10000.0  # base of the rotary position embedding (llama)
    hidden_dropout: float = 0.0  # dropout on the embeddings and each block's outputs
    attention_dropout: float = 0.0  # dropout on the attention probabilities
    init_std: float = 0.02  # normal init std; output projections / sqrt(2 * num_layers)
    bias: bool | None = None  # null: gpt2 has biases, llama does not
    tie_embeddings: bool | None = None  # null: gpt2 ties, llama does not
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel: each layer's matmuls split over tp ranks
    cp: int = 1  # context parallel: each sequence split over cp ranks (2 chunks each)
    # all_gather: K/V gathered over cp for the local queries | a2a: heads exchanged for
    # sequence by all-to-all (DeepSpeed-Ulysses; heads per tp rank divisible by cp) | ring:
    # K/V blocks passed around the cp ring, overlapped with attention (no attention dropout) |
    # a2a_ring: a2a inside groups of cp_a2a_size consecutive cp ranks, ring across the groups
    cp_comm_type: str = "all_gather"
    # a2a_ring only: cp ranks per all-to-all group (divides cp, 1 < size < cp; a node's share)
    cp_a2a_size: int | None = None
    pp: int = 1  # pipeline parallel: the layers split over pp stages
    vpp: int = 1  # virtual pipeline: model chunks per pp stage (interleaved 1F1B)
    # 1f1b | interleaved | zb-h1 | zbv; null: 1f1b for vpp=1, interleaved above. zb-h1 (vpp=1)
    # and zbv (vpp=2, chunks in a V) split each backward into B and W to fill the bubble
    pipeline_schedule: str | None = None
    ep: int = 1  # expert parallel: experts split over ep ranks carved out of dp x cp
    # tp_first | ep_first: with tp > 1, gather the tokens over tp then exchange them over ep, or
    # (Megatron-LM's order) exchange each tp rank's own tokens, then gather the rows over tp
    moe_dispatch_order: str = "tp_first"
    # run the shared experts' forward while the tokens travel to the experts (their all-to-all
    # posted first, waited after; Megatron-LM's --moe-shared-expert-overlap)
    moe_shared_expert_overlap: bool = True
    dp: int | None = None  # null: world_size / (tp * cp * pp)
    sp: bool = False  # sequence parallel: norms and dropout on sequence shards over tp
    zero_stage: int = 0  # ZeRO: 1 shards optimizer states over dp, 2 also grads, 3 also params
    # hybrid sharding (HSDP): ZeRO shards over groups of this many consecutive dp ranks (a node)
    # and the groups replicate each other (grads all-reduced across them); null: all dp ranks
    zero_shard_size: int | None = None
    # null | powersgd (low-rank, error feedback; ZeRO 0/1) | int8 (blockwise quantized
    # reduce-scatter, error feedback; ZeRO 1-3): compress the dp grad reduction (slow links)
    grad_compression: str | None = None
    # grad_compression=powersgd: the rank of each compressed matrix (an n x m grad is compressed
    # where 2 (n + m) rank < n m; a rank no matrix of the model allows is refused)
    powersgd_rank: int = 4
    # steps whose grads are reduced uncompressed before grad_compression starts (a warm-up, as
    # torch's start_powerSGD_iter: early grads change fast and lose most to compression)
    grad_compression_start_step: int = 0
    # grad_compression=powersgd: also compress the word embedding and output layer, whose grads
    # are far from low rank (false: they are all-reduced as they are)
    powersgd_compress_vocab: bool = False
    # fp32 main params, Adam moments and the update of this rank's shard on the host (pinned);
    # grads stream down per bucket, updated params up (ZeRO-Offload)
    optimizer_offload: bool = False
    bucket_size_mb: float = 25.0  # MiB of fp32 grads per dp reduction bucket
    zero3_keep_gathered: bool = False  # zero 3: keep params gathered until the step ends
    overlap_param_gather: bool = True  # zero 1/2: updated params gathered during the next forward
    pipeline_layer_split: list[int] | None = None  # layers per chunk; null = even split
    collective_timeout_s: float = 600.0  # bounds start-up and every collective and p2p op
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of the dp grad reduction (bf16 runs)


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (built-in offline corpus) | indexed (use prefix)
    prefix: str | None = None  # .bin/.idx prefix when source=indexed
    # [[weight, prefix], ...]: a weighted blend of indexed datasets (replaces prefix)
    blend: list[Any] | None = None
    blend_valid: list[Any] | None = None  # validation blend; null: the blend's valid splits
    prefetch: bool = True  # read the next step's batches on a background thread
    # sentencepiece .model, HF tokenizer.json or a directory holding one; required when indexed
    tokenizer_model: str | None = None
    cache_dir: str = "~/.cache/megatronish"  # the stdlib corpus, tokenizer, blend indexes
    # the tokenizer the built-in corpus trains; data=indexed: the vocabulary dry runs and the
    # planner assume until data.tokenizer_model gives the real one
    vocab_size: int = 4096
    max_corpus_mb: float = 8.0  # text of the stdlib corpus at most
    valid_fraction: float = 0.02  # of the documents, held out for validation
    # Packed documents (Megatron-LM's semantics, docs/data.md); off: attention and positions
    # run across the documents of a window, as before.
    reset_attention_mask: bool = False  # tokens attend only to their own document
    reset_position_ids: bool = False  # positions (RoPE, learned) restart at each document
    eod_mask_loss: bool = False  # no loss where the input is a document's last token (EOD)
    # what ends a document: eod (the tokenizer's end-of-document id) or a token id (below the
    # vocabulary size)
    document_boundaries: str = "eod"


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw (the only one)
    lr: float = 1e-3  # peak learning rate, reached after the warmup
    weight_decay: float = 0.1  # decoupled (AdamW); not on norms and biases
    beta1: float = 0.9  # decay of Adam's first moment
    beta2: float = 0.95  # decay of Adam's second moment
    eps: float = 1e-8  # added to Adam's denominator
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class SchedulerConfig:
    style: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 20  # linear warmup from optimizer.lr / warmup_steps to optimizer.lr
    decay_steps: int | None = None  # null: trainer.max_steps
    min_lr: float = 1e-4  # learning rate at the end of the decay


@dataclass
class ProfileConfig:
    steps: list[int] | None = None  # [first, last]: torch.profiler trace of these steps
    dir: str = "${out_dir}/profile"  # one Chrome trace per rank: rank00000.json, ...


@dataclass
class TrainerConfig:
    micro_batch_size: int = 8  # samples per microbatch on each dp rank
    global_batch_size: int = 8  # samples per step over all dp ranks
    max_steps: int = 100  # optimizer steps of the whole run (resumes included)
    seed: int = 1234  # seeds the init, the data order and dropout
    precision: str = "fp32"  # fp32 | bf16 (bf16 params and activations, fp32 main params/grads)
    tf32: bool = True  # CUDA: fp32 matmuls and convolutions may use TF32 tensor cores
    deterministic: bool = False  # torch's deterministic kernels: bit-identical GPU resume, slower
    recompute: str = "none"  # none | selective | full
    # torch.compile each transformer block's forward (whole where dynamo captures it; with tp,
    # cp or ep > 1 in pieces between the collectives, said once in the log)
    compile: bool = False
    compile_backend: str = "inductor"  # inductor | aot_eager (captured graphs, eager kernels)
    # null: torch's cache (TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_<user>); else a
    # directory this user can write (created when missing; checked at start-up): one on a
    # shared filesystem lets a resumed run on other nodes skip compiling again
    compile_cache_dir: str | None = None
    # null | tensorwise | rowwise (torchao's recipes): the blocks' linear layers run their GEMMs
    # in float8 with current scaling (tensorwise: one exact scale per tensor, e4m3 activations
    # and weights, e5m2 output grads; rowwise: per row / column, all e4m3, power-of-two scales;
    # the experts' grouped GEMMs as rowwise); needs precision=bf16
    fp8: str | None = None
    fp8_skip_first_last: int = 0  # trainer.fp8: this many first and last blocks stay in bf16
    recompute_method: str = "uniform"  # uniform | block
    recompute_num_layers: int = 1  # layers per group (uniform) or per chunk (block)
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None  # CPU intra-op threads per rank; null: cores / local ranks
    eval_interval: int = 50  # steps between validations (and after the last); 0: none
    eval_iters: int = 4  # global batches per validation
    dry_run: bool = False  # print the resolved config and derived values, then exit
    exit_after_minutes: float | None = None  # save and exit 4 after this much wall-clock time
    # signals that save and exit 4 at the next step boundary ([] keeps the default actions);
    # a second SIGINT (Ctrl-C) aborts at once
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR2", "SIGINT"])
    peak_tflops: float | None = None  # per device, for MFU; null: measured (CPU) or table (GPU)
    check_memory: bool = True  # stop at start-up when the planned peak exceeds the device
    max_skipped_steps: int = 5  # stop after this many non-finite steps in a row; 0: never
    profile: ProfileConfig = field(default_factory=ProfileConfig)


# Model keys that change what a checkpoint's tensors compute without changing which tensors
# there are (bias and tie_embeddings do change them).
FUNCTION_KEYS = (
    "rope_theta",
    "norm_eps",
    "vocab_size",
    "moe.top_k",
    "moe.router.renormalize",
    "moe.router.score",
    "moe.router.num_groups",
    "moe.router.max_groups",
)


@dataclass
class CheckpointConfig:
    dir: str | None = "${out_dir}/checkpoints"  # null: no checkpoints
    interval: int = 1000  # steps between saves (and one at the end); 0: only at the end
    resume: str = "auto"  # auto | never | PATH
    keep_last: int | None = 2  # the newest N published steps; null keeps every step
    async_save: bool = False  # write from host copies in the background
    save_final: bool = True  # save after the last step
    fallback: bool = True  # resume=auto: skip a damaged step for the newest older one that loads
    verify: bool = True  # check the CRC32 of every shard read on load
    # FUNCTION_KEYS that may differ from the checkpoint's on load, e.g. [rope_theta] to extend
    # the context, [vocab_size] to use padding rows as new tokens
    allow_model_changes: list[str] = field(default_factory=list)
    # keys (or sections, e.g. optimizer) a resume=auto may change besides the ones that never
    # change the run (layout, logging, checkpointing, trainer.max_steps, ...): docs/operations.md
    allow_changes: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    log_interval: int = 10  # steps between progress lines
    wandb: bool = True  # log to Weights & Biases (WANDB_MODE=disabled also stops it)
    wandb_project: str = "megatronish"  # the Weights & Biases project
    wandb_mode: str | None = None  # null: online with WANDB_API_KEY set, else offline
    timers: str = "cheap"  # cheap | detailed
    progress_bar: bool = False  # a tqdm bar of the steps on the logging rank's terminal
    log_file: str | None = "${out_dir}/train.log"  # the console lines, timestamped; null: none


@dataclass
class TrainConfig:
    name: str = "run"  # names out_dir, the wandb run and the run id
    out_dir: str = "outputs/${name}"  # config.yaml, logs and checkpoints of the run
    world_size: int | None = None  # dry runs and the planner: the ranks to plan for
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


def register_configs() -> None:
    """Register the schemas so train.yaml and every group file are checked against them."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=schema)


__all__ = ["TrainConfig", "register_configs", *[s.__name__ for s in GROUP_SCHEMAS.values()]]
