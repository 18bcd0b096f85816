"""Plans of thousands of layouts of one model, fast: what the layout advisor screens with.

:func:`~megatronish.plan.estimate.make_plan` plans every pipeline stage and builds the stage's
model chunks on the meta device several times per stage (for its states, its buckets and its
sequence-parallel params); that is ~30 ms for a 7B model, and ~7,000 layouts of it run on 64
GPUs. :class:`PlanCache` returns the same numbers from the same building blocks
(``state_bytes``, ``activation_plan``, the ``*_volume`` functions), with four shortcuts:

- only representative stages are planned: the first, the second and the last. Stages between
  the first and the last hold the same chunks (an even layer split), so the same states and
  communication, and the fewest in-flight microbatches belong to the later ones, so the second
  stage has the largest peak of them. ``Plan.stages`` of a cached plan lists those stages;
  ``peak_bytes`` and every stage's communication equal ``make_plan``'s (tests compare them);
- each building block is computed once per distinct input (a dict per block, keyed by the layout
  fields it reads), e.g. states once per (tp, pp, vpp, dp, sp, ZeRO stage, stage);
- the in-flight peak of a pipeline stops changing after ``pp`` microbatches (``2 pp``
  interleaved: the schedule's warm-up is shorter), so activations are planned with at most that
  many;
- meta chunks are built once per (tp, pp, vpp, sp, layer split, stage) and handed to the
  building blocks that read them (meta chunks hold no memory and are only read).
"""

from __future__ import annotations

from megatronish.metrics import count_parameters, flops_per_token
from megatronish.model.spec import ModelSpec
from megatronish.pipeline.schedule import analytic_bubble
from megatronish.plan import comm, states
from megatronish.plan.activations import ActivationPlan, activation_plan
from megatronish.plan.estimate import (
    Plan,
    StagePlan,
    optimizer_workspace,
    recompute_flops_per_token,
)
from megatronish.plan.layout import Layout
from megatronish.plan.zero3_gather import chunk_units


def representative_stages(pp: int) -> list[int]:
    """The pipeline ranks a cached plan covers: first, second and last."""
    return sorted({0, min(1, pp - 1), pp - 1})


class PlanCache:
    """Plans of many layouts of one model (see the module docstring)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self._meta: dict = {}
        self._blocks: dict[str, dict] = {
            k: {} for k in ("states", "buckets", "units", "activations", "tp", "volumes")
        }
        self._parameters = count_parameters(spec)
        self._flops_per_token = flops_per_token(spec)

    def _chunks(self, layout: Layout, pp_rank: int) -> list:
        key = (layout.tp, layout.pp, layout.vpp, layout.sp,
               layout.chunk_layers(self.spec.num_layers), pp_rank)  # fmt: skip
        if key not in self._meta:
            self._meta[key] = states.meta_chunks(self.spec, layout, pp_rank)
        return self._meta[key]

    def _cached(self, block: str, key, compute):
        table = self._blocks[block]
        if key not in table:
            table[key] = compute()
        return table[key]

    def _stage(self, layout: Layout, pp_rank: int) -> StagePlan:
        spec = self.spec
        shape = (layout.tp, layout.pp, layout.vpp, layout.sp, layout.layers_per_chunk,
                 layout.precision, pp_rank)  # fmt: skip
        m, mbs = layout.num_microbatches, layout.micro_batch_size
        rc = (layout.recompute, layout.recompute_method, layout.recompute_num_layers)
        zero3_rc = rc if layout.zero_stage == 3 else None  # its gathered peak follows recompute
        layout_states = (layout.dp, layout.zero_stage, layout.bucket_size_mb,
                         layout.zero3_keep_gathered, zero3_rc)  # fmt: skip
        chunks = self._chunks(layout, pp_rank)
        st = self._cached(
            "states",
            (shape, layout_states),
            lambda: states.state_bytes(spec, layout, pp_rank, chunks),
        )
        per_unit = layout.zero_stage >= 2
        buckets = self._cached(
            "buckets",
            (shape, layout.dp, layout.bucket_size_mb, per_unit),
            lambda: [states.chunk_buckets(c, layout) for c in chunks],
        )
        units = None
        if layout.zero_stage == 3:
            units = self._cached(
                "units",
                (shape, layout.dp, layout.bucket_size_mb, rc),
                lambda: [chunk_units(c, layout, states.tied_rule(c, layout)) for c in chunks],
            )
        act = self._cached("activations", (shape, mbs, self._capped(layout), rc),
                           lambda: self._activations(layout, pp_rank))  # fmt: skip
        volume: dict[str, tuple[int, int]] = {}
        volume.update(
            self._cached(
                "tp", (shape, mbs, m, rc), lambda: comm.tp_volume(spec, layout, pp_rank, chunks)
            )
        )
        volume.update(comm.dp_volume(layout, buckets, units))
        volume.update(
            self._cached(
                "volumes",
                (shape, mbs, m),
                lambda: {
                    **comm.pp_volume(spec, layout, pp_rank),
                    **comm.embedding_volume(spec, layout, pp_rank),
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

    def plan(self, layout: Layout) -> Plan:
        """``make_plan(spec, layout)`` for the representative stages."""
        spec = self.spec
        tokens = layout.global_batch_size * spec.seq_length
        bubble = 0.0
        if layout.pp > 1:
            bubble = analytic_bubble(layout.pp, layout.vpp, layout.num_microbatches)
        stages = [self._stage(layout, r) for r in representative_stages(layout.pp)]
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
        )
