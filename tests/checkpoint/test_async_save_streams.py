"""Async checkpoint copies under a GPU's ordering rules, on CPU.

On a GPU, ``snapshot`` queues ``non_blocking`` device->host copies on a side stream and returns;
they complete later, in the background. :class:`DelayedCopies` plays that side stream on CPU: a
copy runs only when an event recorded after it is waited for, by the training stream (at once:
its later work is ordered after the copies) or by a host thread (only once the test opens
``gate``). Until then a destination holds nan, and device buffers handed back too early are
overwritten with nan, as the caching allocator would reuse them. So a save whose writer read
before the copies completed, whose training thread waited for them, or whose next optimizer
update or gather overwrote a source too early, writes other files than a blocking save. It also
counts the device bytes its copies read that were not handed back yet (the gather buffers a
snapshot holds).
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import torch

from megatronish.checkpoint.format import read_metadata
from megatronish.checkpoint.host_copies import ImmediateCopies, StreamCopies, host_copies_for
from megatronish.checkpoint.save import CheckpointSaver
from megatronish.testing.host_syncs import HostSyncRecorder
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.testing.runs import test_config as config_of

NAN = float("nan")
GATE_TIMEOUT_S = 60  # a hang guard only: the test opens the gate itself


class DelayedEvent:
    """Completes the copies queued before it when waited for."""

    def __init__(self, copies: DelayedCopies, upto: int):
        self.copies, self.upto = copies, upto

    def synchronize(self) -> None:
        if threading.current_thread() is self.copies.training_thread:
            raise AssertionError("the training thread waited for the checkpoint copies")
        if not self.copies.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        self.copies.run_until(self.upto)

    def query(self) -> bool:
        return self.copies.done >= self.upto


class DelayedCopies:
    """A side stream whose copies complete only when an event covering them is waited for."""

    def __init__(self):
        self.training_thread = threading.current_thread()
        self.gate = threading.Event()  # host waits block until it is set
        self.lock = threading.Lock()
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host dst, device src)
        self.done = 0  # copies of the queue that ran
        self.pool: dict[str, torch.Tensor] = {}  # host buffers, reused by key like pinned ones
        self.follows = False  # whether the side stream waited for the training stream's work
        self.live: dict[int, int] = {}  # storages copies read, not handed back: ptr -> bytes
        self.most_live = 0  # the most bytes ``live`` held at once

    @property
    def pending(self) -> int:
        return len(self.queue) - self.done

    def run_until(self, upto: int) -> None:
        with self.lock:
            for dst, src in self.queue[self.done : upto]:
                dst.copy_(src)
            self.done = max(self.done, upto)

    def follow_training(self) -> None:
        self.follows = True

    def to_host(self, src: torch.Tensor, key: str) -> torch.Tensor:
        assert self.follows, "a copy queued before the side stream waited for training"
        dst = self.pool.get(key)
        if dst is None or dst.shape != src.shape:
            dst = self.pool[key] = torch.empty(src.shape, dtype=src.dtype)
        dst.fill_(NAN)
        with self.lock:
            self.queue.append((dst, src))
        storage = src.untyped_storage()
        self.live[storage.data_ptr()] = storage.nbytes()
        self.most_live = max(self.most_live, sum(self.live.values()))
        return dst

    def record(self) -> DelayedEvent:
        with self.lock:
            return DelayedEvent(self, len(self.queue))

    def training_waits(self, event: DelayedEvent) -> None:
        self.run_until(event.upto)
        self.follows = False  # the training stream goes on writing from here

    def release(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            t.fill_(NAN)
            self.live.pop(t.untyped_storage().data_ptr(), None)


class StuckEvent:
    """The event of copies on a GPU stream that is stuck: it completes only once released."""

    def __init__(self):
        self.released = threading.Event()

    def synchronize(self) -> None:
        if not self.released.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never released the stuck copies")

    def query(self) -> bool:
        return self.released.is_set()


class StuckCopies(ImmediateCopies):
    """Copies whose events never complete until the test releases them."""

    def __init__(self):
        self.event = StuckEvent()

    def record(self) -> StuckEvent:
        return self.event


def rank_files(step_dir: str, rank: int) -> dict[str, bytes]:
    """This rank's safetensors files of a published step, by name."""
    names = [n for n in os.listdir(step_dir) if n.endswith(f"-rank{rank:05d}.safetensors")]
    out = {}
    for name in names:
        with open(os.path.join(step_dir, name), "rb") as f:
            out[name] = f.read()
    return out


def differing_files(step_dir: str, expected_dir: str, rank: int) -> list[str]:
    """This rank's files that are missing from either step or differ in a byte."""
    got, expected = rank_files(step_dir, rank), rank_files(expected_dir, rank)
    assert expected, f"no files of rank {rank} in {expected_dir}"
    return sorted(n for n in got.keys() | expected.keys() if got.get(n) != expected.get(n))


def saver_into(trainer, path: str, copies=None) -> CheckpointSaver:
    saver = CheckpointSaver(trainer.cfg, trainer.checkpoint_parts, copies=copies)
    saver.dir = path
    return saver


def trained(overrides: list[str], rank: int = 0, world: int = 1):
    trainer = build_trainer(rank, world, overrides, steps=4)
    trainer.train_step()  # Adam's moments are nonzero
    return trainer


def test_the_cpu_layer_copies_at_once():
    copies = host_copies_for(torch.device("cpu"), async_save=True)
    assert isinstance(copies, ImmediateCopies)
    src = torch.arange(6.0).view(2, 3)[:, 1:]
    dst = copies.to_host(src, "k")
    src.zero_()
    assert copies.record().query() and dst.is_contiguous()
    assert dst.tolist() == [[1.0, 2.0], [4.0, 5.0]]


class FakeCudaEvent:
    def __init__(self, blocking: bool = False, **_):
        self.blocking = blocking

    def record(self, stream) -> None:
        return None


def test_only_async_saves_on_a_gpu_take_pinned_memory_and_its_events_block(monkeypatch):
    """A run without async_save copies into pageable memory (no pinned buffers kept); an async
    one into pinned buffers, with events a waiting host thread sleeps on (not a spinning core)."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    gpu = SimpleNamespace(
        topo=SimpleNamespace(device=torch.device("cuda", 0)), spec=SimpleNamespace(vocab_size=256)
    )
    layers = {}
    for async_save in (False, True):
        cfg = config_of([f"checkpoint.async_save={str(async_save).lower()}"], steps=1)
        layers[async_save] = CheckpointSaver(cfg, gpu).copies
    assert isinstance(layers[False], ImmediateCopies)
    assert isinstance(layers[True], StreamCopies)
    assert layers[True].record().blocking


def test_save_returns_before_its_copies_and_the_writer_waits_for_them(tmp_path):
    trainer = trained(["parallel.zero_stage=0"])
    expected = saver_into(trainer, str(tmp_path / "blocking")).save(blocking=True)
    copies = DelayedCopies()
    saver = saver_into(trainer, str(tmp_path / "async"), copies)
    with HostSyncRecorder() as syncs:
        assert saver.save(blocking=False) is None
    assert syncs.count() == 0, syncs.report()  # the training thread read no device value
    assert copies.pending == len(copies.queue) > 0  # save returned with every copy still queued
    assert all(dst.isnan().all() for dst, _ in copies.queue)
    assert saver.pending[2].is_alive()  # the writer waits for them
    copies.gate.set()
    published = saver.wait()
    assert copies.pending == 0
    assert not differing_files(published, expected, 0)


def test_the_next_update_waits_for_the_copies_and_host_buffers_are_reused(tmp_path):
    trainer = trained(["parallel.zero_stage=0"])
    expected = saver_into(trainer, str(tmp_path / "blocking")).save(blocking=True)
    copies = DelayedCopies()
    saver = saver_into(trainer, str(tmp_path / "async"), copies)
    saver.save(blocking=False)
    moments = [m.clone() for m in trainer.optimizer.exp_avg]
    trainer.train_step()  # its update writes the params and moments being copied ...
    assert copies.pending == 0  # ... after the copies, which its fence ran first
    assert not all(map(torch.equal, moments, trainer.optimizer.exp_avg))
    copies.gate.set()
    published = saver.wait()
    assert not differing_files(published, expected, 0)
    assert read_metadata(published).trainer["optimizer_steps"] == 1

    buffers = dict(copies.pool)  # the next save copies into the same host buffers
    expected = saver_into(trainer, str(tmp_path / "blocking")).save(blocking=True)
    assert not differing_files(saver.save(blocking=True), expected, 0)
    assert buffers and all(copies.pool[k] is buf for k, buf in buffers.items())


# gpt2 ties its head to the embedding: one big bucket (1024 x 64), the next largest 8192
ONE_BIG_BUCKET = ["model.arch=gpt2", "model.vocab_size=1000"]


def _gathered_save(rank: int, world: int, tmp: str) -> dict:
    trainer = trained(
        ["parallel.zero_stage=1", "parallel.bucket_size_mb=0.02", *ONE_BIG_BUCKET], rank, world
    )
    expected = saver_into(trainer, os.path.join(tmp, "blocking")).save(blocking=True)
    copies = DelayedCopies()
    saver = saver_into(trainer, os.path.join(tmp, "async"), copies)
    saver.save(blocking=False)
    pending = copies.pending  # copies out of the last gather buffers (if this rank writes)
    copies.gate.set()
    published = saver.wait()
    sizes = sorted(b.numel for b in trainer.zero.buckets)
    return {
        "buckets": sizes,
        "pending": pending,
        "held": copies.most_live,
        "differing": differing_files(published, expected, rank),
    }


def test_zero_gather_buffers_are_sized_per_bucket_and_freed_only_after_their_copies(tmp_path):
    """ZeRO 1 copies out of gathered values: the buffers of a bucket are handed back when the
    bucket after next is gathered, the last ones at the end, each only once the copies that
    read them completed; so the snapshot holds at most two buckets' buffers (3 kinds x fp32),
    each of its own bucket's size."""
    ranks = run_world(_gathered_save, 2, str(tmp_path), timeout=120)
    sizes = ranks[0]["buckets"]
    assert len(sizes) > 2 and sizes[-1] > 4 * sizes[-2]  # gather slots were reused; one is big
    assert sum(r["pending"] for r in ranks) > 0  # some copies were still queued
    assert [r["differing"] for r in ranks] == [[], []]
    two_largest = 3 * 4 * (sizes[-1] + sizes[-2]) + 4  # + the optimizer's step count
    assert max(r["held"] for r in ranks) <= two_largest < 6 * 4 * sizes[-1]


def test_join_writer_gives_up_on_copies_a_stuck_gpu_never_completes(tmp_path, capsys):
    """A run ending on an error joins the writer; copies that never complete (a stuck stream)
    hold that join only for its bound, then one line names the save, which is never written."""
    trainer = trained(["parallel.zero_stage=0"])
    copies = StuckCopies()
    saver = saver_into(trainer, str(tmp_path), copies)
    assert saver.save(blocking=False) is None
    writer, tmp_dir = saver.pending.thread, saver.pending.tmp_dir
    line = saver.join_writer(wait_s=0.01)
    assert line and f"checkpoint step {trainer.state.step} was not saved" in line
    assert line in capsys.readouterr().err
    assert saver.pending is None and writer.is_alive()
    copies.event.released.set()  # the copies complete after all: the writer writes nothing
    writer.join()
    assert os.listdir(tmp_dir) == []
