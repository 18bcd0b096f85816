"""Config schema and cross-field validation: every rule, reported all at once."""

import os

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from megatronish.config.compose import load_config
from megatronish.config.derived import derive, pad_vocab
from megatronish.config.dp_rules import POWERSGD_MIN_RATE, largest_powersgd_rank, powersgd_matrices
from megatronish.config.validate import ConfigError, check_config, config_errors, vocab_errors
from megatronish.config.value_rules import config_notes
from megatronish.data_parallel.powersgd import MIN_COMPRESSION_RATE, compressible
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.rank_model import meta_chunks
from megatronish.tensor_parallel.sharding import param_info
from megatronish.testing import runs


def errors_for(overrides, world=1, vocab=None):
    return config_errors(load_config(overrides), world, vocab_size=vocab)


GPU_EXPERIMENTS = ["gpt_125m", "gpt_1b", "gpt_7b", "gpt_1b_32k", "moe_1b_7b"]


def test_default_and_every_experiment_are_valid():
    assert errors_for([]) == []
    assert errors_for(["+experiment=tiny"]) == []
    for name in GPU_EXPERIMENTS:  # their data is the user's: a dry run does not need it
        cfg = load_config([f"+experiment={name}"])
        assert config_errors(cfg, 8, data=False) == [], name


@pytest.mark.parametrize("name", GPU_EXPERIMENTS)
def test_gpu_experiments_need_a_corpus_and_save_during_training(name):
    cfg = load_config([f"+experiment={name}"])
    errors = config_errors(cfg, 8)
    assert len(errors) == 2, errors
    assert "needs data.prefix" in errors[0] and "tools/preprocess_data.py" in errors[0]
    assert "data.tokenizer_model" in errors[1]
    assert cfg.data.vocab_size == 32000  # what dry runs and the planner assume
    assert 0 < cfg.checkpoint.interval < cfg.trainer.max_steps


@pytest.mark.slow
def test_only_gpu_experiments_train_on_a_corpus_of_their_own():
    import os

    from megatronish.config.compose import CONFIG_DIR

    names = {f[:-5] for f in os.listdir(os.path.join(CONFIG_DIR, "experiment"))}
    indexed = {n for n in names if load_config([f"+experiment={n}"]).data.source == "indexed"}
    assert indexed == set(GPU_EXPERIMENTS)


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["parallel.tp=2"], 3, "not divisible by tp*pp"),
        (["parallel.tp=2", "parallel.dp=2"], 2, "tp*pp*dp"),
        (["parallel.cp=2"], 3, "not divisible by tp*cp*pp = 1*2*1"),
        (["parallel.cp=2", "parallel.dp=2"], 2, "tp*cp*pp*dp = 1*2*1*2 = 4"),
        (["parallel.cp=3", "model.seq_length=256"], 3, "not divisible by 2*cp = 6"),
        (
            [
                "parallel.cp=2",
                "parallel.tp=4",
                "parallel.sp=true",
                "model.seq_length=12",
                "model.num_query_groups=4",
            ],
            8,
            "seq_length/cp = 6 is not divisible by parallel.tp=4",
        ),
        (["parallel.cp=0"], 1, "parallel.cp=0"),
        (["parallel.zero_stage=4"], 1, "zero_stage=4"),
        (["parallel.vpp=2"], 1, "vpp=2 needs parallel.pp > 1"),
        (["parallel.pipeline_schedule=zb-h1"], 1, "zb-h1 needs parallel.pp > 1"),
        (["parallel.pipeline_schedule=gpipe"], 1, "'gpipe' is not one of 1f1b, interleaved"),
        (["parallel.pp=2", "parallel.pipeline_schedule=zbv"], 2, "set parallel.vpp=2, not 1"),
        (
            ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_schedule=zb-h1"],
            2,
            "zb-h1 runs one chunk per stage, not vpp=2",
        ),
        (
            ["parallel.pp=2", "parallel.pipeline_schedule=interleaved"],
            2,
            "interleaved needs parallel.vpp > 1",
        ),
        (["model.hidden_size=130"], 1, "hidden_size=130 is not divisible"),
        (["model.hidden_size=132", "model.num_attention_heads=4"], 1, "must be even"),
        (["model.hidden_size=130", "model.head_dim=33"], 1, "head dim 33 must be even"),
        (["model.head_dim=0"], 1, "model.head_dim=0 must be >= 1"),
        (
            ["parallel.cp=4", "parallel.cp_comm_type=a2a"],
            4,
            "the 4 query and 2 kv heads per tp rank must be divisible by parallel.cp=4",
        ),
        (["parallel.cp_comm_type=p2p"], 1, "parallel.cp_comm_type='p2p' is not one of"),
        (
            ["parallel.cp=4", "parallel.cp_comm_type=a2a_ring"],
            4,
            "a2a_ring needs parallel.cp_a2a_size, the cp ranks of each all-to-all group, to "
            "divide parallel.cp=4 strictly between 1 and cp (it is None)",
        ),
        (
            ["parallel.cp=4", "parallel.cp_comm_type=a2a_ring", "parallel.cp_a2a_size=4"],
            4,
            "(it is 4); size 1 is cp_comm_type=ring, size cp is a2a",
        ),
        (
            ["parallel.cp=2", "parallel.cp_comm_type=ring", "parallel.cp_a2a_size=2"],
            2,
            "parallel.cp_a2a_size=2 sizes the all-to-all groups of cp_comm_type=a2a_ring, not "
            "of cp_comm_type=ring",
        ),
        (
            ["parallel.cp=4", "parallel.cp_comm_type=a2a_ring", "parallel.cp_a2a_size=2"]
            + ["model.num_query_groups=1"],
            4,
            "the 4 query and 1 kv heads per tp rank must be divisible by parallel.cp_a2a_size=2",
        ),
        (
            ["parallel.cp=4", "parallel.cp_comm_type=a2a_ring", "parallel.cp_a2a_size=2"]
            + ["model.attention_dropout=0.1"],
            4,
            "cp_comm_type=a2a_ring runs no attention dropout",
        ),
        (
            ["parallel.cp=2", "parallel.cp_comm_type=ring", "model.attention_dropout=0.1"],
            2,
            "cp_comm_type=ring runs no attention dropout: set model.attention_dropout=0",
        ),
        (
            ["parallel.zero_shard_size=2"],
            4,
            "parallel.zero_shard_size=2 sizes the groups ZeRO shards over, but "
            "parallel.zero_stage=0 shards nothing",
        ),
        (
            ["parallel.zero_stage=1", "parallel.zero_shard_size=4"],
            6,
            "parallel.zero_shard_size=4 must divide the data-parallel size dp=6 (shard groups of "
            "consecutive dp ranks, replicated across): use one of 1, 2, 3, 6",
        ),
        (["parallel.zero_stage=1", "parallel.zero_shard_size=0"], 2, "zero_shard_size=0 must be"),
        (["parallel.grad_compression=topk"], 2, "parallel.grad_compression='topk' is not one of"),
        (
            ["parallel.grad_compression=int8", "parallel.zero_stage=1"],
            1,
            "parallel.grad_compression=int8 compresses the data-parallel reduction, and dp x cp "
            "= 1 has none: set it to null",
        ),
        (
            ["parallel.grad_compression=powersgd", "parallel.zero_stage=2"],
            2,
            "compresses the all-reduce of ZeRO 0 and 1, not parallel.zero_stage=2's "
            "reduce-scatter of every microbatch: use zero_stage 0 or 1, or grad_compression=int8",
        ),
        (
            ["parallel.grad_compression=int8"],
            2,
            "parallel.grad_compression=int8 quantizes ZeRO's reduce-scatter, and "
            "parallel.zero_stage=0 all-reduces",
        ),
        (
            [
                "parallel.grad_compression=int8",
                "parallel.zero_stage=3",
                "parallel.zero_shard_size=2",
            ],
            4,
            "with parallel.zero_shard_size the link between nodes carries only the shards' "
            "all-reduce, which it does not compress: use one of them",
        ),
        (
            ["parallel.grad_compression=powersgd", "trainer.precision=bf16"]
            + ["parallel.grad_reduce_dtype=bf16"],
            2,
            "sends its own compressed format: set parallel.grad_reduce_dtype=fp32",
        ),
        (["parallel.grad_compression=powersgd", "parallel.powersgd_rank=0"], 2, "powersgd_rank=0"),
        (
            ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=55"],
            2,
            "parallel.powersgd_rank=55 compresses none of this model's matrices",
        ),
        (
            ["parallel.powersgd_compress_vocab=true"],
            2,
            "parallel.powersgd_compress_vocab=true chooses the matrices PowerSGD compresses, "
            "and parallel.grad_compression=null is not powersgd",
        ),
        (
            ["parallel.zero_stage=1", "parallel.grad_compression=int8"]
            + ["parallel.powersgd_compress_vocab=true"],
            2,
            "parallel.grad_compression=int8 is not powersgd",
        ),
        (
            ["parallel.cp_comm_type=a2a_ring", "parallel.cp_a2a_size=2"],
            1,
            "parallel.cp=1 has none to group (context parallelism is off): set cp_a2a_size to null",
        ),
        (
            ["model.moe.num_experts=4", "model.moe.router.num_groups=0"]
            + ["model.moe.router.max_groups=1"],
            1,
            "model.moe.router.num_groups=0 must be >= 1",
        ),
        (
            ["parallel.grad_compression_start_step=100"],
            2,
            "parallel.grad_compression_start_step=100 delays a compression that is not set",
        ),
        (
            ["parallel.grad_compression=int8", "parallel.zero_stage=1"]
            + ["parallel.grad_compression_start_step=-1"],
            2,
            "parallel.grad_compression_start_step=-1 must be >= 0",
        ),
        (["parallel.tp=8"], 8, "num_attention_heads=4 is not divisible by parallel.tp=8"),
        (["model.num_query_groups=3"], 1, "must divide model.num_attention_heads"),
        (
            ["parallel.tp=2", "model.num_attention_heads=6", "model.num_query_groups=3"]
            + ["model.head_dim=16"],
            2,
            "num_query_groups=3 (kv heads) and parallel.tp=2: one must divide the other",
        ),
        (["parallel.tp=2", "model.ffn_hidden_size=353"], 2, "ffn hidden size 353"),
        (["parallel.tp=2", "parallel.sp=true", "model.seq_length=255"], 2, "sequence parallelism"),
        (["model.num_layers=5", "parallel.pp=2"], 2, "num_layers=5 is not divisible by pp*vpp"),
        (["parallel.pp=2", "parallel.pipeline_layer_split=[1,2]"], 2, "pipeline_layer_split"),
        (["trainer.global_batch_size=12"], 1, "global_batch_size=12 is not divisible"),
        (["parallel.pp=4", "trainer.global_batch_size=16"], 4, "fewer than parallel.pp=4"),
        (
            ["parallel.pp=2", "parallel.vpp=2", "trainer.global_batch_size=24"],
            2,
            "divisible by parallel.pp=2",
        ),
        (["model.arch=gpt3"], 1, "model.arch='gpt3'"),
        (["trainer.precision=fp16"], 1, "trainer.precision"),
        (["trainer.recompute=some"], 1, "trainer.recompute"),
        (["model.num_layers=0"], 1, "model.num_layers=0 must be >= 1"),
        (["trainer.micro_batch_size=-1"], 1, "micro_batch_size=-1"),
        (["model.hidden_dropout=1.5"], 1, "hidden_dropout=1.5"),
        (["optimizer.lr=0"], 1, "optimizer.lr=0"),
        (["scheduler.min_lr=1"], 1, "scheduler.min_lr=1"),
        (
            ["scheduler.warmup_steps=1000", "scheduler.decay_steps=100"],
            1,
            "warmup_steps=1000 exceeds",
        ),
        (["model.arch=gpt2", "model.max_position_embeddings=128"], 1, "exceeds model.max_position"),
        (["data=indexed"], 1, "needs data.prefix"),
        (
            ["data.source=indexed", "data.prefix=/nope", "data.tokenizer_model=/nope.model"],
            1,
            "does not exist",
        ),
        (["data.valid_fraction=0"], 1, "valid_fraction=0"),
        (
            ["model.vocab_size=999", "model.make_vocab_size_divisible_by=3", "parallel.tp=2"],
            2,
            "padded vocab",
        ),
    ],
)
def test_each_rule_names_the_values(overrides, world, needle):
    errors = errors_for(overrides, world)
    assert any(needle in e for e in errors), errors


def test_tokenizer_larger_than_model_vocab_is_reported():
    errors = errors_for(["model.vocab_size=1000"], vocab=4096)
    assert any("tokenizer has 4096 tokens" in e for e in errors)


def test_all_violations_are_reported_at_once():
    cfg = load_config(["parallel.tp=3", "model.num_layers=5", "parallel.pp=2"])
    with pytest.raises(ConfigError) as info:
        check_config(cfg, 5)
    assert len(info.value.errors) >= 3
    assert "invalid config" in str(info.value)


def test_schema_rejects_unknown_keys_and_wrong_types():
    with pytest.raises(ConfigCompositionException):
        load_config(["model.not_a_key=1"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        load_config(["model.num_layers=four"])
    with pytest.raises(ConfigCompositionException):
        load_config(["+experiment=does_not_exist"])


def test_derived_values():
    cfg = load_config(["parallel.tp=2", "trainer.global_batch_size=32"])
    d = derive(cfg, 8)
    assert d.dp == 4 and d.num_microbatches == 1 and d.tokens_per_step == 32 * 256
    assert d.layers_per_chunk == (4,)
    assert pad_vocab(4097, 128) == 4224 and pad_vocab(4096, 128) == 4096
    gpt2 = derive(load_config(["+experiment=tiny_gpt2"]), 1)
    assert gpt2.tie_embeddings and gpt2.bias and gpt2.ffn_hidden_size == 512


def test_head_dim_frees_the_width_from_hidden_over_heads():
    """Qwen3-30B-A3B's shape: 32 heads of 128 in a width of 2048 (and a width heads do not
    divide)."""
    assert not errors_for(["model.hidden_size=130", "model.head_dim=32"], 1)
    cfg = load_config(["model.hidden_size=130", "model.head_dim=32"])
    assert derive(cfg, 1).head_dim == 32


def test_document_boundaries_must_be_an_id_of_the_vocabulary():
    packed = ["data.reset_attention_mask=true"]
    assert not errors_for([*packed, "data.document_boundaries=4095"])  # the corpus's last id
    errors = errors_for([*packed, "data.document_boundaries=4096"])
    assert len(errors) == 1, errors
    assert "vocabulary of 4096 tokens (data.vocab_size, the tokenizer the built-in" in errors[0]
    errors = errors_for([*packed, "model.vocab_size=1000", "data.document_boundaries=1000"])
    assert len(errors) == 1, errors
    assert "vocabulary of 1000 tokens (model.vocab_size; ids 0 to 999)" in errors[0]
    # Indexed data: its tokenizer's size is known once it is loaded (the build checks it then).
    indexed = load_config(["data=indexed", *packed, "data.document_boundaries=40000"])
    assert not config_errors(indexed, 1, data=False)
    errors = vocab_errors(indexed, 32000)
    assert len(errors) == 1, errors
    assert errors[0].startswith("data.document_boundaries=40000 is not an id of the vocabulary")
    assert "32000 tokens (the tokenizer's; ids 0 to 31999)" in errors[0]
    assert not vocab_errors(indexed, 50000)


def test_router_values_are_checked_on_a_dense_model_too():
    dense = [
        (["model.moe.router.score=tanh"], "model.moe.router.score=tanh is not one of"),
        (["model.moe.router.z_loss_coef=-1"], "model.moe.router.z_loss_coef=-1.0 must be >= 0"),
        (["model.moe.router.bias_update_rate=-1"], "bias_update_rate=-1.0 must be >= 0"),
        (["model.moe.router.num_groups=2"], "num_groups and max_groups go together"),
        (
            ["model.moe.router.num_groups=2", "model.moe.router.max_groups=3"],
            "model.moe.router.max_groups=3 must be in [1, num_groups=2]",
        ),
        (
            ["model.moe.router.num_groups=0", "model.moe.router.max_groups=1"],
            "model.moe.router.num_groups=0 must be >= 1 (the expert groups",
        ),
    ]
    for overrides, needle in dense:
        assert [needle in e for e in errors_for(overrides)] == [True], overrides
    # What depends on the experts is not asked of a model without them (noted instead).
    groups = ["model.moe.router.num_groups=3", "model.moe.router.max_groups=3"]
    assert errors_for(groups) == []
    assert config_notes(load_config(groups)) == [
        "model.moe.router.num_groups=3, model.moe.router.max_groups=3 have no effect on a dense "
        "model (model.moe.num_experts=0: no block routes tokens to experts)"
    ]
    assert (
        "must divide model.moe.num_experts=4" in errors_for(["model.moe.num_experts=4", *groups])[0]
    )


def test_offload_is_noted_on_a_cpu_run_only_where_the_device_is_known():
    offload = load_config(["parallel.optimizer_offload=true"])  # trainer.device=auto
    assert config_notes(offload) == config_notes(offload, cuda_available=True) == []
    notes = config_notes(offload, cuda_available=False)
    assert notes == [
        "parallel.optimizer_offload=true moves nothing on the CPU (trainer.device=auto): the "
        "optimizer's state already is in host memory"
    ]


def test_the_compile_cache_dir_is_tried_where_the_run_writes_it(tmp_path):
    """Only the trainer's check looks at the path (dry runs and the planner may run on another
    machine); a path nobody can write is in sysfs for root, whom the mode bits do not stop."""
    afile = tmp_path / "afile"
    afile.write_text("")
    unwritable = tmp_path / "ro"
    unwritable.mkdir(mode=0o555)
    if os.geteuid() == 0:
        unwritable = "/sys/megatronish-compile-cache"
    cases = [
        (afile, f"trainer.compile_cache_dir={afile} is a file, not a directory: give a directory"),
        (afile / "x", f"trainer.compile_cache_dir={afile}/x is inside the file {afile}: give"),
        (f"{unwritable}/x", f"trainer.compile_cache_dir={unwritable}/x cannot be written ("),
    ]
    for path, needle in cases:
        cfg = load_config(["trainer.compile=true", f"trainer.compile_cache_dir={path}"])
        errors = config_errors(cfg, 1)
        assert [needle in e for e in errors] == [True], errors
        assert config_errors(cfg, 1, data=False) == []
        cfg.trainer.compile = False  # nothing is compiled: nothing is written there
        assert config_errors(cfg, 1) == []
    fresh = load_config(["trainer.compile=true", f"trainer.compile_cache_dir={tmp_path}/new/c"])
    assert config_errors(fresh, 1) == [] and not (tmp_path / "new").exists()


POWERSGD_LAYOUTS = [
    ([], 1),
    (["parallel.tp=2"], 2),
    (["parallel.tp=2", "model.num_query_groups=1"], 2),  # kv heads replicated over tp
    (["model.arch=gpt2"], 1),  # learned positions, tied head
    (["model.arch=gpt2", "parallel.pp=2"], 2),
    (["parallel.powersgd_compress_vocab=true"], 1),
    (["parallel.tp=2", "parallel.powersgd_compress_vocab=true"], 2),
    (
        ["model.hidden_size=16", "model.num_attention_heads=2", "model.num_query_groups=2"]
        + ["model.ffn_hidden_size=16"],
        1,
    ),
    (
        ["model.moe.num_experts=8", "model.moe.shared_experts=1", "model.moe.layer_freq=2"]
        + ["parallel.ep=2", "model.moe.ffn_hidden_size=512"],
        2,
    ),
    (
        ["model.moe.num_experts=4", "parallel.tp=2", "parallel.sp=true"]
        + ["model.moe.ffn_hidden_size=1024"],
        2,
    ),
]


@pytest.mark.parametrize(
    "overrides, world", POWERSGD_LAYOUTS, ids=[" ".join(o) for o, _ in POWERSGD_LAYOUTS]
)
def test_the_powersgd_rank_rule_knows_the_matrices_the_trainer_compresses(overrides, world):
    """The rule's most compressible matrix is the built model's: the largest rank at which
    PowerSGD (its own choice of matrices) compresses any weight of any pipeline rank."""
    assert POWERSGD_MIN_RATE == MIN_COMPRESSION_RATE
    cfg = runs.test_config(overrides, 1)
    vocab = cfg.parallel.powersgd_compress_vocab
    layout = layout_from_config(cfg, world)
    built = 0
    for pp_rank in range(layout.pp):
        for chunk in meta_chunks(spec_of(cfg), layout, pp_rank):
            for p in chunk.parameters():
                if param_info(p).vocab and not vocab:
                    continue
                rank = 0
                while compressible(p.shape, rank + 1) is not None:
                    rank += 1
                built = max(built, rank)
    rule = max(largest_powersgd_rank(n, m) for n, m in powersgd_matrices(cfg).values())
    assert rule == built
    powersgd = [*overrides, "parallel.grad_compression=powersgd"]
    too_high = runs.test_config([*powersgd, f"parallel.powersgd_rank={built + 1}"], 1)
    assert [e for e in config_errors(too_high, 2 * world, data=False) if "powersgd_rank" in e]
    fits = runs.test_config([*powersgd, f"parallel.powersgd_rank={max(built, 1)}"], 1)
    assert not [e for e in config_errors(fits, 2 * world, data=False) if "powersgd_rank" in e]
