"""Loading any checkpoint into any layout (tp, cp, pp, vpp, dp, ZeRO stage, sp on or off).

Each rank works out the rectangles of the global tensors its parameters cover in the *current*
layout and reads just those byte ranges of the shards that intersect them, straight into its
ZeRO buffers (params and Adam moments), in one pass over the files in file order. The trainer state
(step, consumed samples) continues at the same global sample. RNG states are restored when the
layout is the one that saved them; otherwise every rank is re-seeded from the seed and the step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from megatronish.checkpoint.format import (
    BUFFER,
    COMPRESSION,
    CheckpointError,
    Metadata,
    read_metadata,
    resolve_step_dir,
)
from megatronish.checkpoint.parts import CheckpointParts, model_buffers
from megatronish.checkpoint.pieces import copy_threads, range_requests, saved_name
from megatronish.checkpoint.rank_files import rank_file_name, read_rank_file
from megatronish.checkpoint.shard_reader import READ_THREADS, ShardReader
from megatronish.config.schema import FUNCTION_KEYS
from megatronish.data_parallel.compression import load_state
from megatronish.distributed.topology import Topology
from megatronish.spec import ModelSpec
from megatronish.tensor_parallel.random import RNGTracker

# Never allowed to differ: they decide which tensors there are and their shapes, and arch also
# the norm (RMSNorm / LayerNorm) and the activation (SwiGLU / GELU). FUNCTION_KEYS change what the
# same tensors compute: refused unless checkpoint.allow_model_changes names them.
SHAPE_KEYS = (
    "arch",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "qk_norm",
    "ffn_hidden_size",
    "bias",
    "tie_embeddings",
    "moe.num_experts",
    "moe.layer_freq",
    "moe.shared_experts",
)


def _saved_model_values(saved: dict) -> dict:
    """The checkpoint's model values as a ModelSpec names them (nulls resolved as at save)."""
    arch = saved.get("arch")
    values = dict(saved)
    for key in ("bias", "tie_embeddings"):
        if values.get(key) is None and arch is not None:
            values[key] = arch == "gpt2"
    if values.get("num_query_groups") is None:
        values["num_query_groups"] = values.get("num_attention_heads")
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    if values.get("head_dim") is None and heads and hidden:
        values["head_dim"] = hidden // heads
    values["qk_norm"] = bool(values.get("qk_norm"))  # absent before per-head norms: none
    moe = saved.get("moe") or {}  # absent in checkpoints older than mixtures of experts
    for key in ("num_experts", "layer_freq", "shared_experts", "top_k"):
        values[f"moe.{key}"] = moe.get(key)
    router = moe.get("router") or {}
    values["moe.router.renormalize"] = router.get("renormalize")
    # Absent in checkpoints from before these keys: those routed by softmax, without groups.
    values["moe.router.score"] = router.get("score", "softmax")
    for key in ("num_groups", "max_groups"):
        values[f"moe.router.{key}"] = str(router.get(key))
    if moe.get("num_experts") == 0:  # a dense model: the other moe values mean nothing
        values.update({k: None for k in values if k.startswith("moe.") and k != "moe.num_experts"})
    return values


def check_compatible(
    meta: Metadata, spec: ModelSpec, where: str, allowed: Sequence[str] = ()
) -> None:
    """Refuse a checkpoint whose model shape, vocabulary or any setting that changes what the
    tensors compute (:data:`FUNCTION_KEYS`, except those in ``allowed``) differs from ``spec``."""
    saved = _saved_model_values(meta.config.get("model", {}))
    mine = {
        "arch": spec.arch,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_query_groups": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "qk_norm": spec.qk_norm,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "rope_theta": spec.rope_theta,
        "norm_eps": spec.norm_eps,
        "vocab_size": spec.vocab_size,
        "bias": spec.bias,
        "tie_embeddings": spec.tie_embeddings,
        "moe.num_experts": 0,
    }
    if spec.moe is not None:
        m = spec.moe
        mine.update(
            {
                "moe.num_experts": m.num_experts,
                "moe.layer_freq": m.layer_freq,
                "moe.shared_experts": m.shared_experts,
                "moe.top_k": m.top_k,
                "moe.router.renormalize": m.renormalize,
                "moe.router.score": m.score,
                "moe.router.num_groups": str(m.num_groups),
                "moe.router.max_groups": str(m.max_groups),
            }
        )
    keys = [*SHAPE_KEYS, *(k for k in FUNCTION_KEYS if k not in allowed)]
    if spec.arch != "llama":
        keys = [k for k in keys if k != "rope_theta"]  # no rotary embedding
    changed = [k for k in keys if None not in (saved.get(k), mine.get(k)) and saved[k] != mine[k]]
    wrong = [f"model.{k}: checkpoint {saved[k]}, config {mine[k]}" for k in changed]
    emb = meta.tensors.get("model/embedding.word.weight")
    if emb is not None and emb.shape != [spec.padded_vocab_size, spec.hidden_size]:
        wrong.append(
            f"vocabulary: checkpoint embedding {emb.shape}, config "
            f"[{spec.padded_vocab_size}, {spec.hidden_size}] (padded vocab)"
        )
    if wrong:
        hint = ""
        if changed and len(changed) == len(wrong) and set(changed) <= set(FUNCTION_KEYS):
            hint = f", allow the change with checkpoint.allow_model_changes=[{','.join(changed)}]"
        raise CheckpointError(
            f"checkpoint {where} does not fit this model: "
            + "; ".join(wrong)
            + f". Use the checkpoint's model config{hint} or set checkpoint.resume=never."
        )


def check_tensor_shapes(meta: Metadata, spec: ModelSpec, where: str) -> None:
    """Every model tensor of the checkpoint has this model's global shape, and none is left over.

    A whole model is compared: this rank's parameters plus the names and shapes every other rank
    would read (parameter names are global), so a tensor that would be cut or dropped is caught.
    """
    from megatronish.model.build import build_chunks
    from megatronish.model.parallel_context import ParallelContext

    full = build_chunks(spec, ParallelContext(), [spec.num_layers], device="meta")[0]
    wanted = {f"model/{n}": list(p.shape) for n, p in full.named_parameters()}
    wanted.update({f"{BUFFER}{n}": list(b.shape) for n, b in model_buffers([full]).items()})
    stored = {n: e.shape for n, e in meta.tensors.items() if n.startswith(("model/", BUFFER))}
    wrong = [
        f"{_short(n)}: checkpoint {stored[n]}, model {shape}"
        for n, shape in wanted.items()
        if n in stored and stored[n] != shape
    ]
    # A buffer the checkpoint lacks starts from zero (an expert bias turned on at a resume).
    missing = sorted(_short(n) for n in wanted if n not in stored and not n.startswith(BUFFER))
    extra = sorted(_short(n) for n in stored if n not in wanted)
    if wrong or missing or extra:
        parts = wrong + [f"missing in checkpoint: {', '.join(missing)}"] * bool(missing)
        parts += [f"not in this model: {', '.join(extra)}"] * bool(extra)
        hint = ""
        if any(n.endswith("expert_bias") for n in extra):
            hint = (
                " The checkpoint routes with expert biases (aux-loss-free balancing): set "
                "model.moe.router.bias_update_rate (0 keeps them fixed)."
            )
        raise CheckpointError(
            f"checkpoint {where} does not fit this model: "
            + "; ".join(parts)
            + f". Use the checkpoint's model config or set checkpoint.resume=never.{hint}"
        )


def _short(name: str) -> str:
    """A checkpoint tensor's name without its ``model/`` prefix (buffers keep theirs)."""
    return name.removeprefix("model/")


@torch.no_grad()
def load_into(
    parts: CheckpointParts,
    path: str,
    threads: int = READ_THREADS,
) -> Metadata:
    """Load the checkpoint at ``path`` (a dir with ``latest`` or a step dir) into ``parts``,
    reading the files with ``threads`` threads."""
    step_dir = resolve_step_dir(path)
    meta = read_metadata(step_dir)
    check_compatible(meta, parts.spec, step_dir, parts.cfg.checkpoint.allow_model_changes)
    zero, topo, opt = parts.zero, parts.topo, parts.optimizer
    has_moments = any(name.startswith("exp_avg/") for name in meta.tensors)
    if not has_moments and int(meta.trainer.get("optimizer_steps", 0)) > 0:
        raise CheckpointError(f"{step_dir} has optimizer steps but no Adam moments")
    check_tensor_shapes(meta, parts.spec, step_dir)
    verify = parts.cfg.checkpoint.verify  # CRC32 of every shard read
    with ShardReader(step_dir, meta, verify, threads) as reader, copy_threads():
        ranges = []
        targets = zero.model_load_targets()
        for i, bucket in enumerate(zero.buckets):
            ranges.append((bucket, "model", *targets[i]))
            if has_moments:
                lo, hi = zero.owned_range(bucket)
                ranges.append((bucket, "exp_avg", opt.exp_avg[i], lo, hi))
                ranges.append((bucket, "exp_avg_sq", opt.exp_avg_sq[i], lo, hi))
        _fill(reader, ranges, topo)
        _read_buffers(reader, parts, meta, step_dir)
    zero.params_from_main()
    opt.step_count = int(meta.trainer.get("optimizer_steps", 0))
    parts.progress.step = meta.step
    parts.progress.consumed_samples = meta.consumed_samples
    parts.progress.skipped_steps = int(meta.trainer.get("skipped_steps", 0))
    parts.progress.skipped_in_a_row = 0  # a saved step never ends a skip streak
    # Steps run before the load and not yet settled belong to the replaced state: a later
    # settle must not add them to history or skipped_steps (reading one raises).
    parts.drop_unsettled()
    if parts.rng is not None:
        cfg = parts.cfg
        _restore_rng(parts.rng, step_dir, meta, topo, cfg.parallel.vpp, cfg.trainer.seed, verify)
    if zero.compressor is not None:
        _restore_compression(parts, step_dir, meta)
    return meta


def _same_layout(meta: Metadata, topo: Topology, vpp: int) -> bool:
    """Whether the checkpoint was written by this layout (tp, cp, pp, dp, vpp)."""
    layout = meta.layout
    saved = (
        layout.get("tp"),
        layout.get("cp", 1),
        layout.get("pp"),
        layout.get("dp"),
        layout.get("vpp"),
    )
    return saved == (topo.tp, topo.cp, topo.pp, topo.dp, vpp)


def _restore_compression(parts: CheckpointParts, step_dir: str, meta: Metadata) -> None:
    """This rank's error feedback (and PowerSGD's Q) when the layout is unchanged; else it
    starts from zero, said in the log (rank 0)."""
    topo, compressor = parts.topo, parts.zero.compressor
    if not _same_layout(meta, topo, parts.cfg.parallel.vpp):
        why = "the checkpoint was written by another layout"
    else:
        name, verify = rank_file_name(COMPRESSION, topo.rank), parts.cfg.checkpoint.verify
        why = load_state(compressor, read_rank_file(step_dir, name, meta, verify) or {})
    if why is not None:
        for t in compressor.state_dict().values():
            t.zero_()
        if topo.rank == 0:
            parts.log(
                f"grad_compression={compressor.kind}: {why}; its error feedback starts from zero"
            )


def _fill(reader: ShardReader, ranges: list[tuple], topo: Topology) -> None:
    """Read each ``(bucket, kind, dest, lo, hi)`` of ``ranges``: elements ``[lo, hi)`` of the
    bucket's flat ``kind`` into ``dest`` (``hi - lo`` long), all in one pass over the files.

    Every piece goes straight to its place in ``dest``, also of a parameter that a ZeRO range
    cuts (:func:`range_requests`).
    """
    requests = []
    for bucket, kind, dest, lo, hi in ranges:
        for (name, p), offset in zip(bucket.params, bucket.offsets):
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a >= b:
                continue
            gname = f"{kind}/{saved_name(name, p)}"
            flat = dest[a - lo : b - lo]
            pairs = range_requests(p, a - offset, b - offset, flat, topo.coords.tp, topo.tp)
            requests += [(gname, offsets, view) for offsets, view in pairs]
    reader.read_many(requests)


def _read_buffers(reader: ShardReader, parts: CheckpointParts, meta: Metadata, where: str) -> None:
    """This rank's model buffers from the checkpoint (whole, whatever layout saved them); one the
    checkpoint lacks is zeroed, with a line in the log."""
    requests, missing = [], []
    for name, buf in parts.buffers.items():
        if f"{BUFFER}{name}" in meta.tensors:
            requests.append((f"{BUFFER}{name}", None, buf))
        else:
            buf.zero_()
            missing.append(name)
    if requests:
        reader.read_many(requests)
    if missing:
        parts.log(f"{where} holds no {', '.join(missing)}: starting from zero")


def _restore_rng(
    rng: RNGTracker,
    step_dir: str,
    meta: Metadata,
    topo: Topology,
    vpp: int,
    seed: int,
    verify: bool = True,
) -> None:
    saved = None
    if _same_layout(meta, topo, vpp):
        saved = read_rank_file(step_dir, rank_file_name("rng", topo.rank), meta, verify)
    if saved is not None:
        rng.load_state_dict(saved)
    else:  # a new layout cannot replay the old masks; continue from a fresh, seeded stream
        rng.seed(
            seed + meta.step, tp_rank=topo.coords.tp, pp_rank=topo.coords.pp, cp_rank=topo.coords.cp
        )


def find_resume_path(resume: str, ckpt_dir: str | None) -> str | None:
    """The checkpoint to resume from: ``auto`` (latest in checkpoint.dir, if any), ``never``,
    or an explicit path (which must exist)."""
    if resume == "never":
        return None
    if resume == "auto":
        if ckpt_dir and os.path.exists(os.path.join(os.path.expanduser(ckpt_dir), "latest")):
            return os.path.expanduser(ckpt_dir)
        return None
    if not os.path.exists(os.path.expanduser(resume)):
        raise CheckpointError(f"checkpoint.resume={resume} does not exist")
    return os.path.expanduser(resume)
