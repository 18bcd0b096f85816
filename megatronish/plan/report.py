"""What the planner prints and writes: the plan of a layout, the advisor's table, and an advised
layout as a Hydra ``parallel`` group file with the command line to run it.

The group file holds the ``parallel`` keys (dp stays null: derived from the world size). The
layout's trainer keys (micro batch size, recompute) belong to another group, so the file's header
lists them and :func:`run_overrides` adds them to the command line. Experiments are applied after
the config groups, so an experiment that sets ``parallel`` keys itself (``gpt_1b``, ``gpt_7b``)
would override ``parallel=NAME``; :func:`run_overrides` composes the command to check, and falls
back to explicit ``parallel.*`` overrides when the group file would be overridden.
"""

from __future__ import annotations

from pathlib import Path

from megatronish.config import compose
from megatronish.plan.advisor import Advice, Ranked, reason
from megatronish.plan.devices import GiB
from megatronish.plan.estimate import Plan
from megatronish.plan.layout import Layout
from megatronish.plan.matmul_efficiency import model_efficiency
from megatronish.plan.step_time import TERMS, Hardware
from megatronish.plan.vocab import PlannedVocab
from megatronish.spec import ModelSpec

# -- the plan of one layout


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _si(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} "


def plan_report(
    plan: Plan,
    *,
    vocab: PlannedVocab | None = None,
    device_bytes: int | None = None,
    runtime_bytes: int = 0,
    peak_flops: float | None = None,
    step_time_s: float | None = None,
) -> str:
    """The plan as printed by ``python -m megatronish.plan`` (``vocab``: where its vocabulary
    comes from)."""
    lay, spec = plan.layout, plan.spec
    lines = [
        f"model: {spec.arch}, {plan.parameters:,} parameters ({spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_heads} heads / {spec.num_kv_heads} kv, ffn "
        f"{spec.ffn_hidden_size}, seq {spec.seq_length})",
        vocab_line(spec, vocab),
        *_moe_lines(plan),
        f"layout: {lay.describe()} on {lay.world_size} ranks, {lay.num_microbatches} microbatches "
        f"of {lay.micro_batch_size} per step, {lay.precision}",
        f"tokens per step: {plan.tokens_per_step:,}",
        f"model FLOPs per step: {plan.model_flops_per_step:.3e} "
        f"(with recompute: {plan.hardware_flops_per_step:.3e}){_documents_note(spec)}",
        f"pipeline bubble: {plan.bubble:.1%} of compute{_schedule_note(lay)}",
        "",
        "per rank (GiB)  | params | grads | optimizer | states | activations (in flight) | peak",
    ]
    for st in plan.stages:
        s, a = st.states, st.activations
        extra = s.params_step + s.grads_step
        states = f"{s.total / GiB:.2f}" + (f" +{extra / GiB:.2f} in step" if extra else "")
        lines.append(
            f"pp stage {st.pp_rank:<5} | {s.params / GiB:6.2f} | {s.grads / GiB:5.2f} | "
            f"{s.optimizer / GiB:9.2f} | {states} | {a.peak / GiB:.2f} ({a.in_flight:.2f} "
            f"microbatches) | {st.peak / GiB:.2f}"
        )
    if spec.moe is not None:
        held = ", ".join(f"stage {st.pp_rank} {st.states.experts / GiB:.2f}" for st in plan.stages)
        lines.append(f"of the states, experts' params, grads and optimizer (GiB): {held}")
    lines += ["", "communication per step per rank (tensor bytes handed to the collective):"]
    for st in plan.stages:
        parts = [f"{k} {_si(b)}B in {c}" for k, (c, b) in sorted(st.comm.items())]
        lines.append(f"  pp stage {st.pp_rank}: " + ("; ".join(parts) or "none"))
    if device_bytes:
        need = plan.peak_bytes + runtime_bytes
        verdict = "fits" if need <= device_bytes else "does NOT fit"
        lines += [
            "",
            f"memory: peak {gib(plan.peak_bytes)} + runtime {gib(runtime_bytes)} = {gib(need)} "
            f"per rank, device {gib(device_bytes)}: {verdict}",
        ]
    if peak_flops:
        lines.append(f"peak: {_si(peak_flops)}FLOP/s per device")
        if step_time_s:
            mfu = plan.mfu_needed(step_time_s, peak_flops)
            lines.append(f"a {step_time_s:g} s step needs {mfu:.1%} MFU")
        for mfu in (0.3, 0.4, 0.5):
            t = plan.model_flops_per_step / (mfu * peak_flops * lay.world_size)
            lines.append(
                f"  at {mfu:.0%} MFU: {t:.2f} s per step, {plan.tokens_per_step / t:,.0f} tokens/s"
            )
    return "\n".join(lines)


def _documents_note(spec: ModelSpec) -> str:
    """What attention is counted over when document masks shorten it."""
    if spec.attended_keys is None:
        return ""
    return (
        f"; attention within documents: {spec.attended_keys:.0f} keys per token on average "
        f"(of seq {spec.seq_length})"
    )


def _schedule_note(layout: Layout) -> str:
    """`` (1f1b schedule)``: the pipeline schedule the bubble is of ("" without a pipeline)."""
    return f" ({layout.schedule} schedule)" if layout.pp > 1 else ""


def vocab_line(spec: ModelSpec, vocab: PlannedVocab | None) -> str:
    """The vocabulary planned with, and where it comes from when known."""
    if vocab is not None:
        return vocab.line()
    return f"vocab: {spec.vocab_size}, padded to {spec.padded_vocab_size}"


def _moe_lines(plan: Plan) -> list[str]:
    """Active and total parameters, and how the experts are split (mixture of experts only)."""
    spec, lay = plan.spec, plan.layout
    moe = spec.moe
    if moe is None:
        return []
    blocks = moe.num_moe_layers(spec.num_layers)
    shared = f" + {moe.shared_experts} shared" if moe.shared_experts else ""
    return [
        f"mixture of experts: {plan.active_parameters:,} active of {plan.parameters:,} total "
        f"parameters per token; {blocks} of {spec.num_layers} blocks with {moe.num_experts} "
        f"experts{shared} (top-{moe.top_k}, expert ffn {moe.ffn_hidden_size}); "
        f"{moe.num_experts // lay.ep} experts per rank (ep={lay.ep}), replicated over "
        f"edp={lay.edp} ranks"
    ]


# -- the advisor's table


def hardware_line(hw: Hardware, world_size: int, device_bytes: int, runtime_bytes: int) -> str:
    """The inputs of the model in one sentence."""
    nodes = -(-world_size // hw.gpus_per_node)
    where = (
        f"{hw.shared_cores:g} shared cores"
        if hw.shared_cores
        else f"{nodes} node(s) of {hw.gpus_per_node}"
    )
    return (
        f"{world_size} ranks on {where}; {device_bytes / GiB:.2f} GiB per device "
        f"(runtime {runtime_bytes / GiB:.2f} GiB); {hw.peak_flops / 1e12:g} TFLOP/s peak, "
        f"matmuls at up to {hw.efficiency:.0%} of it (memory {hw.memory_bw / 1e9:g} GB/s); "
        f"intra-node {hw.intra_node_bw / 1e9:g} GB/s, inter-node "
        f"{hw.inter_node_bw / 1e9:g} GB/s, latency {hw.latency_s * 1e6:g} us"
    )


def _terms(moe: bool) -> tuple[str, ...]:
    """The step-time terms the table shows (the all-to-all only for a mixture of experts)."""
    return TERMS if moe else tuple(k for k in TERMS if k != "ep")


def _row(i: int, r: Ranked, nxt: Ranked | None, hw: Hardware) -> list[str]:
    lay, t = r.layout, r.time
    mfu = r.plan.model_flops_per_step / (t.total * hw.peak_flops * lay.world_size)
    eff = model_efficiency(r.plan.spec, lay, hw)
    terms = [f"{t.terms()[k]:.3f}" for k in _terms(r.plan.spec.moe is not None)]
    return [
        str(i),
        lay.describe(),
        f"{t.total:.3f}",
        f"{mfu:.1%}",
        f"{eff:.1%}",
        f"{r.plan.peak_bytes / GiB:.1f}",
        *terms,
        reason(r, nxt, hw),
    ]


def columns(moe: bool = False) -> list[str]:
    """The table's columns: "eff" is the efficiency of the model's FLOPs at the layout's matmul
    shapes (:func:`~megatronish.plan.matmul_efficiency.model_efficiency`)."""
    terms = (f"{k} s" for k in _terms(moe))
    return ["#", "layout", "step s", "MFU", "eff", "peak GiB", *terms, "why"]


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table with padded columns (readable as plain text too)."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])


def advice_table(advice: Advice, hw: Hardware, top: int) -> str:
    """The top ``top`` rows (one per (tp, cp, pp), fastest first)."""
    best = advice.best_of_each_shape()
    rows = [
        _row(i + 1, r, best[i + 1] if i + 1 < len(best) else None, hw)
        for i, r in enumerate(best[:top])
    ]
    return markdown(columns(_is_moe(advice)), rows)


def _is_moe(advice: Advice) -> bool:
    return any(r.plan.spec.moe is not None for r in advice.ranked)


def advice_report(
    advice: Advice,
    hw: Hardware,
    top: int,
    world_size: int,
    device_bytes: int,
    runtime: int,
    vocab: PlannedVocab | None = None,
) -> str:
    """What ``python -m megatronish.plan ... advise=true`` prints (``vocab``: the vocabulary
    planned with, and where it comes from)."""
    best = advice.best_of_each_shape()
    skipped = advice.valid - advice.planned
    shape = "tp/cp/pp/ep" if _is_moe(advice) else "tp/cp/pp"
    spec = advice.ranked[0].plan.spec
    lines = [
        vocab_line(spec, vocab),
        hardware_line(hw, world_size, device_bytes, runtime),
        f"{advice.valid} valid layouts; {advice.planned} planned ({skipped} could not reach the "
        f"top {top}), {advice.too_big} of them do not fit, {len(advice.ranked)} do.",
        *(
            [
                "No layout fits with its optimizer on the device: these keep the fp32 main "
                "params, Adam moments and update on the host (parallel.optimizer_offload=true)."
            ]
            if advice.offloaded
            else []
        ),
        f"Fastest layout of each {shape} ({min(top, len(best))} of {len(best)} shown); the "
        "terms add up to the step; 'why' compares a row with the next:",
        "",
        advice_table(advice, hw, top),
    ]
    return "\n".join(lines)


# -- an advised layout as a parallel group file


# Overrides of the user's command that the advised layout replaces.
LAYOUT_KEYS = ("parallel", "trainer.micro_batch_size", "trainer.recompute", "world_size")


def parallel_values(layout: Layout, ep: bool = False) -> dict[str, object]:
    """The ``parallel`` keys of ``layout`` (``ep``: also ``ep``, which it has when > 1; and
    ``pipeline_schedule`` when it runs a zero-bubble one, ``moe_dispatch_order`` when it
    dispatches ep first, ``cp_comm_type`` when it is not the all-gather, ``cp_a2a_size``
    under a2a_ring, ``zero_shard_size`` under hybrid sharding, ``grad_compression`` (and
    PowerSGD's ``powersgd_rank``, ``powersgd_compress_vocab`` when set) when it compresses, or
    with ``ep``, the defaults)."""
    out = {
        "tp": layout.tp,
        "cp": layout.cp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "dp": None,
        "sp": layout.sequence_parallel,
        "zero_stage": layout.zero_stage,
    }
    if ep or layout.pipeline_schedule is not None:
        out["pipeline_schedule"] = layout.pipeline_schedule
    if ep or layout.moe_dispatch_order != "tp_first":
        out["moe_dispatch_order"] = layout.moe_dispatch_order
    if ep or layout.cp_comm_type != "all_gather":
        out["cp_comm_type"] = layout.cp_comm_type
    if ep or layout.cp_comm_type == "a2a_ring":
        out["cp_a2a_size"] = layout.cp_a2a_size if layout.cp_comm_type == "a2a_ring" else None
    if ep or layout.zero_shard_size is not None:
        out["zero_shard_size"] = layout.zero_shard_size
    if ep or layout.grad_compression is not None:
        out["grad_compression"] = layout.grad_compression
    if layout.grad_compression == "powersgd":
        out["powersgd_rank"] = layout.powersgd_rank
        if layout.powersgd_compress_vocab:
            out["powersgd_compress_vocab"] = True
    if ep or layout.optimizer_offload:
        out["optimizer_offload"] = layout.optimizer_offload
    return {**out, "ep": layout.ep} if ep or layout.ep > 1 else out


def trainer_overrides(layout: Layout) -> list[str]:
    out = [f"trainer.micro_batch_size={layout.micro_batch_size}"]
    out.append(f"trainer.recompute={layout.recompute}")
    if layout.recompute == "full":
        out += [
            f"trainer.recompute_method={layout.recompute_method}",
            f"trainer.recompute_num_layers={layout.recompute_num_layers}",
        ]
    return out


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def parallel_file_text(layout: Layout, summary: str, command: str) -> str:
    """The YAML text of the group file (``summary``: one line on where it comes from)."""
    header = [
        f"# {summary}",
        f"# Layout: {layout.describe()} on {layout.world_size} ranks (dp is derived).",
        "# It also needs these trainer keys (not part of the parallel group):",
        f"#   {' '.join(trainer_overrides(layout))}",
        f"# Run: {command}",
    ]
    body = [f"{k}: {_yaml(v)}" for k, v in parallel_values(layout).items()]
    return "\n".join([*header, *body]) + "\n"


def group_name(path: Path) -> str | None:
    """``NAME`` when ``path`` is ``configs/parallel/NAME.yaml`` of this checkout, else None."""
    parallel_dir = Path(compose.CONFIG_DIR) / "parallel"
    path = path.resolve()
    return path.stem if path.suffix == ".yaml" and path.parent == parallel_dir else None


def _kept(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith(LAYOUT_KEYS)]


def run_overrides(overrides: list[str], layout: Layout, name: str | None) -> list[str]:
    """Overrides that run ``layout``: the user's (less their layout keys), ``parallel=NAME``
    when the group file ``name`` exists and wins, else explicit ``parallel.*`` keys, and the
    trainer keys."""
    kept = [*_kept(overrides), *trainer_overrides(layout)]
    if name is not None:
        candidate = [*kept, f"parallel={name}"]
        try:
            cfg = compose.load_config(candidate)
        except Exception:  # noqa: BLE001 - e.g. an experiment that overrides the group itself
            cfg = None
        defaults = {
            "ep": 1,
            "pipeline_schedule": None,
            "moe_dispatch_order": "tp_first",
            "cp_comm_type": "all_gather",
            "cp_a2a_size": None,
            "zero_shard_size": None,
            "grad_compression": None,
            "optimizer_offload": False,
        }
        if cfg is not None and all(
            cfg.parallel.get(k, defaults.get(k, 1)) == v
            for k, v in parallel_values(layout, ep=True).items()
        ):
            return candidate
    explicit = [f"parallel.{k}={_yaml(v)}" for k, v in parallel_values(layout).items()]
    composed = _parallel_of([*kept, *explicit])
    if layout.ep == 1 and composed.get("ep", 1) != 1:  # e.g. an experiment's own ep
        explicit.append("parallel.ep=1")
    if layout.pipeline_schedule is None and composed.get("pipeline_schedule") is not None:
        explicit.append("parallel.pipeline_schedule=null")
    if layout.moe_dispatch_order == "tp_first" and composed.get("moe_dispatch_order") == "ep_first":
        explicit.append("parallel.moe_dispatch_order=tp_first")
    if layout.cp_comm_type == "all_gather" and composed.get("cp_comm_type", "all_gather") != (
        "all_gather"
    ):
        explicit.append("parallel.cp_comm_type=all_gather")
    if layout.cp_comm_type != "a2a_ring" and composed.get("cp_a2a_size") is not None:
        explicit.append("parallel.cp_a2a_size=null")
    if layout.zero_shard_size is None and composed.get("zero_shard_size") is not None:
        explicit.append("parallel.zero_shard_size=null")
    if layout.grad_compression is None and composed.get("grad_compression") is not None:
        explicit.append("parallel.grad_compression=null")
    if not layout.optimizer_offload and composed.get("optimizer_offload"):
        explicit.append("parallel.optimizer_offload=false")
    return [*kept, *explicit]


def _parallel_of(overrides: list[str]) -> dict:
    """The ``parallel`` keys of the config ``overrides`` compose ({} when they do not)."""
    try:
        return dict(compose.load_config(overrides).parallel)
    except Exception:  # noqa: BLE001 - the command is still the best we can write
        return {}


def write_parallel_file(path: Path, layout: Layout, overrides: list[str], summary: str) -> str:
    """Write the group file; returns the command line that runs the layout."""
    name = group_name(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written first without a command, so that composing ``parallel=NAME`` can check it.
    path.write_text(parallel_file_text(layout, summary, "(see below)"))
    command = "python -m megatronish.train " + " ".join(run_overrides(overrides, layout, name))
    command += f"   (on {layout.world_size} ranks: torchrun, srun or scripts/slurm/train.sbatch)"
    if name is None:
        command += f"; or copy this file to configs/parallel/ and use parallel={path.stem}"
    path.write_text(parallel_file_text(layout, summary, command))
    return command
