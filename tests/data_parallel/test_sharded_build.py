"""ZeRO 3 builds the model on the meta device and draws only each rank's shards: the values are
the full build's, bit for bit, and no rank holds more than one unit beyond its shards."""

import gc

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatronish.data_parallel.zero import ZeroDataParallel
from megatronish.model import build as build_module
from megatronish.model.build import build_chunks
from megatronish.model.gpt import GPTChunk
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import layout_parts, trainer_for
from megatronish.testing.runs import test_config as tiny_config
from megatronish.training.heap_sampler import heap_in_use
from megatronish.training.job import build_model
from megatronish.training.progress import ProgressLogger

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
# Layouts whose zero-3 shards cut through tp slices, expert stacks and a tied head.
SAME_VALUES = {
    "tp2-sp-ep2-dp2-moe": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", *MOE]),
    "pp2-dp2-gpt2-tied": (4, ["parallel.pp=2", "model.arch=gpt2"]),
}


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and other tensor a module of the chunk holds (MoE statistics)."""
    out = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, m in module.named_modules():
        for key, value in vars(m).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                out[f"{name}.{key}"] = value
    return out


def _sharded_and_full(rank, world, cfg):
    trainer, _ = trainer_for(cfg, rank, world)
    for i in range(len(trainer.chunks)):
        trainer.zero.gather(i)
    chunk = trainer.chunks[0]
    cfg, topo = trainer.cfg, trainer.topo
    full = build_chunks(
        trainer.spec,
        chunk.parallel,
        trainer.derived.layers_per_chunk,
        topo.coords.pp,
        topo.pp,
        cfg.parallel.vpp,
        cfg.trainer.seed,
        topo.device,
    )
    compared, mismatched = 0, []
    for sharded, eager in zip(trainer.chunks, full, strict=True):
        ours, theirs = _tensors(sharded), _tensors(eager)
        assert ours.keys() == theirs.keys()
        compared += len(theirs)
        for name, value in theirs.items():
            if ours[name].device != value.device or not torch.equal(ours[name], value):
                mismatched.append(name)
    return compared, mismatched


@pytest.mark.parametrize("case", SAME_VALUES)
def test_zero3_shards_hold_the_full_builds_values_bit_for_bit(case):
    world, overrides = SAME_VALUES[case]
    cfg = tiny_config(["parallel.zero_stage=3", *overrides], 1)  # composed once, not per rank
    for count, mismatched in run_world(_sharded_and_full, world, cfg):
        assert count > 10 and not mismatched, mismatched


class _ChunkWithState(GPTChunk):
    """A chunk holding what no model of ours holds yet: a registered buffer and a plain tensor
    that do not start at zero (a RoPE ``inv_freq``, a router's bias)."""

    def __init__(self, *args, device=None, **kwargs):
        super().__init__(*args, device=device, **kwargs)
        arange = torch.arange(0, 8, 2, device=device, dtype=torch.float32)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (arange / 8), persistent=False)
        self.layers["0"].register_buffer("bias", torch.full((4,), 0.5, device=device))
        self.offsets = torch.arange(3.0, device=device)


def test_zero3_builds_buffers_and_other_tensors_with_their_values(monkeypatch):
    monkeypatch.setattr(build_module, "GPTChunk", _ChunkWithState)  # the forked ranks see it
    cfg = tiny_config(["parallel.zero_stage=3", "model.num_layers=2"], 1)
    for count, mismatched in run_world(_sharded_and_full, 2, cfg):
        assert count > 10 and not mismatched, mismatched


# -- a second owner of the chunks ---------------------------------------------------------------
def _second_owner(rank, world, cfg):
    trainer, _ = trainer_for(cfg, rank, world)
    trainer.fit()  # a step: the values are no longer the initial ones
    for i in range(len(trainer.chunks)):
        trainer.zero.gather(i)
    trained = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    changed = {}
    for stage in (3, 2):  # a fresh ZeRO 3 over them, then one of another stage
        zero = ZeroDataParallel(trainer.chunks, trainer.topo, stage, cfg.parallel.bucket_size_mb)
        for i in range(len(trainer.chunks)):
            zero.gather(i)
        changed[stage] = [
            n
            for c in trainer.chunks
            for n, p in c.named_parameters()
            if not torch.equal(p, trained[n])
        ]
    return changed


def test_a_second_zero_over_trained_chunks_keeps_their_values():
    # The chunks were built deferred; once ZeRO has drawn their shards they are ordinary
    # parameters: another owner must neither draw the initial values again nor refuse them.
    cfg = tiny_config(["parallel.zero_stage=3", "model.num_layers=2"], 1)
    for changed in run_world(_second_owner, 2, cfg):
        assert changed == {3: [], 2: []}, changed


# -- memory of the build ----------------------------------------------------------------------
class HeapPeak(TorchFunctionMode):
    """The most bytes malloc held right after any torch call made inside: every tensor's storage
    comes from one (a factory, a copy, a cast), so this is the peak of live tensor memory plus
    Python's small objects. (A TorchDispatchMode would see the aten ops inside composite calls
    too, but its first use imports torch._dynamo: seconds in every rank.)"""

    def __enter__(self):
        gc.collect()
        self.start = self.peak = heap_in_use()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_in_use())
        return out


# Blocks of ~1M parameters (3.9 MiB) and a small vocabulary: four blocks are most of the chunk.
BIG_BLOCKS = [
    "model.hidden_size=256",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=1024",
    "parallel.zero_stage=3",
]


def _build_heap(rank, world, cfg):
    topo, derived, spec, rng = layout_parts(cfg, rank, world)
    with HeapPeak() as heap:
        chunks = build_model(cfg, topo, derived, spec, rng)
        zero = ZeroDataParallel(chunks, topo, 3, cfg.parallel.bucket_size_mb)
    end = heap_in_use()
    unit = max(u.numel for units in zero.units_of for u in units) * 4
    chunk = sum(b.numel for b in zero.buckets) * 4
    shards = sum((b.param_shard.numel() + b.grad_shard.numel()) * 4 for b in zero.buckets)
    return heap.peak - end, end - heap.start, unit, chunk, shards


@pytest.mark.skipif(heap_in_use() is None, reason="counts malloc's bytes with glibc's mallinfo2")
def test_zero3_build_holds_at_most_one_unit_beyond_its_shards():
    # dp=4: its shards (params and grads) are half the chunk, the other half never exists.
    cfg = tiny_config(BIG_BLOCKS, 1)
    for transient, held, unit, chunk, shards in run_world(_build_heap, 4, cfg):
        assert unit < chunk / 4, (unit, chunk)  # a unit is a small part of the chunk
        assert abs(held - shards) < unit / 4, (held, shards)  # it sees what the build keeps
        # A build that makes the chunk whole first holds about the chunk here.
        assert transient <= unit + (64 << 10), (transient, unit, chunk)


# -- the memory the progress line prints ------------------------------------------------------
class _RecordedLog(ProgressLogger):
    """An enabled logger (the CPU's step peak is sampled only where it is printed) that keeps
    its lines instead of printing them."""

    def __init__(self, cfg):
        super().__init__(cfg, enabled=True, run_dir=".")
        self.lines, self.peaks = [], []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    def log_step(self, metrics) -> None:
        self.peaks.append(metrics["peak_memory"])


# 16 blocks of ~0.6M parameters: a unit is 1/16 of the chunk, so the two or three units ZeRO 3
# holds gathered at its peak stay well below the half of the params it does not keep.
STEP_PEAK_MODEL = [
    "model.num_layers=16",
    *BIG_BLOCKS[:3],
    "model.ffn_hidden_size=512",
    "trainer.global_batch_size=4",
]


class _SampleEveryOp(TorchDispatchMode):
    """The trainer's heap sampler read after every op too, so the printed peak is the step's
    true peak at op granularity, not what a 2 ms thread happened to see on a loaded machine."""

    def __init__(self, memory):
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.memory.sampler is not None:
            self.memory.sampler.sample()
        return out


def _printed_peaks(rank, world, cfg):
    torch.ones(64 << 20)  # a start-up that peaks far above the steps (a build, a checkpoint load)
    log = _RecordedLog(cfg)
    trainer, _ = trainer_for(cfg, rank, world, logger=log)
    with _SampleEveryOp(trainer.memory):
        trainer.fit()
    params = sum(b.numel for b in trainer.zero.buckets) * 4
    return log.lines, log.peaks, params


@pytest.mark.skipif(heap_in_use() is None, reason="the CPU's step peak is malloc's (glibc)")
def test_printed_memory_is_the_steps_peak_and_falls_with_every_stage():
    cfg = tiny_config(STEP_PEAK_MODEL, 2)
    peaks = {}
    for stage in (1, 2, 3):
        cfg.parallel.zero_stage = stage
        results = run_world(_printed_peaks, 2, cfg)
        for lines, printed, _ in results:
            assert len(printed) == 2 and lines[0].startswith("start-up peak memory"), lines
        peaks[stage] = max(printed[-1] for _, printed, _ in results)  # step 2
        params = results[0][2]
    # ZeRO 2 holds half the grads of ZeRO 1 (dp=2) and ZeRO 3 half the params of ZeRO 2, plus
    # a bucket of full grads / two gathered units (an eighth of the params here).
    assert peaks[1] - peaks[2] > params / 8 and peaks[2] - peaks[3] > params / 8, (peaks, params)
