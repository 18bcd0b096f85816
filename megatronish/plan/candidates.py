"""Every parallel layout of a job on N ranks that the trainer accepts (pure, no processes).

A candidate varies tp, cp (and its exchange: K/V all-gather, all-to-all, ring, or all-to-all in
groups of each proper divisor of cp with a ring across them), pp, vpp, the pipeline
schedule, sp, ZeRO stage, recompute and micro batch size, and for a mixture-of-experts model ep
(divisors of dp x cp that divide the experts); dp follows from the world size; a pipeline runs
its vpp's default schedule (1F1B, interleaved 1F1B) or the zero-bubble one of its vpp
(:data:`ZERO_BUBBLE`). The model, the global batch, the
precision and the bucket size stay as configured. Whether a candidate is valid is decided by
:func:`megatronish.config.validate.config_errors` itself, on a copy of the config holding the
candidate's values, so the list holds exactly the layouts ``python -m megatronish.train`` would
start (the data section aside: the planner reads no data).

Two reductions keep the list free of duplicates: without data (or context) parallelism every
ZeRO stage is the same job, so only ZeRO 0 is listed; sequence parallelism needs tp > 1. Full
recompute is ``uniform`` with one layer per checkpointed group (Megatron's default granularity).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from types import SimpleNamespace

from omegaconf import OmegaConf

from megatronish.config.schema import TrainConfig
from megatronish.config.validate import config_errors
from megatronish.plan.layout import Layout
from megatronish.plan.recompute import POLICIES

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
RECOMPUTE = POLICIES
ZERO_STAGES = (0, 1, 2, 3)
# The zero-bubble schedule a pipeline of vpp chunks per stage may also run (pp > 1).
ZERO_BUBBLE = {1: "zb-h1", 2: "zbv"}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _namespace(node):
    if isinstance(node, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in node.items()})
    return node


def config_view(cfg: TrainConfig) -> SimpleNamespace:
    """A plain, mutable copy of a composed config that ``config_errors`` accepts (it skips the
    unknown-key check, which the composed config already passed)."""
    return _namespace(OmegaConf.to_container(cfg, resolve=True))


def _with_layout(view: SimpleNamespace, layout: Layout) -> SimpleNamespace:
    """``view`` with the layout's parallel and trainer values (dp derived, even layer split)."""
    p = SimpleNamespace(**vars(view.parallel))
    p.tp, p.pp, p.vpp, p.dp, p.sp = layout.tp, layout.pp, layout.vpp, None, layout.sp
    p.cp, p.ep = layout.cp, layout.ep
    p.zero_stage, p.pipeline_layer_split = layout.zero_stage, None
    p.pipeline_schedule = layout.pipeline_schedule
    p.moe_dispatch_order = layout.moe_dispatch_order
    p.cp_comm_type = layout.cp_comm_type
    p.cp_a2a_size = layout.cp_a2a_size if layout.cp_comm_type == "a2a_ring" else None
    p.zero_shard_size = layout.zero_shard_size
    p.grad_compression, p.powersgd_rank = layout.grad_compression, layout.powersgd_rank
    p.powersgd_compress_vocab = layout.powersgd_compress_vocab
    # the config's warm-up has no compression to delay
    if layout.grad_compression is None:
        p.grad_compression_start_step = 0
    p.optimizer_offload = layout.optimizer_offload
    t = SimpleNamespace(**vars(view.trainer))
    t.micro_batch_size, t.recompute = layout.micro_batch_size, layout.recompute
    t.recompute_method, t.recompute_num_layers = layout.recompute_method, 1
    out = SimpleNamespace(**vars(view))
    out.parallel, out.trainer = p, t
    return out


def layout_errors(
    view: SimpleNamespace, layout: Layout, vocab_size: int | None = None
) -> list[str]:
    """What ``config_errors`` says about the config ``view`` run in ``layout`` (the data
    section aside)."""
    return config_errors(_with_layout(view, layout), layout.world_size, vocab_size, data=False)


def expert_parallel_sizes(num_experts: int, dp_cp: int) -> list[int]:
    """The ep candidates: divisors of dp x cp that divide ``num_experts`` (1 when dense)."""
    return [e for e in divisors(dp_cp) if num_experts % e == 0] if num_experts else [1]


def schedules(pp: int, vpp: int) -> list[str | None]:
    """The pipeline schedules a candidate of ``pp`` stages and ``vpp`` chunks each may run:
    its default (None) and the zero-bubble one of its vpp, if any."""
    if pp == 1 or vpp not in ZERO_BUBBLE:
        return [None]
    return [None, ZERO_BUBBLE[vpp]]


def dispatch_orders(tp: int, sp: bool, num_experts: int) -> tuple[str, ...]:
    """The mixture-of-experts dispatch orders a candidate may use: both under tp > 1 with sp
    (the only case where they differ), else the default."""
    return ("tp_first", "ep_first") if num_experts and tp > 1 and sp else ("tp_first",)


def cp_comm_types(cp: int) -> list[tuple[str, int]]:
    """The context-parallel exchanges a candidate may use, with their ``cp_a2a_size`` (1 but
    for a2a_ring): every one under cp > 1, a2a_ring once per divisor of cp strictly between 1
    and cp (the rules drop head exchanges where the heads per tp rank do not divide, and the
    rings with attention dropout), else the default."""
    if cp == 1:
        return [("all_gather", 1)]
    groups = [("a2a_ring", k) for k in divisors(cp) if 1 < k < cp]
    return [("all_gather", 1), ("a2a", 1), ("ring", 1), *groups]


def node_shard_size(layout: Layout, gpus_per_node: int | None) -> int | None:
    """Hybrid sharding's candidate ``zero_shard_size``: the dp ranks of a dp x cp group inside
    one node of ``gpus_per_node`` (None when the group fits in a node, or nodes do not hold a
    whole number of its tp x cp blocks)."""
    if gpus_per_node is None or gpus_per_node % layout.stage_ranks:
        return None
    per_node = gpus_per_node // layout.stage_ranks
    return per_node if per_node < layout.dp and layout.dp % per_node == 0 else None


def dp_variants(layout: Layout, zero: int, gpus_per_node: int | None) -> list[dict]:
    """The ways ZeRO stage ``zero`` of ``layout`` may reduce across nodes, as layout changes:
    plainly; with hybrid sharding inside a node (:func:`node_shard_size`); and, where the dp x
    cp group spans nodes, compressed (PowerSGD at rank 4 for ZeRO 0/1, int8 for 1-3)."""
    out: list[dict] = [{}]
    if gpus_per_node is None or layout.tp * layout.dp_cp <= gpus_per_node:
        return out
    if zero > 0 and (shard := node_shard_size(layout, gpus_per_node)) is not None:
        out.append({"zero_shard_size": shard})
    if zero <= 1:
        out.append({"grad_compression": "powersgd", "powersgd_rank": 4})
    if zero >= 1:
        out.append({"grad_compression": "int8"})
    return out


def _shapes(
    base: Layout, world_size: int, num_layers: int, num_experts: int = 0
) -> Iterator[Layout]:
    """tp, cp, pp, vpp, schedule, sp, micro batch and ep combinations (ZeRO 0, no recompute)
    before validation: tp, cp and pp divide the world, vpp goes up to one layer per chunk."""
    sizes = sorted({*MICRO_BATCH_SIZES, base.micro_batch_size})
    for tp in divisors(world_size):
        for cp in divisors(world_size // tp):
            for pp in divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                for vpp in [1] if pp == 1 else range(1, num_layers // pp + 1):
                    for mbs in (b for b in sizes if b * dp <= base.global_batch_size):
                        for sp in (False, True) if tp > 1 else (False,):
                            for ep in expert_parallel_sizes(num_experts, dp * cp):
                                for schedule, order, (exchange, a2a) in itertools.product(
                                    schedules(pp, vpp),
                                    dispatch_orders(tp, sp, num_experts),
                                    cp_comm_types(cp),
                                ):
                                    yield base.with_(
                                        tp=tp,
                                        cp=cp,
                                        pp=pp,
                                        vpp=vpp,
                                        dp=dp,
                                        sp=sp,
                                        micro_batch_size=mbs,
                                        ep=ep,
                                        pipeline_schedule=schedule,
                                        moe_dispatch_order=order,
                                        cp_comm_type=exchange,
                                        cp_a2a_size=a2a,
                                    )


def valid_layouts(
    cfg: TrainConfig,
    world_size: int,
    vocab_size: int | None = None,
    gpus_per_node: int | None = None,
) -> list[Layout]:
    """Every layout of ``cfg``'s model and batch on ``world_size`` ranks that passes
    ``config_errors`` (``cfg`` is a composed config; its own parallel values are ignored).

    The rules run once per shape (tp, pp, vpp, schedule, sp, micro batch, ep): none of them
    depends on the ZeRO stage or the recompute policy, which take every value they allow.
    With ``gpus_per_node``, a ZeRO stage whose dp x cp group spans nodes is also a candidate
    with hybrid sharding inside each node and with gradient compression (:func:`dp_variants`).
    """
    from megatronish.plan.layout import layout_from_config

    view = config_view(cfg)
    base = layout_from_config(_base_config(cfg), 1).with_(
        zero_stage=0,
        recompute="none",
        recompute_method="uniform",
        recompute_num_layers=1,
        layers_per_chunk=(),
    )
    out = []
    experts = cfg.model.moe.num_experts if "moe" in cfg.model else 0
    for shape in _shapes(base, world_size, cfg.model.num_layers, experts):
        if layout_errors(view, shape, vocab_size):
            continue
        for zero in ZERO_STAGES if shape.dp_cp > 1 else (0,):
            for variant in dp_variants(shape, zero, gpus_per_node):
                for recompute in RECOMPUTE:
                    out.append(shape.with_(zero_stage=zero, recompute=recompute, **variant))
    return out


def _base_config(cfg: TrainConfig):
    """``cfg`` as a one-rank job (the layout fields the candidates replace)."""
    base = copy.deepcopy(cfg)
    base.parallel.tp = base.parallel.cp = base.parallel.pp = base.parallel.vpp = 1
    if "ep" in base.parallel:
        base.parallel.ep = 1
    base.parallel.dp = None
    base.parallel.sp = False
    base.parallel.pipeline_layer_split = None
    if "pipeline_schedule" in base.parallel:
        base.parallel.pipeline_schedule = None
    if "moe_dispatch_order" in base.parallel:
        base.parallel.moe_dispatch_order = "tp_first"
    if "cp_comm_type" in base.parallel:
        base.parallel.cp_comm_type = "all_gather"
    if "cp_a2a_size" in base.parallel:
        base.parallel.cp_a2a_size = None
    if "zero_shard_size" in base.parallel:
        base.parallel.zero_shard_size = None
    if "grad_compression" in base.parallel:
        base.parallel.grad_compression = None
    if "powersgd_compress_vocab" in base.parallel:
        base.parallel.powersgd_compress_vocab = False
    if "grad_compression_start_step" in base.parallel:
        base.parallel.grad_compression_start_step = 0
    if "optimizer_offload" in base.parallel:
        base.parallel.optimizer_offload = False
    return base


def base_errors(cfg: TrainConfig, vocab_size: int | None = None) -> list[str]:
    """Problems of ``cfg`` that no layout can fix (model shape, optimizer, ...): the rules
    checked on the one-rank job with micro batch 1 (the data section's aside)."""
    view = config_view(_base_config(cfg))
    view.trainer.micro_batch_size = 1
    return config_errors(view, 1, vocab_size, data=False)
