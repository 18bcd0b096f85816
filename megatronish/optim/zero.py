"""Data parallelism with ZeRO stages 0-3 over bucketed flat buffers.

- 0: grads all-reduced (averaged) over dp; every rank updates every parameter.
- 1: grads reduce-scattered; Adam moments only for this rank's shard; params all-gathered.
- 2: as 1, and the full grad buffer exists only while accumulating (freed after reduction).
- 3: as 2, and params are kept only as shards: a chunk's full params are gathered before its
  forward and again before its backward and released after each (or kept for the whole step
  with ``keep_gathered``).

Precision (Megatron-LM's mixed-precision recipe): the model's params are ``param_dtype`` (bf16
on GPUs), so activations, sequence-parallel collectives and pipeline messages are bf16 too. The
optimizer updates fp32 *main* params (only this rank's shard under ZeRO >= 1), which are cast
into the model's params after every step; grads are accumulated in fp32 ``main_grad`` buffers,
and reduced over dp in ``reduce_dtype`` (fp32 by default). With fp32 params the main params are
the params themselves and nothing is copied.

A bucket's reduction starts from a post-accumulate-grad hook as soon as every param in it has
received the grads of all microbatches of the step, so nothing is communicated during earlier
microbatches and reductions overlap the rest of backward. Buckets holding params that need a
model-parallel sum first (sequence-parallel replicas, tied embeddings) are reduced at the end.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from megatronish.distributed.comm import all_gather_into, all_reduce, reduce_scatter_into
from megatronish.distributed.topology import Topology
from megatronish.optim.buckets import Bucket, plan_buckets
from megatronish.optim.grads import counts_in_norm, flat_all_reduce
from megatronish.timers import Timers


def _resize(t: torch.Tensor, numel: int) -> None:
    t.untyped_storage().resize_(numel * t.element_size())


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
    ):
        self.chunks, self.topo, self.stage = chunks, topo, stage
        self.keep_gathered = keep_gathered
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.separate_main = param_dtype != torch.float32
        self.timers = timers or Timers.off()  # param_gather, grad_reduce_wait; profiler ranges
        dp = topo.dp_group
        tied_names = self._tied_names(chunks, topo)
        self.buckets_of: list[list[Bucket]] = []
        for chunk in chunks:
            buckets = plan_buckets(
                list(chunk.named_parameters()), int(bucket_mb * 2**20), dp.size, dp.rank,
                lambda n, p, tied=tied_names: n in tied or bool(getattr(p, "tied_to", None)),
                topo.device,
            )  # fmt: skip
            for b in buckets:
                self._allocate(b)
            self.buckets_of.append(buckets)
        self.gathered = [stage < 3] * len(chunks)

    @property
    def buckets(self) -> list[Bucket]:
        return [b for bs in self.buckets_of for b in bs]

    @staticmethod
    def _tied_names(chunks, topo: Topology) -> set[str]:
        tie = bool(chunks) and chunks[0].spec.tie_embeddings and topo.pp > 1
        return {"embedding.word.weight"} if tie else set()

    # -- storage ----------------------------------------------------------------------------
    def _owned(self, b: Bucket) -> tuple[int, int]:
        return (0, b.numel) if self.stage == 0 else b.shard_range

    @torch.no_grad()
    def _allocate(self, b: Bucket) -> None:
        main = torch.zeros(b.numel, device=b.device)  # fp32 values as initialised
        for _, p, view in b.views(main):
            view.copy_(p.data)
        lo, hi = self._owned(b)
        flat = main.to(self.param_dtype) if self.separate_main else main
        for _, p, view in b.views(flat):
            p.data = view
        b.param_flat = flat
        b.param_shard = flat[lo:hi] if self.stage < 3 else flat[lo:hi].clone()
        b.main_shard = main[lo:hi].clone() if self.separate_main else b.param_shard
        if self.stage == 3:
            _resize(flat, 0)  # params live as shards; gathered on demand
        if self.stage < 2:
            self._new_grad_buffer(b)
        if self.stage >= 2:  # the reduced shard outlives the full buffer
            b.grad_shard = torch.zeros(hi - lo, device=b.device)
        b.decay_ranges = b.ranges(lambda n, p: not getattr(p, "no_weight_decay", False), lo, hi)
        b.norm_ranges = b.ranges(lambda n, p: counts_in_norm(n, p, self.topo), lo, hi)
        for _, p in b.params:
            p.register_post_accumulate_grad_hook(self._make_hook(b))

    def _new_grad_buffer(self, b: Bucket) -> None:
        b.grad_flat = torch.zeros(b.numel, device=b.device)
        for _, p, view in b.views(b.grad_flat):
            p.main_grad = view
            if not self.separate_main:  # autograd accumulates in place (no extra copy)
                p.grad = view
        if self.stage == 1:  # reduced in place into this rank's slice
            lo, hi = b.shard_range
            b.grad_shard = b.grad_flat[lo:hi]

    # -- zero 3 parameter gathering ----------------------------------------------------------
    @torch.no_grad()
    def gather(self, chunk_index: int) -> None:
        """Materialise a chunk's full params (zero 3)."""
        if self.stage < 3 or self.gathered[chunk_index]:
            return
        with self.timers.region("param_gather", "all-gather params chunk{}", chunk_index):
            for b in self.buckets_of[chunk_index]:
                _resize(b.param_flat, b.numel)
                all_gather_into(b.param_flat, b.param_shard, self.topo.dp_group)
        self.gathered[chunk_index] = True

    def release(self, chunk_index: int, end_of_step: bool = False) -> None:
        """Free a chunk's full params (zero 3) unless they are kept for the step."""
        if self.stage < 3 or not self.gathered[chunk_index]:
            return
        if self.keep_gathered and not end_of_step:
            return
        for b in self.buckets_of[chunk_index]:
            _resize(b.param_flat, 0)
        self.gathered[chunk_index] = False

    # -- gradients --------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """Zero grads and arm the hooks for a step of ``num_microbatches``."""
        for b in self.buckets:
            if b.grad_flat is None:
                self._new_grad_buffer(b)
            else:
                b.grad_flat.zero_()
            b.pending = len(b.params) * num_microbatches
            b.work = None

    def _make_hook(self, b: Bucket):
        # The hook is held in C++ by the parameter, out of the garbage collector's sight: strong
        # references back to this object and the bucket (which holds the parameter) would keep
        # the model, its buffers and any pending work handle alive after the run.
        owner, bucket = weakref.ref(self), weakref.ref(b)

        def hook(p: nn.Parameter) -> None:
            zero, b = owner(), bucket()
            if zero is None or b is None:
                return
            if p.grad.dtype != p.main_grad.dtype:  # a bf16 microbatch grad, summed in fp32
                p.main_grad.add_(p.grad)
                p.grad = None
            elif p.grad.data_ptr() != p.main_grad.data_ptr():
                # Autograd replaced the view with a new tensor holding the accumulated grad.
                p.main_grad.copy_(p.grad)
                p.grad = p.main_grad
            b.pending -= 1
            if b.pending == 0 and not b.late:
                zero._launch(b)

        return hook

    def _launch(self, b: Bucket, async_op: bool = True) -> None:
        dp = self.topo.dp_group
        full, out = b.grad_flat, b.grad_shard
        if self.reduce_dtype != full.dtype and dp.size > 1:  # reduced in a narrower dtype
            full = b.extra["wire"] = full.to(self.reduce_dtype)
            if self.stage > 0:
                out = b.extra["wire_out"] = full.new_empty(b.shard_size)
        if self.stage == 0:
            with self.timers.region(None, "all-reduce grads"):
                work = all_reduce(full, dp, async_op=async_op)
        else:
            with self.timers.region(None, "reduce-scatter grads"):
                work = reduce_scatter_into(out, full, dp, async_op=async_op)
        b.work = work if async_op else None
        b.extra["launched"] = True

    def finish_reduction(self) -> None:
        """Wait for every reduction; sum late buckets over tp / the embedding group first."""
        with self.timers.region("grad_reduce_wait", "grad reduction wait"):
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        for b in self.buckets:
            if not b.late and not b.extra.pop("launched", False):
                self._launch(b)
        late = [b for b in self.buckets if b.late]
        sp = [
            p.main_grad for b in late for _, p in b.params if getattr(p, "sequence_parallel", False)
        ]
        flat_all_reduce(sp, self.topo.tp_group)
        tied = [
            p.main_grad
            for b in late
            for n, p in b.params
            if n in self._tied_names(self.chunks, self.topo) or getattr(p, "tied_to", None)
        ]
        flat_all_reduce(tied, self.topo.embedding_group)  # fmt: skip
        for b in late:
            b.extra.pop("launched", None)
            self._launch(b, async_op=False)
        scale = 1.0 / self.topo.dp
        for b in self.buckets:
            work, b.work = b.work, None  # not kept when the wait fails (it holds its group)
            if work is not None:
                with self.timers.region(None, "wait grads"):
                    work.wait()
            wire, wire_out = b.extra.pop("wire", None), b.extra.pop("wire_out", None)
            if wire is not None:
                self.owned_grad(b).copy_(wire if wire_out is None else wire_out)
            self.owned_grad(b).mul_(scale)
            if self.stage >= 2:  # keep only the reduced shard
                b.grad_flat = None
                for _, p in b.params:
                    p.main_grad = p.grad = None

    def owned_grad(self, b: Bucket) -> torch.Tensor:
        return b.grad_flat if self.stage == 0 else b.grad_shard

    # -- norm, clip, update -----------------------------------------------------------------
    def grad_norm(self, local_fault: bool = False) -> torch.Tensor:
        """Global L2 norm: every parameter element counted exactly once across tp, pp, dp.

        ``local_fault``: this rank saw a non-finite value elsewhere (its loss); the norm then comes
        out nan on every rank, so all ranks skip the step together without another collective.
        """
        sq = torch.zeros((), device=self.topo.device)
        if local_fault:
            sq += float("nan")
        for b in self.buckets:
            grad = self.owned_grad(b)
            for lo, hi in b.norm_ranges:
                sq += grad[lo:hi].square().sum()  # torch's cascade sum keeps round-off small
        group = self.topo.mp_group if self.stage == 0 else self.topo.world_group
        with self.timers.region(None, "grad norm all-reduce"):
            all_reduce(sq, group)
        return sq.sqrt()

    def optimizer_shards(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(fp32 main params, fp32 grads, decay ranges)`` of this rank's owned part."""
        return [(b.main_shard, self.owned_grad(b), b.decay_ranges) for b in self.buckets]

    def model_load_targets(self) -> list[tuple[torch.Tensor, int, int]]:
        """Where a checkpoint's parameter values go, per bucket: ``(dest, lo, hi)`` for
        elements ``[lo, hi)`` of the bucket; call :meth:`params_from_main` after loading."""
        if self.separate_main:
            return [(b.main_shard, *self._owned(b)) for b in self.buckets]
        if self.stage < 3:  # every rank holds the whole bucket's params
            return [(b.param_flat, 0, b.numel) for b in self.buckets]
        return [(b.param_shard, *b.shard_range) for b in self.buckets]

    @torch.no_grad()
    def params_from_main(self) -> None:
        """Cast the main params into the model's params and make them whole (after a load)."""
        if self.separate_main:
            self._cast_main()
            self._gather_updated()

    @torch.no_grad()
    def _cast_main(self) -> None:
        for b in self.buckets:
            b.param_shard.copy_(b.main_shard)

    @torch.no_grad()
    def after_update(self) -> None:
        """Make every rank's params whole again (zero 1/2); zero 3 keeps shards."""
        if self.separate_main:
            self._cast_main()
        self._gather_updated()
        self.release_all()

    def release_all(self) -> None:
        """End of a step or an evaluation: zero 3 frees every gathered chunk (kept ones too)."""
        if self.stage == 3:
            for i in range(len(self.chunks)):
                self.release(i, end_of_step=True)

    def _gather_updated(self) -> None:
        if self.stage in (1, 2):
            with self.timers.region("param_gather", "all-gather params"):
                for b in self.buckets:
                    all_gather_into(b.param_flat, b.param_shard, self.topo.dp_group)  # in place

    # -- accounting -------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for params and grads at a step boundary (optimizer separate)."""
        params = grads = 0
        for b in self.buckets:
            model = b.param_shard if self.stage == 3 else b.param_flat
            params += model.numel() * model.element_size()
            if self.separate_main:
                params += b.main_shard.numel() * 4
            if b.grad_flat is not None:
                grads += b.grad_flat.numel() * 4
            if self.stage >= 2:
                grads += b.grad_shard.numel() * 4
        return {"params": params, "grads": grads}
