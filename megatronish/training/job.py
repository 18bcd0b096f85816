"""A run's start-up from a validated config: threads, device, process groups and Topology
(:func:`start_topology`), then data, tokenizer, model chunks and RNG streams (:func:`build_on`):
the :class:`Job` the entry point builds its Trainer from."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatronish.config.derived import Derived, derive
from megatronish.config.pipeline_rules import V_SHAPE_SCHEDULES
from megatronish.config.schema import TrainConfig
from megatronish.config.validate import ConfigError, vocab_errors
from megatronish.context_parallel.attention import CPContext
from megatronish.data_parallel.stages import ZERO_STAGES
from megatronish.distributed.agree import PeerError, agree
from megatronish.distributed.comm import ParallelGroup
from megatronish.distributed.cpus import default_threads, usable_cpus
from megatronish.distributed.launch import LaunchEnv, init_process_group, pick_device
from megatronish.distributed.p2p import P2PCommunicator
from megatronish.distributed.parallel_grid import rank_map_table
from megatronish.distributed.topology import Topology
from megatronish.model.build import apply_fp8, build_chunks
from megatronish.model.compile import compile_blocks
from megatronish.model.parallel_context import ParallelContext
from megatronish.model.recompute import apply_recompute
from megatronish.moe.context import EPContext
from megatronish.moe.experts import GroupedExperts
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.context import TPContext
from megatronish.tensor_parallel.random import RNGTracker
from megatronish.training.precision import apply_deterministic, apply_fp32_matmul_setting


@dataclass
class Job:
    cfg: TrainConfig
    launch: LaunchEnv
    topo: Topology
    derived: Derived
    spec: ModelSpec
    chunks: list
    rng: RNGTracker
    train_data: object
    valid_data: object
    tokenizer: object


def set_threads(cfg: TrainConfig, launch: LaunchEnv) -> None:
    """The CPUs this process may use (its affinity mask: SLURM's cgroup or task binding, not the
    node's core count) shared by the ranks that share the mask (:func:`default_threads`); all
    of them for a single process."""
    n = cfg.trainer.num_threads
    if n is None:
        n = default_threads(os.environ, launch.kind, launch.world_size, usable_cpus())
    torch.set_num_threads(n)


def build_data(cfg: TrainConfig, topo: Topology, launch: LaunchEnv):
    """Datasets and tokenizer; local rank 0 builds caches first, failures stop every rank."""
    from megatronish.data.build import build_datasets

    result = None
    for first in (True, False):  # local rank 0 (caches), then the rest: both rounds agree
        error = None
        if (launch.local_rank == 0) == first:
            try:
                t = cfg.trainer  # a blend's index covers the samples the run will read
                samples = (t.max_steps * t.global_batch_size, t.eval_iters * t.global_batch_size)
                result = build_datasets(cfg.data, cfg.model.seq_length, t.seed, samples)
            except (OSError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
        agree(error, topo.world_group)
    return result


def check_memory_fits(cfg: TrainConfig, launch: LaunchEnv, topo: Topology, vocab: int) -> None:
    """Stop every rank, before the model is allocated, when the planner says a rank's peak
    exceeds its device memory (GPU memory, or this host's available RAM shared by its ranks), or
    the host's ranks' offloaded optimizer state exceeds its available RAM."""
    from megatronish.plan.devices import available_ram_bytes, local_device_memory
    from megatronish.plan.fit_check import LayoutDoesNotFit, host_fit_error, memory_fit_error

    local = int(os.environ.get("LOCAL_WORLD_SIZE", launch.world_size))
    budget, runtime = local_device_memory(str(topo.device), local)
    where = str(topo.device) if topo.device.type == "cuda" else f"available RAM / {local} rank(s)"
    error = None
    if budget is not None:  # unknown on hosts without /proc/meminfo: nothing to check against
        error = memory_fit_error(cfg, launch.world_size, vocab, budget, runtime, where)
    ram = available_ram_bytes()
    if error is None and ram is not None:  # optimizer offload's pinned host memory
        error = host_fit_error(cfg, launch.world_size, vocab, local, ram)
    try:
        agree(error, topo.world_group)
    except PeerError as e:
        raise LayoutDoesNotFit(error or str(e)) from None


def build_model(
    cfg: TrainConfig,
    topo: Topology,
    derived: Derived,
    spec: ModelSpec,
    rng: RNGTracker,
    p2p: Callable[[ParallelGroup], P2PCommunicator] | None = None,
):
    """This rank's chunks; under ZeRO 3 with parameters on the meta device, their shards drawn
    by ZeRO (:class:`~megatronish.model.init.DeferredInit`), so no rank holds its whole chunk.
    ``p2p``: what posts ring attention's groups (default BatchedP2P)."""
    ctx = ParallelContext(
        tp=TPContext(group=topo.tp_group, sp=cfg.parallel.sp, rng=rng),
        cp=CPContext(
            group=topo.cp_group,
            seq_length=spec.seq_length,
            comm_type=cfg.parallel.cp_comm_type,
            a2a_group=topo.group("cp_a2a"),
            ring_group=topo.group("cp_ring"),
            p2p=p2p,
        ),
        ep=EPContext(
            group=topo.ep_group,
            dispatch_order=cfg.parallel.moe_dispatch_order,
            overlap_shared=cfg.parallel.moe_shared_expert_overlap,
        ),
    )
    chunks = build_chunks(
        spec,
        ctx,
        derived.layers_per_chunk,
        pp_rank=topo.coords.pp,
        pp=topo.pp,
        vpp=cfg.parallel.vpp,
        seed=cfg.trainer.seed,
        device=topo.device,
        deferred=ZERO_STAGES[cfg.parallel.zero_stage].shards_params,
        v_shape=cfg.parallel.pipeline_schedule in V_SHAPE_SCHEDULES,
    )
    t = cfg.trainer
    apply_recompute(chunks, t.recompute, t.recompute_method, t.recompute_num_layers, rng)
    if t.fp8 is not None:
        linears, experts = apply_fp8(chunks, t.fp8, t.fp8_skip_first_last, spec.num_layers)
        if topo.rank == 0:
            print(fp8_note(t.fp8, t.fp8_skip_first_last, linears, experts, topo.device), flush=True)
    if t.compile:
        compile_model(cfg, topo, chunks)
    return chunks


def fp8_note(
    recipe: str, skip_first_last: int, linears: int, experts: int, device: torch.device
) -> str:
    """The start-up line of ``trainer.fp8``: what runs in fp8 on the first rank, what not."""
    note = f"[fp8] {recipe}: {linears} linear layers on this rank run in fp8"
    if experts and GroupedExperts.fp8_here(device):
        note += f", and the experts of {experts} blocks (e4m3, scaled by rows and columns)"
    elif experts:
        note += f"; the experts stay bf16 (no fp8 grouped GEMM on {device.type} here)"
    if skip_first_last:
        return (
            note + f"; the embedding, the head, the first and last {skip_first_last} blocks in bf16"
        )
    return note + "; the embedding and the head in bf16"


def compile_model(cfg: TrainConfig, topo: Topology, chunks: list) -> None:
    """``trainer.compile``: every block's forward compiled (:mod:`megatronish.model.compile`);
    the first rank of each pipeline stage logs why its blocks, if any, compile in pieces."""
    t = cfg.trainer
    if t.compile_cache_dir:  # read by inductor when it first looks for a compiled graph
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(
            os.path.expanduser(t.compile_cache_dir)
        )
    first_of_stage = (topo.coords.tp, topo.coords.cp, topo.coords.dp) == (0, 0, 0)
    prefix = f"[compile] stage {topo.coords.pp}: " if topo.pp > 1 else "[compile] "

    def log(line: str) -> None:
        if first_of_stage:
            print(prefix + line, flush=True)

    compiled = compile_blocks(chunks, t.compile_backend, log)
    if topo.rank == 0:
        print(
            f"[compile] {len(compiled)} blocks on this rank compile with {t.compile_backend} "
            "on their first step",
            flush=True,
        )


def start_topology(cfg: TrainConfig, launch: LaunchEnv) -> tuple[Derived, Topology]:
    """Threads, device, precision switches, process groups and the Topology, for a config the
    entry point validated (``config_errors``). Collective when the world has more than one rank;
    the caller closes the Topology (and destroys the process groups)."""
    set_threads(cfg, launch)
    derived = derive(cfg, launch.world_size)
    device = pick_device(cfg.trainer.device, launch.local_rank, task_bound=launch.kind == "slurm")
    apply_fp32_matmul_setting(device, cfg.trainer.tf32)
    apply_deterministic(cfg.trainer.deterministic)
    init_process_group(launch, device, cfg.parallel.collective_timeout_s)
    topo = Topology.from_config(cfg.parallel, launch.rank, launch.world_size, device)
    return derived, topo


def build_on(cfg: TrainConfig, launch: LaunchEnv, topo: Topology, derived: Derived) -> Job:
    """Data, tokenizer, model and RNG streams of a run on ``topo``. Collective."""
    if topo.rank == 0:
        print(rank_map_table(topo.grid), flush=True)

    train_data, valid_data, tokenizer = build_data(cfg, topo, launch)
    if topo.rank == 0 and hasattr(train_data, "describe"):  # a blend: what each dataset gives
        for kind, data in (("train", train_data), ("valid", valid_data)):
            print(f"[data] {kind} blend of {len(data):,} samples:", flush=True)
            for line in data.describe():
                print(f"[data]   {line}", flush=True)
    errors = vocab_errors(cfg, tokenizer.vocab_size)
    try:  # the same rules on every rank; agreeing keeps any disagreement from hanging
        agree("; ".join(errors) if errors else None, topo.world_group)
    except PeerError as e:
        raise ConfigError(errors or [str(e)]) from None
    spec = ModelSpec.from_config(cfg.model, tokenizer.vocab_size)
    if cfg.trainer.check_memory:
        check_memory_fits(cfg, launch, topo, tokenizer.vocab_size)

    rng = RNGTracker(topo.device)
    rng.seed(
        cfg.trainer.seed, tp_rank=topo.coords.tp, pp_rank=topo.coords.pp, cp_rank=topo.coords.cp
    )
    chunks = build_model(cfg, topo, derived, spec, rng)
    return Job(cfg, launch, topo, derived, spec, chunks, rng, train_data, valid_data, tokenizer)
