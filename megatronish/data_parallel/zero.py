"""Data parallelism with ZeRO stages 0-3 over bucketed flat buffers.

What each stage shards is :mod:`~megatronish.data_parallel.stages`; where a bucket's params
live, :mod:`~megatronish.data_parallel.bucket_storage`; the hooks that count grads into buckets,
:mod:`~megatronish.data_parallel.grad_hooks`. Under ZeRO 3 each unit (block, embedding, head) is
gathered just before use, the next one prefetched, and freed after (see
:mod:`~megatronish.data_parallel.param_gather`); ``keep_gathered`` keeps them for the step.

Zero 1/2 start the all-gathers of the updated params after the optimizer step and each unit
waits for its own before its first forward of the next step (Megatron's overlap_param_gather;
``overlap_param_gather=False`` gathers at once).

Precision (Megatron-LM's mixed-precision recipe): the model's params are ``param_dtype`` (bf16
on GPUs), so activations, sequence-parallel collectives and pipeline messages are bf16 too. The
optimizer updates fp32 *main* params (only this rank's shard under ZeRO >= 1), which are cast
into the model's params after every step; grads are accumulated in fp32 ``main_grad`` buffers,
and reduced over dp in ``reduce_dtype`` (fp32 by default). With fp32 params the main params are
the params themselves and nothing is copied.

A bucket's reduction starts from a post-accumulate-grad hook as soon as every param in it has
received its grad (zero 0/1: of all microbatches of the step, zero 2/3: of the microbatch), so
reductions overlap the rest of backward (:mod:`~megatronish.data_parallel.grad_reduce` bounds
how many are in flight). Buckets holding params that need a model-parallel sum first
(sequence-parallel replicas, replicated heads, tied embeddings) are reduced at the end of the step.

Hybrid sharding (``parallel.zero_shard_size``, FSDP2's HSDP): dense buckets are sharded,
reduce-scattered and gathered over the ZeRO shard group only (cp x zero_shard_size consecutive
dp ranks: a node), and the shard groups hold the same shards. Once per step, as soon as a
bucket's last reduce-scatter of the step is finished (during the last microbatch's backward),
its reduced shard is all-reduced across the replicas, overlapping the rest of the backward
(shards accumulate over the microbatches, so the slow link carries each shard once per step).
Experts keep their own expert-data-parallel group. The first replica of a shard counts it in
the grad norm and writes it to checkpoints.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatronish.data_parallel.bucket_storage import allocate_params, owned_elements
from megatronish.data_parallel.buckets import Bucket, is_expert, plan_chunk_buckets
from megatronish.data_parallel.compression import (
    NO_COMPRESSION,
    CompressionSettings,
    make_compressor,
)
from megatronish.data_parallel.grad_hooks import make_grad_hook, make_main_grad_adder, note_arrival
from megatronish.data_parallel.grad_norm import global_grad_norm
from megatronish.data_parallel.grad_reduce import GradReducer, ReplicaReduction
from megatronish.data_parallel.grads import (
    counts_in_norm,
    flat_all_reduce,
    sum_local_tied_copies,
    sum_partial_grads_over_tp,
    tied_rule,
)
from megatronish.data_parallel.offload import OptimizerOffload, Transfers, transfers_for
from megatronish.data_parallel.param_gather import ParamGatherer
from megatronish.data_parallel.param_units import chunk_visits
from megatronish.data_parallel.stages import ZERO_STAGES
from megatronish.distributed.comm import all_gather_into
from megatronish.distributed.timers import Timers
from megatronish.distributed.topology import Topology
from megatronish.tensor_parallel.sharding import param_info

if TYPE_CHECKING:
    from megatronish.model.init import DeferredInit


class ZeroDataParallel:
    """Owns params, grads and the reductions of this rank's chunks for one ZeRO stage."""

    def __init__(
        self,
        chunks: list[nn.Module],
        topo: Topology,
        stage: int,
        bucket_mb: float,
        keep_gathered: bool = False,
        timers: Timers | None = None,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        overlap_param_gather: bool = True,
        compression: CompressionSettings = NO_COMPRESSION,
        seed: int = 0,
        optimizer_offload: bool = False,
        transfers: Transfers | None = None,
    ):
        self.chunks, self.topo = chunks, topo
        self.offload: OptimizerOffload | None = None  # set below (parallel.optimizer_offload)
        self.zero_stage = zs = ZERO_STAGES[stage]  # what it shards
        self.keep_gathered = keep_gathered
        self.overlap_param_gather = overlap_param_gather
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.separate_main = param_dtype != torch.float32
        self.timers = timers or Timers.off()  # param_gather, grad_reduce_wait; profiler ranges
        # The grad norm sums over every rank when ranks own shards (zero >= 1) or hold different
        # experts (ep ranks); over tp x pp otherwise (zero 0 keeps whole replicas).
        self.world_norm = zs.norm_over_world or any(
            is_expert(p) for chunk in chunks for p in chunk.parameters()
        )
        # The ranks dense params are sharded over: dp x cp, or a hybrid-sharding group of it
        # (whose replicas then all-reduce the reduced shards); experts over their own group.
        dp = topo.zero_shard_group
        self.replicas = topo.zero_replica_group
        edp = topo.edp_group  # those holding the same experts: dp x cp / ep
        self.is_tied = tied_rule(bool(chunks) and chunks[0].spec.tie_embeddings, topo.pp)
        self.buckets_of: list[list[Bucket]] = []
        units_of, visits_of = [], []
        for i, chunk in enumerate(chunks):
            buckets = plan_chunk_buckets(
                chunk,
                int(bucket_mb * 2**20),
                dp.size,
                dp.rank,
                self.is_tied,
                topo.device,
                per_unit=zs.shards_grads,  # the full grads alive are about one unit's
                expert_dp=(edp.size, edp.rank),
            )
            deferred = getattr(chunk, "deferred_init", None)  # a meta build (zero 3)
            for b in buckets:
                b.group = edp if b.expert else dp
                b.replicas = None if b.expert else self.replicas
                self._allocate(b, deferred)
            if deferred is not None:  # drawn: a later owner of the chunk takes it as it is
                del chunk.deferred_init
            self.buckets_of.append(buckets)
            units, visits = chunk_visits(chunk, i)
            bucket_of = {id(p): b for b in buckets for _, p in b.params}
            for u in units:
                u.buckets = list({id(b): b for p in u.params for b in [bucket_of[id(p)]]}.values())
            units_of.append(units)
            visits_of.append(visits)
        self.hybrid = self.replicas.size > 1
        # parallel.optimizer_offload: main params, moments and the update on the host
        if optimizer_offload:
            owned = [self._owned(b) for b in self.buckets]
            moves = transfers or transfers_for(topo.device)
            self.offload = OptimizerOffload(self.buckets, owned, param_dtype, moves)
        self.main_elsewhere = self.separate_main or self.offload is not None
        # parallel.grad_compression: its error feedback (and PowerSGD's Q) per bucket
        self.compressor = make_compressor(compression, self.buckets, seed)
        self.compression_start_step = compression.start_step
        # Hybrid sharding and offload act on each bucket once its reduction is finished: the
        # reductions are finished in order during the backward, as under ZeRO 2/3.
        bounded = self.hybrid or self.offload is not None
        self.reducer = GradReducer(
            dp, zs, reduce_dtype, self.timers, bounded=bounded, compressor=self.compressor
        )
        self.grad_scale = 1.0 / topo.dp_cp  # each rank's loss is its own tokens' mean
        self.finalized: set[int] = set()  # buckets whose grads this step are final
        self.num_microbatches = 1
        # hybrid sharding: the shards' all-reduces over the replicas in flight, and the buckets
        # whose all-reduce this step has started
        self.replica_reductions: list[ReplicaReduction] = []
        self.replica_started: set[int] = set()
        # Zero 2/3 accounting: full-grad elements of buffers being filled, and the most alive at
        # once (those plus the ones reductions in flight hold).
        self.filling_numel = self.peak_grad_numel = 0
        self.gatherer = None
        sharded = dp.size > 1 or edp.size > 1
        if zs.shards_params or (zs.gathers_after_update and overlap_param_gather and sharded):
            self.gatherer = ParamGatherer(
                units_of, visits_of, dp, zs, keep_gathered, self.timers, self._await_params
            )
        self.units_of = units_of

    @property
    def stage(self) -> int:
        """The stage's number (for logs and checkpoints); ``zero_stage`` says what it shards."""
        return self.zero_stage.number

    @property
    def buckets(self) -> list[Bucket]:
        return [b for bs in self.buckets_of for b in bs]

    def _per_microbatch(self, b: Bucket) -> bool:
        """Reduced after every microbatch, its full grads freed in between (zero 2/3)."""
        return self.zero_stage.reduces_per_microbatch and not b.late

    def owned_range(self, b: Bucket) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of bucket ``b`` whose optimizer state this rank holds."""
        return self._owned(b)

    # -- storage ----------------------------------------------------------------------------
    def _owned(self, b: Bucket) -> tuple[int, int]:
        return owned_elements(b, self.zero_stage)

    @torch.no_grad()
    def _allocate(self, b: Bucket, deferred: DeferredInit | None = None) -> None:
        allocate_params(b, self.zero_stage, self.param_dtype, deferred)
        lo, hi = self._owned(b)
        if self.zero_stage.shards_grads:  # the reduced shard outlives the full buffers
            b.grad_shard = torch.zeros(hi - lo, device=b.device)
        else:
            self.new_grad_buffer(b)
        b.decay_ranges = b.ranges(lambda n, p: param_info(p).weight_decay, lo, hi)
        b.norm_ranges = b.ranges(lambda n, p: counts_in_norm(n, p, self.topo), lo, hi)
        if not self.zero_stage.shards_optimizer_state and b.group.rank != 0 and self.world_norm:
            b.norm_ranges = []  # zero 0 keeps whole replicas: the first one counts
        if b.replicas is not None and b.replicas.rank != 0:
            b.norm_ranges = []  # hybrid sharding: the first replica of the shard counts
        for _, p in b.params:
            p.register_hook(note_arrival(p))
            p.register_post_accumulate_grad_hook(make_grad_hook(self, b))
            if self.separate_main:  # an op may add its fp32 grad here itself (the fused head)
                p.accumulate_main_grad = make_main_grad_adder(self, b, p)

    def new_grad_buffer(self, b: Bucket) -> None:
        """Give ``b`` a zeroed full grad buffer and point its params' main grads into it."""
        b.grad_flat = torch.zeros(b.numel, device=b.device)
        if self.zero_stage.shards_grads:
            self.filling_numel += b.numel
            live = self.filling_numel + self.reducer.in_flight_numel
            self.peak_grad_numel = max(self.peak_grad_numel, live)
        for _, p, view in b.views(b.grad_flat):
            p.main_grad = view
            if not self.separate_main:  # autograd accumulates in place (no extra copy)
                p.grad = view
        if self.zero_stage.reduce_scatters_grads and not self.zero_stage.shards_grads:
            # reduced in place into this rank's slice
            lo, hi = b.shard_range
            b.grad_shard = b.grad_flat[lo:hi]

    def _drop_grad_buffer(self, b: Bucket) -> None:
        if self.zero_stage.shards_grads and b.grad_flat is not None:
            self.filling_numel -= b.numel
        b.grad_flat = None
        for _, p in b.params:
            p.main_grad = p.grad = None

    # -- parameter gathering (zero 3: per unit; zero 1/2: after the update) -----------------
    def prefetch(self, chunk_index: int, kind: str) -> None:
        """Engine hook: a ``kind`` ("fwd"/"bwd") compute of the chunk comes next."""
        if self.gatherer is not None:
            self.gatherer.prefetch(chunk_index, kind)

    def after_compute(self, chunk_index: int, kind: str) -> None:
        """Engine hook: a compute of the chunk ended. After a backward, zero 2/3 finish the
        reduction still in flight (FSDP2 waits there too), so its full-size buffer does not
        live through the next forward; zero 3 frees what the compute left gathered."""
        if kind == "bwd" and self.zero_stage.shards_grads and self.reducer.in_flight:
            with self.timers.region("grad_reduce_wait", "wait grads"):
                self.reducer.finish_all()
        if self.gatherer is not None:
            self.gatherer.after_compute(chunk_index, kind)

    def gather(self, chunk_index: int) -> None:
        """Make all of a chunk's params whole now (for readers outside a training step)."""
        if self.gatherer is None:
            return
        if self.zero_stage.shards_params:
            self.gatherer.gather_all(chunk_index)
        else:
            self.finish_param_gather()

    def release_all(self) -> None:
        """End of a step or an evaluation: zero 3 frees every gathered unit."""
        if self.zero_stage.shards_params and self.gatherer is not None:
            self.gatherer.release_all()

    def finish_param_gather(self) -> None:
        """Wait for the after-update all-gathers (zero 1/2 with overlap_param_gather)."""
        if self.zero_stage.gathers_after_update and self.gatherer is not None:
            self.gatherer.wait_updated()

    # -- gradients --------------------------------------------------------------------------
    def start_step(self, num_microbatches: int, step: int = 0) -> None:
        """Zero grads and arm the hooks for training step ``step`` of ``num_microbatches``
        (whose reductions are compressed from ``compression_start_step`` on)."""
        self.num_microbatches = num_microbatches
        self.reducer.compressing = step >= self.compression_start_step
        self.replica_started.clear()
        self.finalized.clear()
        for b in self.buckets:
            b.extra["rounds"] = 0
            if self._per_microbatch(b):
                b.grad_shard.zero_()
                if b.grad_flat is not None:
                    self._drop_grad_buffer(b)
                b.pending = len(b.params)
                continue
            if b.grad_flat is None:
                self.new_grad_buffer(b)
            else:
                b.grad_flat.zero_()
            b.pending = len(b.params) * num_microbatches

    def launch_reduction(self, b: Bucket) -> None:
        """Start ``b``'s reduction (zero 2/3: into its shard, re-armed for the next microbatch)."""
        rounds = b.extra["rounds"]
        b.extra["rounds"] = rounds + 1
        last = not self._per_microbatch(b) or rounds + 1 == self.num_microbatches
        then = None
        if last:
            hybrid = self.hybrid and b.replicas is not None
            then = self._replica_reducer(b) if hybrid else functools.partial(self._final, b)
        if self.zero_stage.reduces_per_microbatch:
            full = b.grad_flat
            self._drop_grad_buffer(b)  # the reduction holds it until done
            if not b.late:
                b.pending = len(b.params)
            self.reducer.launch(
                full, b.grad_shard, accumulate=rounds > 0, group=b.group, then=then, bucket=b
            )
        else:
            self.reducer.launch(b.grad_flat, self.owned_grad(b), group=b.group, then=then, bucket=b)

    def _replica_reducer(self, b: Bucket):
        """Hybrid sharding: start the all-reduce of ``b``'s reduced shard over the replicas
        (called when the step's last reduction of ``b`` is finished)."""

        def start() -> None:
            self.replica_started.add(id(b))
            launched = ReplicaReduction.launch(self.owned_grad(b), self.replicas, self.reduce_dtype)
            launched.then = functools.partial(self._final, b)
            self.replica_reductions.append(launched)

        return start

    def _final(self, b: Bucket) -> None:
        """``b``'s grads of the step are reduced: average them, and (offload) start their copy
        to the host."""
        self.finalized.add(id(b))
        grad = self.owned_grad(b)
        grad.mul_(self.grad_scale)
        if self.offload is not None:
            self.offload.grads_down(b, grad)

    def finish_reduction(self) -> None:
        """Wait for every reduction; sum late buckets over tp / the embedding group first."""
        with self.timers.region("grad_reduce_wait", "grad reduction wait"):
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        self.finish_param_gather()
        for b in self.buckets:  # buckets some of whose params got no grad this step
            if (
                not b.late
                and b.grad_flat is not None
                and (self._per_microbatch(b) or b.extra["rounds"] == 0)
            ):
                self.launch_reduction(b)
        late = [b for b in self.buckets if b.late]
        sum_partial_grads_over_tp([p for b in late for _, p in b.params], self.topo.tp_group)
        tied = [(n, p) for b in late for n, p in b.params if self.is_tied(n, p)]
        flat_all_reduce(sum_local_tied_copies(tied), self.topo.embedding_group)
        for b in late:
            self.launch_reduction(b)
        self.reducer.finish_all()
        if self.hybrid:  # each shard once per step, those not yet started (no grad last) too
            for b in self.buckets:
                if b.replicas is not None and id(b) not in self.replica_started:
                    self._replica_reducer(b)()
            reductions, self.replica_reductions = self.replica_reductions, []
            for reduction in reductions:
                reduction.finish()
        for b in self.buckets:  # those no reduction finished as the step's last
            if id(b) not in self.finalized:
                self._final(b)

    def owned_grad(self, b: Bucket) -> torch.Tensor:
        return b.grad_shard if self.zero_stage.shards_optimizer_state else b.grad_flat

    # -- norm, clip, update -----------------------------------------------------------------
    def grad_norm(self, local_fault: torch.Tensor | None = None) -> torch.Tensor:
        """Global L2 norm: every parameter element counted exactly once across tp, pp, dp. It
        stays on the device (the host reads nothing).

        ``local_fault``: this rank saw a non-finite value elsewhere (its loss; a 0-dim bool tensor
        on the device); the norm then comes out nan on every rank, so all ranks skip
        the step together without another collective.
        """
        group = self.topo.world_group if self.world_norm else self.topo.mp_group
        owned = ((self.owned_grad(b), b.norm_ranges) for b in self.buckets)
        return global_grad_norm(owned, group, self.topo.device, self.timers, local_fault)

    @property
    def optimizer_device(self) -> torch.device:
        """Where the optimizer's state and update live: the host under offload."""
        return torch.device("cpu") if self.offload is not None else self.topo.device

    def optimizer_shards(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(fp32 main params, fp32 grads, decay ranges)`` of this rank's owned part (on the
        host under offload)."""
        if self.offload is not None:
            return [(b.main_shard, self.offload.host_grad(b), b.decay_ranges) for b in self.buckets]
        return [(b.main_shard, self.owned_grad(b), b.decay_ranges) for b in self.buckets]

    def update_inputs(
        self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor
    ) -> tuple[list, torch.Tensor | None, torch.Tensor]:
        """``(optimizer shards, grad scale, found_inf)`` for the update, where it runs: under
        offload the host waits here for the grads' copies (and reads the two scalars)."""
        if self.offload is None:
            return self.optimizer_shards(), grad_scale, found_inf
        self.offload.transfers.host_waits()
        host = torch.device("cpu")
        scale = None if grad_scale is None else grad_scale.to(host)
        return self.optimizer_shards(), scale, found_inf.to(host)

    def model_load_targets(self) -> list[tuple[torch.Tensor, int, int]]:
        """Where a checkpoint's parameter values go, per bucket: ``(dest, lo, hi)`` for
        elements ``[lo, hi)`` of the bucket; call :meth:`params_from_main` after loading."""
        self.finish_param_gather()
        if self.main_elsewhere:
            return [(b.main_shard, *self._owned(b)) for b in self.buckets]
        if not self.zero_stage.shards_params:  # every rank holds the whole bucket's params
            return [(b.param_flat, 0, b.numel) for b in self.buckets]
        return [(b.param_shard, *b.shard_range) for b in self.buckets]

    @torch.no_grad()
    def params_from_main(self) -> None:
        """Cast the main params into the model's params and make them whole (after a load)."""
        if self.main_elsewhere:
            self._cast_main()
            self._gather_updated()
            self.finish_param_gather()

    @torch.no_grad()
    def _cast_main(self) -> None:
        for b in self.buckets:
            b.param_shard.copy_(b.main_shard)

    @torch.no_grad()
    def after_update(self) -> None:
        """Make every rank's params whole again (zero 1/2, overlapping the next forward when
        ``overlap_param_gather``); zero 3 keeps shards. Under offload the updated shards are
        copied up bucket by bucket in forward order, each waited for before its first use."""
        if self.offload is not None:
            for b in [b for bs in self.buckets_of for b in reversed(bs)]:  # forward order
                self.offload.params_up(b)
        elif self.separate_main:
            self._cast_main()
        self._gather_updated()
        if self.offload is not None and not self.zero_stage.shards_params:
            for b in self.buckets:  # zero 3's gathers wait for their own
                self.offload.await_params(b)
        self.release_all()

    def _gather_updated(self) -> None:
        if not self.zero_stage.gathers_after_update or self.topo.dp_cp == 1:
            return
        if self.gatherer is not None:  # waited for unit by unit in the next forward
            order = [b for bs in self.buckets_of for b in reversed(bs)]  # forward order
            self.gatherer.start_updated_gather(order)
            return
        with self.timers.region("param_gather", "all-gather params"):
            for b in self.buckets:
                self._await_params(b)
                all_gather_into(b.param_flat, b.param_shard, b.group)  # in place

    def _await_params(self, b: Bucket) -> None:
        """Offload: the device's next use of ``b``'s shard waits for its copy up."""
        if self.offload is not None:
            self.offload.await_params(b)

    # -- accounting -------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for params and grads at a step boundary, and the gradient
        compression's state (optimizer separate)."""
        params = grads = 0
        for b in self.buckets:
            model = b.param_shard if self.zero_stage.shards_params else b.param_flat
            params += model.numel() * model.element_size()
            if self.separate_main and self.offload is None:
                params += b.main_shard.numel() * 4
            if b.grad_flat is not None:
                grads += b.grad_flat.numel() * 4
            if self.zero_stage.shards_grads:
                grads += b.grad_shard.numel() * 4
        compression = self.compressor.state_bytes() if self.compressor is not None else 0
        host = self.offload.host_bytes() if self.offload is not None else 0
        return {"params": params, "grads": grads, "compression": compression, "host": host}
