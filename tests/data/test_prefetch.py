"""The next step's batches are read on a background thread; the sample stream is unchanged."""

import threading

import pytest

from megatronish.testing.runs import build_trainer
from megatronish.training.prefetch import BatchPrefetcher


class RecordingData:
    """A dataset that records which thread read which sample."""

    def __init__(self, data):
        self.data, self.reads = data, []

    def __getitem__(self, index):
        self.reads.append((threading.current_thread().name, index))
        return self.data[index]


def _trained(prefetch: bool, steps: int = 4):
    trainer = build_trainer(0, 1, [f"data.prefetch={str(prefetch).lower()}"], steps=steps)
    trainer.train_data = RecordingData(trainer.train_data)
    history = trainer.fit()
    return trainer, [(r.loss, r.grad_norm) for r in history]


@pytest.mark.slow
def test_prefetched_steps_are_bit_identical_and_read_in_the_background():
    on, on_results = _trained(True)
    off, off_results = _trained(False)
    assert on_results == off_results  # exactly: the same samples in the same order
    gbs = on.cfg.trainer.global_batch_size
    readers = {}
    for thread, index in on.train_data.reads:
        readers.setdefault(index // gbs, set()).add(thread.split("_")[0])
    # step 1 read when asked, steps 2-4 during the step before; nothing past the last step
    background = {"megatronish-data"}
    assert readers == {0: {"MainThread"}, 1: background, 2: background, 3: background}
    assert {t for t, _ in off.train_data.reads} == {"MainThread"}
    assert on.prefetcher._pool is None  # fit ended the thread


def test_an_unpredicted_cursor_is_read_now_and_a_reader_error_surfaces():
    calls = []

    def read(first):
        calls.append(first)
        if first == 30:
            raise ValueError("bad sample 30")
        return [first]

    p = BatchPrefetcher(read, stride=10)
    assert p.get(0) == [0]  # reads 0 now, prefetches 10
    assert p.get(20) == [20]  # resumed elsewhere: 10 is dropped, 20 read now, 30 prefetched
    with pytest.raises(ValueError, match="bad sample 30"):
        p.get(30)
    p.close()
    assert sorted(calls) == [0, 10, 20, 30]


def test_host_batches_are_pinned_for_a_gpu(monkeypatch):
    """On a GPU the prefetched host tensors are pinned (so their copies can be asynchronous);
    on CPU they are not. The device is only pretended: nothing is copied to it."""
    import torch

    trainer = build_trainer(0, 1, [], steps=2)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.shape) or t)
    trainer._host_microbatches(trainer.train_data, 0)
    assert pinned == []
    trainer.topo.device = torch.device("cuda")
    batches = trainer._host_microbatches(trainer.train_data, 0)
    assert len(pinned) == 2 * len(batches) == 2 * trainer.derived.num_microbatches
