"""The plan of a job: memory per rank, FLOPs, tokens, communication and the pipeline bubble.

Nothing is allocated: the model is built on the meta device, everything else is arithmetic on
the layout (see :mod:`~megatronish.plan.states`, :mod:`~megatronish.plan.activations` and
:mod:`~megatronish.plan.comm` for what each number counts). :func:`make_plan` plans one layout;
the layout advisor plans thousands of one model with one :class:`Planner`, which is fast because

- ``representative=True`` plans only the first, the second and the last stage. Stages between
  the first and the last hold the same chunks (an even layer split), so the same states and
  communication, and the fewest in-flight microbatches belong to the later ones, so the second
  stage has the largest peak of them; ``peak_bytes`` and every listed stage equal the full plan's
  (tests compare them);
- each building block is computed once per distinct input (a dict per block, keyed by the layout
  fields it reads), e.g. states once per (tp, pp, vpp, dp, sp, ZeRO stage, stage);
- the in-flight peak of a pipeline stops changing after ``pp`` microbatches (``2 pp``
  interleaved: the schedule's warm-up is shorter), so activations are planned with at most that
  many;
- meta chunks are built once per (tp, pp, vpp, sp, layer split, stage) and handed to the
  building blocks that read them (meta chunks hold no memory and are only read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.data_parallel.grads import tied_rule
from megatronish.model.flops import (
    active_parameters,
    count_parameters,
    flops_per_token,
    matmul_params,
)
from megatronish.model.spec import ModelSpec
from megatronish.pipeline.schedule import analytic_bubble
from megatronish.plan import comm, moe
from megatronish.plan.activations import ActivationPlan, activation_plan
from megatronish.plan.layout import Layout
from megatronish.plan.states import (
    FP32,
    StateBytes,
    chunk_buckets,
    meta_chunks,
    state_bytes,
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
    parameters: int  # every parameter (all experts)
    tokens_per_step: int
    model_flops_per_step: float  # 6N + 12Lsh per token (N: active weights; flops_per_token)
    hardware_flops_per_step: float  # + the forward work repeated by recompute
    bubble: float  # (pp - 1) / (vpp m); 0 without a pipeline
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
    zero = layout.zero_stage
    return (states.largest_bucket_numel if zero == 0 else states.largest_shard_numel) * FP32


def representative_stages(pp: int) -> list[int]:
    """The pipeline ranks a cached plan covers: first, second and last."""
    return sorted({0, min(1, pp - 1), pp - 1})


class Planner:
    """Plans of layouts of one model, sharing every building block (see the module docstring)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self._meta: dict = {}
        self._blocks: dict[str, dict] = {
            k: {} for k in ("states", "buckets", "units", "activations", "tp", "volumes")
        }
        self._parameters = count_parameters(spec)
        self._active = active_parameters(spec)
        self._flops_per_token = flops_per_token(spec)

    def _chunks(self, layout: Layout, pp_rank: int) -> list:
        key = (
            layout.tp,
            layout.pp,
            layout.vpp,
            layout.sp,
            layout.chunk_layers(self.spec.num_layers),
            pp_rank,
            layout.ep,
        )
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
        shape = (
            layout.tp,
            layout.cp,
            layout.pp,
            layout.vpp,
            layout.sp,
            layout.layers_per_chunk,
            layout.precision,
            pp_rank,
            layout.ep,
        )
        m, mbs = layout.num_microbatches, layout.micro_batch_size
        rc = (layout.recompute, layout.recompute_method, layout.recompute_num_layers)
        zero3_rc = rc if layout.zero_stage == 3 else None  # its gathered peak follows recompute
        # zero 2/3: the full grads alive at the activation peak depend on full recompute
        full = layout.zero_stage >= 2 and layout.recompute == "full"
        layout_states = (
            layout.dp_cp,
            layout.zero_stage,
            layout.bucket_size_mb,
            layout.zero3_keep_gathered,
            zero3_rc,
            full,
        )
        chunks = self._chunks(layout, pp_rank)
        st = self._cached(
            "states",
            (shape, layout_states),
            lambda: state_bytes(spec, layout, pp_rank, chunks),
        )
        per_unit = layout.zero_stage >= 2
        buckets = self._cached(
            "buckets",
            (shape, layout.dp_cp, layout.bucket_size_mb, per_unit),
            lambda: [chunk_buckets(c, layout) for c in chunks],
        )
        units = None
        if layout.zero_stage == 3:
            units = self._cached(
                "units",
                (shape, layout.dp_cp, layout.bucket_size_mb, rc),
                lambda: [
                    chunk_units(c, layout, tied_rule(c.spec.tie_embeddings, layout.pp))
                    for c in chunks
                ],
            )
        act = self._cached(
            "activations",
            (shape, mbs, self._capped(layout), rc),
            lambda: self._activations(layout, pp_rank),
        )
        volume: dict[str, tuple[int, int]] = {}
        volume.update(
            self._cached(
                "tp", (shape, mbs, m, rc), lambda: comm.tp_volume(spec, layout, pp_rank, chunks)
            )
        )
        volume.update(comm.cp_volume(spec, layout, pp_rank))
        volume.update(comm.dp_volume(layout, buckets, units))
        volume.update(
            self._cached(
                "volumes",
                (shape, mbs, m, rc),
                lambda: {
                    **comm.pp_volume(spec, layout, pp_rank),
                    **comm.embedding_volume(spec, layout, pp_rank),
                    **moe.ep_volume(spec, layout, moe.rank_blocks(spec, layout, pp_rank)),
                },
            )
        )
        return StagePlan(
            pp_rank=pp_rank,
            states=st,
            activations=act,
            optimizer_workspace=optimizer_workspace(spec, layout, st),
            comm=volume,
        )

    @staticmethod
    def _capped(layout: Layout) -> int:
        """Microbatches that give the same in-flight peak as the layout's: 1F1B's warm-up holds
        at most pp of them, the interleaved one's under 2 pp."""
        return min(layout.num_microbatches, layout.pp * (1 if layout.vpp == 1 else 2))

    def _activations(self, layout: Layout, pp_rank: int) -> ActivationPlan:
        m = self._capped(layout)
        capped = layout.with_(dp=1, global_batch_size=m * layout.micro_batch_size)
        return activation_plan(self.spec, capped, pp_rank)

    def plan(self, layout: Layout, representative: bool = False) -> Plan:
        """The plan of ``layout``: every pipeline stage, or the representative ones."""
        spec = self.spec
        tokens = layout.global_batch_size * spec.seq_length
        bubble = 0.0
        if layout.pp > 1:
            bubble = analytic_bubble(layout.pp, layout.vpp, layout.num_microbatches)
        ranks = representative_stages(layout.pp) if representative else range(layout.pp)
        stages = [self._stage(layout, r) for r in ranks]
        hardware = self._flops_per_token + recompute_flops_per_token(spec, layout)
        return Plan(
            spec=spec,
            layout=layout,
            parameters=self._parameters,
            tokens_per_step=tokens,
            model_flops_per_step=self._flops_per_token * tokens,
            hardware_flops_per_step=hardware * tokens,
            bubble=bubble,
            stages=stages,
            active_parameters=self._active,
        )


def make_plan(spec: ModelSpec, layout: Layout) -> Plan:
    """Plan every pipeline stage of ``layout`` for the model ``spec``."""
    return Planner(spec).plan(layout)
