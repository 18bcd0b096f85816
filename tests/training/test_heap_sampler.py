"""The CPU's step-peak sampler: windows never leak into each other, and a slow ``mallinfo2`` (a
fragmented heap) makes it sample less often, so its calls hold the heap at most 1% of the time.
Driven by a fake heap and a fake clock: nothing here depends on the machine's speed."""

import threading

import pytest

from megatronish.training.heap_sampler import (
    DUTY,
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    HeapPeakSampler,
    heap_in_use,
    next_interval,
)


class FakeHeap:
    """``read`` returns the scripted bytes in use and advances the fake clock by the scripted
    duration of that call; ``sleep`` records the waits the sampler asks for."""

    def __init__(self, values, costs=None):
        self.values, self.costs = list(values), list(costs or [0.0] * len(values))
        self.now, self.waits = 0.0, []

    def read(self):
        self.now += self.costs.pop(0)
        return self.values.pop(0)

    def clock(self):
        return self.now


def test_take_reports_the_most_since_the_previous_take():
    heap = FakeHeap([10, 50, 30, 20, 15, 40, 5, 7])
    s = HeapPeakSampler(read=heap.read, clock=heap.clock, start=False)  # starts at 10
    s.sample()  # 50
    s.sample()  # 30
    assert s.take() == 50  # reads 20: the next window starts there
    s.sample()  # 15
    assert s.take() == 40  # its own read, where the next window starts
    assert s.take() == 40  # reads 5
    assert s.take() == 7


def test_a_take_during_a_sample_never_sees_the_previous_windows_peak_again():
    # The sampler thread's read blocks until the training thread's take() has had its chance.
    # It used to read the peak before calling mallinfo2 (which releases the GIL) and write the
    # max back after, so the start-up's peak (100) came back in the next window.
    reading, go = threading.Event(), threading.Event()
    takes = iter([100, 10, 20])  # the start, then the reads of the two takes

    def read():
        if threading.current_thread().name == "fake-sampler":
            reading.set()
            go.wait(10)
            return 50
        return next(takes)

    s = HeapPeakSampler(read=read, start=False)
    sampler = threading.Thread(target=s.sample, name="fake-sampler")
    sampler.start()
    assert reading.wait(10)
    first: list[int] = []
    taker = threading.Thread(target=lambda: first.append(s.take()))
    taker.start()
    taker.join(0.3)  # a take that does not wait for the sample finishes here (the bug)
    go.set()
    sampler.join(10)
    taker.join(10)
    # The sample read 50 while the first window was open: it is the first window's, not the
    # second's, and the start-up's 100 belongs to the first window only.
    assert first == [100]
    assert s.take() == 20


def test_a_slow_heap_read_backs_the_interval_off_to_one_percent():
    # 4 us (a compact heap), 1.8 ms (~20k free chunks), 16.5 ms (~70k), an outlier the
    # scheduler stretched, then compact again.
    costs = [4e-6, 1.8e-3, 16.5e-3, 0.5, 4e-6]
    heap = FakeHeap([1] * (len(costs) + 1), [0.0, *costs])
    stop = threading.Event()

    def sleep(seconds):
        heap.waits.append(seconds)
        if len(heap.waits) == len(costs) + 1:
            stop.set()  # as close() during this wait

    s = HeapPeakSampler(read=heap.read, clock=heap.clock, sleep=sleep, start=False)
    s._stop = stop
    s._run()  # the thread's loop, on this thread: returns once stopped
    assert heap.waits[0] == MIN_INTERVAL_S
    assert heap.waits[1:] == [next_interval(c) for c in costs]
    assert heap.waits[1:] == pytest.approx([MIN_INTERVAL_S, 0.18, 1.65, MAX_INTERVAL_S, 0.002])
    for cost, wait in zip(costs, heap.waits[1:]):
        if cost <= MAX_INTERVAL_S * DUTY:
            assert cost / (cost + wait) <= DUTY, (cost, wait)


@pytest.mark.skipif(heap_in_use() is None, reason="reads glibc's mallinfo2")
def test_the_real_sampler_starts_takes_and_stops():
    s = HeapPeakSampler()
    try:
        assert s.take() > 0
    finally:
        s.close()
    assert not s._thread.is_alive()
