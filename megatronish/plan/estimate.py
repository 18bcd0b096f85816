"""A plan of one job: memory per rank, FLOPs, tokens, communication and the pipeline bubble.

Nothing is allocated: the model is built on the meta device, everything else is arithmetic on
the layout (see :mod:`~megatronish.plan.states`, :mod:`~megatronish.plan.activations` and
:mod:`~megatronish.plan.comm` for what each number counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.metrics import count_parameters, flops_per_token, matmul_params
from megatronish.model.spec import ModelSpec
from megatronish.pipeline.schedule import analytic_bubble
from megatronish.plan.activations import ActivationPlan, activation_plan
from megatronish.plan.comm import dp_volume, embedding_volume, pp_volume, tp_volume
from megatronish.plan.layout import Layout
from megatronish.plan.states import (
    FP32,
    StateBytes,
    chunk_buckets,
    meta_chunks,
    state_bytes,
    tied_rule,
)
from megatronish.plan.zero3_gather import chunk_units


@dataclass(frozen=True)
class StagePlan:
    """What every rank of one pipeline stage holds (tp and dp ranks of a stage are alike)."""

    pp_rank: int
    states: StateBytes
    activations: ActivationPlan
    optimizer_workspace: int  # temporaries of the update (one bucket's worth)
    comm: dict[str, tuple[int, int]]  # "group/op" -> (calls, bytes) per step

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
    parameters: int
    tokens_per_step: int
    model_flops_per_step: float  # 6N + 12Lsh per token (metrics.flops_per_token)
    hardware_flops_per_step: float  # + the forward work repeated by recompute
    bubble: float  # (pp - 1) / (vpp m); 0 without a pipeline
    stages: list[StagePlan] = field(default_factory=list)

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


def recompute_flops_per_token(spec: ModelSpec, layout: Layout) -> float:
    """Extra forward FLOPs per token that recompute adds (hardware, not model, FLOPs)."""
    L, s, h = spec.num_layers, spec.seq_length, spec.hidden_size
    if layout.recompute == "selective":
        return 4.0 * L * s * h  # the attention scores and the weighted sum, forward only
    if layout.recompute == "full":
        layer_weights = matmul_params(spec) - spec.padded_vocab_size * h
        share = 1.0
        if layout.recompute_method == "block":
            per_chunk = layout.chunk_layers(L)
            share = sum(min(layout.recompute_num_layers, n) for n in per_chunk) / L
        return share * (2.0 * layer_weights + 4.0 * L * s * h)
    return 0.0


def optimizer_workspace(spec: ModelSpec, layout: Layout, states: StateBytes) -> int:
    """AdamW's ``sqrt(v)`` temporary of the largest owned bucket slice."""
    owned = states.largest_bucket_numel // (1 if layout.zero_stage == 0 else layout.dp)
    return owned * FP32


def plan_stage(spec: ModelSpec, layout: Layout, pp_rank: int) -> StagePlan:
    chunks = meta_chunks(spec, layout, pp_rank)
    states = state_bytes(spec, layout, pp_rank, chunks)
    buckets = [chunk_buckets(c, layout) for c in chunks]
    units = None
    if layout.zero_stage == 3:
        units = [chunk_units(c, layout, tied_rule(c, layout)) for c in chunks]
    comm: dict[str, tuple[int, int]] = {}
    for part in (
        tp_volume(spec, layout, pp_rank, chunks),
        dp_volume(layout, buckets, units),
        pp_volume(spec, layout, pp_rank),
        embedding_volume(spec, layout, pp_rank),
    ):
        comm.update(part)
    return StagePlan(
        pp_rank=pp_rank,
        states=states,
        activations=activation_plan(spec, layout, pp_rank),
        optimizer_workspace=optimizer_workspace(spec, layout, states),
        comm=comm,
    )


def make_plan(spec: ModelSpec, layout: Layout) -> Plan:
    """Plan every pipeline stage of ``layout`` for the model ``spec``."""
    tokens = layout.global_batch_size * spec.seq_length
    per_token = flops_per_token(spec)
    bubble = 0.0
    if layout.pp > 1:
        bubble = analytic_bubble(layout.pp, layout.vpp, layout.num_microbatches)
    return Plan(
        spec=spec,
        layout=layout,
        parameters=count_parameters(spec),
        tokens_per_step=tokens,
        model_flops_per_step=per_token * tokens,
        hardware_flops_per_step=(per_token + recompute_flops_per_token(spec, layout)) * tokens,
        bubble=bubble,
        stages=[plan_stage(spec, layout, r) for r in range(layout.pp)],
    )
