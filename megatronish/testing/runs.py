"""Short training runs for parity tests: any layout, synthetic data, results per rank."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from megatronish.config.derived import derive
from megatronish.config.schema import TrainConfig
from megatronish.config.validate import ConfigError, config_errors
from megatronish.data.documents import OPTIONS as PACKING_OPTIONS
from megatronish.distributed.topology import Topology
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.testing.shared_configs import composed
from megatronish.testing.synthetic import PackedPatternTokens, PatternTokens

SYNTHETIC_EOD = 2  # the end-of-document id of the synthetic packed documents

# A model small enough for many multi-rank runs on 2 cores, with every divisibility tp=4 needs.
TINY_TEST_MODEL = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=16",
    "model.vocab_size=250",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
    "trainer.eval_interval=0",
    "logging.log_interval=1000",
    "logging.wandb=false",
    "scheduler.warmup_steps=2",
    "optimizer.lr=3e-3",
    "optimizer.grad_clip=1.0",
    "trainer.device=cpu",
]


# Steps of a parity run: the LR warm-up (2 steps), four steps of decay, Adam past its first
# moments and clipping; a layout that differs from one process shows it from the first step.
PARITY_STEPS = 6
# Every packed-document option on (each token attends within its document, positions restart,
# the loss skips the tokens whose target starts the next document).
PACKED_DOCUMENTS = tuple(f"data.{option}=true" for option in PACKING_OPTIONS)

# A real run of the entry point small enough for many subprocess and multi-rank tests: the
# built-in corpus cut to 0.5 MB with a 512-piece tokenizer (built once per cache directory).
SMALL_STDLIB_RUN = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
    "trainer.eval_interval=0",
    "logging.log_interval=1",
    "scheduler.warmup_steps=1",
    "data.max_corpus_mb=0.5",
    "data.vocab_size=512",
    "trainer.device=cpu",
    "trainer.peak_tflops=1",
]


@dataclass
class LayoutRun:
    """What one rank reports after :func:`train_layout`."""

    losses: list[float]  # per step; nan on ranks that do not hold the loss
    grad_norms: list[float]  # per step, the global norm before clipping
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full tensors (see below)
    stats: dict = field(default_factory=dict)  # CommStats summary of the training steps
    state_bytes: dict = field(default_factory=dict)  # params / grads / optimizer bytes held
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's model buffers


# Composed test configs of this process, by (overrides, steps): Hydra takes ~0.3 s per compose,
# and every rank of a forked world would compose the same one (run_world composes it once in the
# parent first where it can, see train_layout.prepare_in_parent; the ranks of other worlds share
# it through megatronish/testing/shared_configs.py). Callers get copies.
_COMPOSED: dict[tuple[tuple[str, ...], int], TrainConfig] = {}


def test_config(overrides: list[str], steps: int):
    """The tiny test config with ``overrides`` (``model.arch=gpt2`` works too); no log file
    unless ``overrides`` names one."""
    key = (tuple(overrides), steps)
    if key not in _COMPOSED:
        base = [*TINY_TEST_MODEL, f"trainer.max_steps={steps}", "logging.log_file=null"]
        _COMPOSED[key] = composed([*base, *overrides])
    return copy.deepcopy(_COMPOSED[key])


def build_trainer(
    rank: int, world: int, overrides: list[str], steps: int = 10, model=None, p2p=None, **kw
):
    """A Trainer for the tiny test model (or ``model`` overrides) in the current world's layout.

    Collective when ``world > 1``. Data is :class:`PatternTokens` (no files). ``p2p``: the
    pipeline's p2p factory (e.g. :class:`~megatronish.testing.strict_p2p.StrictP2P`); ``kw``
    goes to the Trainer (``saving``, ``stop``; see :func:`trainer_for`).
    """

    cfg = (
        test_config(overrides, steps)
        if model is None
        else composed([*model, f"trainer.max_steps={steps}", *overrides])
    )
    return trainer_for(cfg, rank, world, p2p=p2p, **kw)[0]


def trainer_for(
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device | None = None,
    p2p=None,
    checkpoint_rng: bool = False,
    **kw,
):
    """``(Trainer, its RNG tracker)`` for the composed ``cfg`` in the current world, on
    ``device`` (default CPU), with :class:`PatternTokens` data. Collective when ``world > 1``.
    With a packed-document option on (``data.reset_attention_mask``, ...) the data is
    :class:`PackedPatternTokens` ending documents at ``SYNTHETIC_EOD``. ``kw`` goes to the
    Trainer; ``saving=True`` saves to ``checkpoint.dir``. With
    ``checkpoint_rng`` (implied by ``saving=True``) the trainer's checkpoints hold this RNG's
    streams and its loads restore them."""
    from megatronish.checkpoint.save import Saving
    from megatronish.training.job import build_model
    from megatronish.training.trainer import Trainer

    topo, d, spec, rng = layout_parts(cfg, rank, world, device)
    chunks = build_model(cfg, topo, d, spec, rng, p2p=p2p)
    data = PatternTokens(spec.vocab_size, spec.seq_length, seed=cfg.trainer.seed)
    if any(getattr(cfg.data, key) for key in PACKING_OPTIONS):  # windows of packed documents
        data = PackedPatternTokens(
            spec.vocab_size, spec.seq_length, SYNTHETIC_EOD, cfg.trainer.seed
        )
        kw.setdefault("eod_id", SYNTHETIC_EOD)
    if kw.get("saving") is True:
        kw["saving"], checkpoint_rng = Saving(), True
    kw["rng"] = rng if checkpoint_rng else None
    return Trainer(cfg, topo, spec, d, chunks, data, p2p=p2p, **kw), rng


def layout_parts(cfg: TrainConfig, rank: int, world: int, device: torch.device | None = None):
    """``(Topology, Derived, ModelSpec, RNGTracker)`` for the composed ``cfg`` in the current
    world: what :func:`~megatronish.training.job.build_model` takes. Collective when
    ``world > 1``."""
    if errors := config_errors(cfg, world, data=False):  # synthetic batches: no dataset
        raise ConfigError(errors)
    d = derive(cfg, world)
    topo = Topology.from_config(cfg.parallel, rank, world, device or torch.device("cpu"))
    spec = ModelSpec.from_config(cfg.model, cfg.model.vocab_size)
    rng = RNGTracker(topo.device)
    rng.seed(
        cfg.trainer.seed, tp_rank=topo.coords.tp, pp_rank=topo.coords.pp, cp_rank=topo.coords.cp
    )
    return topo, d, spec, rng


def train_layout(
    rank: int,
    world: int,
    overrides: list[str],
    steps: int = PARITY_STEPS,
    load: str | None = None,
    save: str | None = None,
    strict_p2p: bool = False,
) -> LayoutRun:
    """Train until step ``steps`` in the current process world.

    ``load`` resumes from a checkpoint first (any layout); ``save`` writes one to that
    ``checkpoint.dir`` at the end. ``params`` maps global names to full tensors for the stage
    this rank belongs to, from tp rank 0 of dp rank 0 (empty elsewhere), so merging every rank's
    dict gives the whole model. ``strict_p2p``: pipeline and ring attention sends complete only
    once the peer received them, as on NCCL (:mod:`megatronish.testing.strict_p2p`).
    """
    from megatronish.checkpoint.gather import gather_tp_params
    from megatronish.checkpoint.load import load_into
    from megatronish.checkpoint.parts import model_buffers
    from megatronish.checkpoint.save import CheckpointSaver

    extra = _save_overrides(save)
    p2p = None
    if strict_p2p:
        from megatronish.testing.strict_p2p import StrictP2P as p2p
    trainer = build_trainer(rank, world, [*overrides, *extra], steps, p2p=p2p)
    topo, chunks = trainer.topo, trainer.chunks
    if load:
        load_into(trainer.checkpoint_parts, load)
    history = trainer.fit()
    if save:
        CheckpointSaver(trainer.cfg, trainer.checkpoint_parts).save(blocking=True)
    stats = topo.stats.summary()  # training traffic only, before the gathers below
    held = {
        **trainer.zero.state_bytes(),
        "optimizer": trainer.optimizer.state_bytes(),
        "param_numel": sum(p.numel() for c in chunks for p in c.parameters()),
        "buffer_numel": sum(b.numel for b in trainer.zero.buckets),
        "buckets": len(trainer.zero.buckets),
        "late_buckets": sum(b.late for b in trainer.zero.buckets),
        # zero 3: (padded numel, buckets, holds the loss) of each unit
        "units": [
            (u.numel, len(u.buckets), u.holds_loss) for us in trainer.zero.units_of for u in us
        ],
    }
    for i in range(len(chunks)):
        trainer.zero.gather(i)  # zero 3 keeps only shards between steps
    params = gather_tp_params(chunks, topo)
    keep = topo.coords.tp == 0 and topo.coords.dp == 0 and topo.coords.cp == 0
    return LayoutRun(
        losses=[r.loss for r in history],
        grad_norms=[r.grad_norm for r in history],
        params=params if keep else {},
        stats=stats,
        state_bytes=held,
        buffers={n: b.detach().clone() for n, b in model_buffers(chunks).items()},
    )


def _save_overrides(save: str | None) -> list[str]:
    return [f"checkpoint.dir={save}"] if save else []


def _compose_in_parent(
    world: int,
    overrides: list[str],
    steps: int = PARITY_STEPS,
    load: str | None = None,
    save: str | None = None,
    strict_p2p: bool = False,
) -> None:
    """Compose :func:`train_layout`'s config before the ranks fork, so they inherit it. A
    config that does not compose is left to the ranks, which fail with it as before."""
    try:
        test_config([*overrides, *_save_overrides(save)], steps)
    except Exception:  # noqa: BLE001 - each rank raises it itself
        pass


train_layout.prepare_in_parent = _compose_in_parent


def merge_params(results) -> dict[str, torch.Tensor]:
    """Union of every rank's ``params`` from :func:`train_layout` results."""
    merged: dict[str, torch.Tensor] = {}
    for run in results:
        merged.update(run.params)
    return merged


def losses_of(results) -> list[float]:
    """The per-step losses reported by the rank(s) holding the loss (they agree)."""
    for run in results:
        if run.losses and run.losses[0] == run.losses[0]:  # not nan
            return run.losses
    raise AssertionError("no rank reported a loss")


_REFERENCES: dict[tuple[str, ...], LayoutRun] = {}


def one_process_reference(overrides: list[str], steps: int = PARITY_STEPS) -> list[LayoutRun]:
    """The one-process run of ``overrides`` that parity tests compare layouts with, trained once
    per test process (``[run]``, as :func:`~megatronish.testing.multiproc.run_world` returns)."""
    key = (*overrides, f"steps={steps}")
    if key not in _REFERENCES:
        _REFERENCES[key] = train_layout(0, 1, list(overrides), steps)
    return [_REFERENCES[key]]
