"""The plan of a job: memory per rank, FLOPs, tokens, communication and the pipeline bubble.

Nothing is allocated: the model is built on the meta device, everything else is arithmetic on
the layout. This file only adds up what each feature's file says it costs: the dense blocks
(:mod:`~megatronish.plan.dense`), mixtures of experts (:mod:`~megatronish.plan.moe`), recompute
(:mod:`~megatronish.plan.recompute`), the pipeline (:mod:`~megatronish.plan.pipeline`), context
parallelism (:mod:`~megatronish.plan.context_parallel`) and ZeRO / data parallelism
(:mod:`~megatronish.plan.data_parallel`). :func:`make_plan` plans one layout; the layout advisor
plans thousands of one model with one :class:`Planner`, which is fast because

- ``representative=True`` plans only the first, the second and the last stage. Stages between
  the first and the last hold the same chunks (an even layer split), so the same states and
  communication, and the fewest in-flight microbatches belong to the later ones, so the second
  stage has the largest peak of them (ZB-H1 holds ``r`` W back on stage ``r`` instead: where that
  outweighs the activations B frees, the last stage, which also holds the head, holds more than
  any between); ``peak_bytes`` and every listed stage equal the full plan's (tests compare them);
- each building block is computed once per distinct input (a dict per block, keyed by the layout
  fields it reads), e.g. states once per (tp, pp, vpp, dp, sp, ZeRO stage, stage);
- the in-flight peak of a pipeline stops changing after ``pp`` microbatches (``2 pp``
  interleaved or ZBV), so activations are planned with at most that many;
- meta chunks are built once per (tp, pp, vpp, sp, layer split, stage) and handed to the
  building blocks that read them (meta chunks hold no memory and are only read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.model.flops import active_parameters, count_parameters, flops_per_token
from megatronish.plan import context_parallel, data_parallel, dense, moe, pipeline, recompute
from megatronish.plan.data_parallel import StateBytes
from megatronish.plan.hardware import add_volumes
from megatronish.plan.layout import Layout
from megatronish.plan.rank_model import chunk_key, meta_chunks
from megatronish.spec import ModelSpec


@dataclass(frozen=True)
class ActivationPlan:
    per_layer: float  # bytes a layer keeps per microbatch under the recompute policy
    in_flight: float  # peak microbatches (in units of this rank's whole model part) alive
    saved_peak: int  # peak bytes kept for backward over the step
    workspace: int  # temporaries on top of the saved peak
    peak: int  # saved_peak + workspace


def activation_plan(spec: ModelSpec, layout: Layout, pp_rank: int) -> ActivationPlan:
    """Peak activation memory of a rank of pipeline stage ``pp_rank`` during a step: what each
    chunk's forward keeps (its blocks under the recompute policy, the embedding, the head) and,
    under a zero-bubble schedule, what each W keeps from its B, at the schedule's in-flight
    peak, plus the largest workspace (at the loss, or in a backward)."""
    layers = layout.chunk_layers(spec.num_layers)
    n_chunks = len(layers)
    flags = moe.block_flags(spec, layout)
    group_input = dense.hidden_bytes(spec, layout)

    def blocks(run: tuple, core: bool = True) -> int:
        return moe.blocks_bytes(spec, layout, run, core)

    def head(c: int) -> int:
        return dense.head_bytes(spec, layout) if c == n_chunks - 1 else 0

    sizes = {
        c: recompute.chunk_body(layout, layers[c], flags[c], blocks, group_input)
        + (dense.embedding_bytes(spec, layout) if c == 0 else 0)
        + head(c)
        for c in range(n_chunks)
    }
    # What a split backward's W keeps from its B (zero-bubble schedules; others never ask). The
    # first chunk's B runs its whole backward (its input takes no grad): its W keeps nothing.
    kept = {
        c: moe.blocks_weight_grad_bytes(spec, layout, flags[c] or (False,) * layers[c])
        + (dense.head_weight_grad_bytes(spec, layout) if c == n_chunks - 1 else 0)
        if c > 0
        else 0
        for c in range(n_chunks)
    }
    mine = layout.stage_chunks(pp_rank)
    rebuilt = {
        c: recompute.rebuild_workspace(layout, layers[c], flags[c], blocks, group_input)
        for c in mine
    }
    peak = pipeline.rank_peak_in_flight(layout, pp_rank, sizes, kept, rebuilt)
    # The peak is either at the loss (the last chunk's logits on top of everything kept) or in
    # the first layers' backward (the head's tensors freed, a recomputed group rebuilt).
    at_loss = dense.loss_workspace(spec, layout) if n_chunks - 1 in mine else 0
    in_backward = moe.backward_workspace(spec, layout) + max(rebuilt[c] - head(c) for c in mine)
    in_backward += dense.sp_workspace(spec, layout) + context_parallel.ring_workspace(spec, layout)
    work = max(at_loss, in_backward, 0) + pipeline.p2p_workspace(spec, layout)
    per_rank_part = sum(sizes[c] for c in mine)
    return ActivationPlan(
        per_layer=recompute.kept_per_layer(
            layout, lambda core: moe.mean_block_bytes(spec, layout, core), group_input
        ),
        in_flight=peak / per_rank_part if per_rank_part else 0.0,
        saved_peak=peak,
        workspace=work,
        peak=peak + work,
    )


@dataclass(frozen=True)
class StagePlan:
    """What every rank of one pipeline stage holds (tp and dp ranks of a stage are alike)."""

    pp_rank: int
    states: StateBytes
    activations: ActivationPlan
    optimizer_workspace: int  # temporaries of the update (one bucket's worth)
    comm: dict[str, tuple[int, int]]  # "group/op" -> (calls, bytes) per step
    compression_traffic: int = 0  # bytes the gradient compression reads and writes per step

    @property
    def step_extra(self) -> int:
        """Bytes a forward/backward adds to the states at its high-water mark: activations at
        their peak with what is gathered and the grads alive then, or ZeRO 2/3's full grads at
        their most in a backward, when the loss's workspace and a layer's saved activations
        are gone."""
        st, act = self.states, self.activations
        at_peak = st.params_step + st.grads_at_peak + act.peak
        saved = max(0, act.saved_peak - int(act.per_layer))
        in_backward = st.params_step + st.grads_step + saved
        return max(at_peak, in_backward)

    @property
    def peak(self) -> int:
        """Tensor bytes at the step's high-water mark (forward/backward or the update)."""
        during_update = self.states.total + self.optimizer_workspace
        return max(self.states.total + self.step_extra, during_update)


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    layout: Layout
    parameters: int  # every parameter (all experts)
    tokens_per_step: int
    model_flops_per_step: float  # 6N + 12Lsh per token (N: active weights; flops_per_token)
    hardware_flops_per_step: float  # + the forward work repeated by recompute
    bubble: float  # the schedule's idle share: (pp - 1) / (vpp m) for 1F1B; 0 without a pipeline
    stages: list[StagePlan] = field(default_factory=list)
    active_parameters: int = 0  # the parameters a token uses (top-k experts); dense: all

    @property
    def peak_bytes(self) -> int:
        """The largest per-rank tensor peak over stages."""
        return max(s.peak for s in self.stages)

    def fits(self, device_bytes: int, runtime_bytes: int) -> bool:
        return self.peak_bytes + runtime_bytes <= device_bytes

    def mfu_needed(self, step_time_s: float, peak_flops_per_device: float) -> float:
        """Model FLOPs utilisation a step of ``step_time_s`` would mean."""
        world = self.layout.world_size
        return self.model_flops_per_step / (step_time_s * peak_flops_per_device * world)


def stage_volumes(
    spec: ModelSpec, layout: Layout, pp_rank: int, chunks: list | None = None
) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """Every feature's ``{"group/op": (calls, bytes)}`` of one step on pipeline rank ``pp_rank``
    but the dp collectives (those need the rank's buckets), in the order the plan lists them:
    tp, cp, then (after dp) pp, the tied embedding, ep."""
    blocks = moe.rank_blocks(spec, layout, pp_rank)
    return (
        dense.tp_volume(spec, layout, pp_rank, chunks),
        moe.tp_extra_volume(spec, layout, blocks),
        context_parallel.cp_volume(spec, layout, pp_rank),
        moe.cp_counts_volume(spec, layout, blocks),
    ), (
        pipeline.pp_volume(spec, layout, pp_rank),
        pipeline.embedding_volume(spec, layout, pp_rank),
        moe.ep_volume(spec, layout, blocks),
    )


class Planner:
    """Plans of layouts of one model, sharing every building block (see the module docstring)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self._meta: dict = {}
        self._blocks: dict[str, dict] = {
            k: {} for k in ("states", "buckets", "units", "activations", "volumes")
        }
        self._parameters = count_parameters(spec)
        self._active = active_parameters(spec)
        self._flops_per_token = flops_per_token(spec)

    def _chunks(self, layout: Layout, pp_rank: int) -> list:
        key = chunk_key(layout, self.spec.num_layers, pp_rank)
        if key not in self._meta:
            self._meta[key] = meta_chunks(self.spec, layout, pp_rank)
        return self._meta[key]

    def _cached(self, block: str, key, compute):
        table = self._blocks[block]
        if key not in table:
            table[key] = compute()
        return table[key]

    def _stage(self, layout: Layout, pp_rank: int) -> StagePlan:
        spec = self.spec
        shape = layout.rank_key(spec.num_layers, pp_rank)
        run = (layout.micro_batch_size, layout.num_microbatches, recompute.policy(layout))
        chunks = self._chunks(layout, pp_rank)
        buckets = self._cached(
            "buckets",
            (shape, data_parallel.buckets_key(layout)),
            lambda: [data_parallel.chunk_buckets(c, layout) for c in chunks],
        )
        units = self._cached(
            "units",
            (shape, data_parallel.units_key(layout)),
            lambda: data_parallel.rank_units(layout, chunks),
        )
        st = self._cached(
            "states",
            (shape, data_parallel.states_key(layout)),
            lambda: data_parallel.state_bytes(spec, layout, pp_rank, chunks, buckets, units),
        )
        act = self._cached(
            "activations",
            (shape, layout.micro_batch_size, pipeline.walk_key(layout), recompute.policy(layout)),
            lambda: self._activations(layout, pp_rank),
        )
        before_dp, after_dp = self._cached(
            "volumes", (shape, run), lambda: stage_volumes(spec, layout, pp_rank, chunks)
        )
        dp = data_parallel.dp_volume(layout, buckets, units)
        return StagePlan(
            pp_rank=pp_rank,
            states=st,
            activations=act,
            optimizer_workspace=data_parallel.optimizer_workspace(layout, st),
            comm=add_volumes(*before_dp, dp, *after_dp),
            compression_traffic=data_parallel.compression_traffic(layout, buckets),
        )

    @staticmethod
    def _capped(layout: Layout) -> int:
        return pipeline.capped_microbatches(layout)

    def _activations(self, layout: Layout, pp_rank: int) -> ActivationPlan:
        m = self._capped(layout)
        capped = layout.with_(dp=1, global_batch_size=m * layout.micro_batch_size)
        return activation_plan(self.spec, capped, pp_rank)

    def plan(self, layout: Layout, representative: bool = False) -> Plan:
        """The plan of ``layout``: every pipeline stage, or the representative ones."""
        spec = self.spec
        tokens = layout.global_batch_size * spec.seq_length
        stages = [self._stage(layout, r) for r in pipeline.planned_stages(layout, representative)]
        hardware = self._flops_per_token + recompute.recompute_flops_per_token(spec, layout)
        return Plan(
            spec=spec,
            layout=layout,
            parameters=self._parameters,
            tokens_per_step=tokens,
            model_flops_per_step=self._flops_per_token * tokens,
            hardware_flops_per_step=hardware * tokens,
            bubble=pipeline.bubble(spec, layout),
            stages=stages,
            active_parameters=self._active,
        )


def make_plan(spec: ModelSpec, layout: Layout) -> Plan:
    """Plan every pipeline stage of ``layout`` for the model ``spec``."""
    return Planner(spec).plan(layout)
