"""The step-boundary stop check posts its all-reduce and reads it a step later: the host never
waits for the world at a boundary, and every rank still stops after the same step."""

import os
import signal

from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.training import stop as stop_module
from megatronish.training.stop import StopRequest

EVENTS: list[tuple[str, int, int]] = []  # (what, the trainer's step then, which all-reduce)


class RecordedWork:
    def __init__(self, work, index: int, box: list):
        self.work, self.index, self.box = work, index, box

    def wait(self):
        EVENTS.append(("wait", self.box[0].state.step, self.index))
        return self.work.wait()


def _recording(box: list):
    """The stop check's all_reduce, recorded: each call's kind (posted or blocking), the step
    it was made after, and each wait for a posted one."""
    real = stop_module.all_reduce

    def all_reduce(t, group, op="sum", async_op=False):
        index = sum(1 for e in EVENTS if e[0] in ("post", "blocking"))
        EVENTS.append(("post" if async_op else "blocking", box[0].state.step, index))
        out = real(t, group, op=op, async_op=async_op)
        return RecordedWork(out, index, box) if async_op else out

    return all_reduce


def _run(rank, world, ckpt_dir, signal_rank, signal_step, steps):
    """A fit whose rank ``signal_rank`` gets SIGUSR2 during step ``signal_step`` (never when
    None); returns the steps run, the reason and the stop check's recorded collectives."""
    box: list = []
    EVENTS.clear()
    stop_module.all_reduce = _recording(box)  # this rank's process (the test's: monkeypatched)
    stop = StopRequest([signal.SIGUSR2])
    overrides = [f"checkpoint.dir={ckpt_dir}"]
    trainer = build_trainer(rank, world, overrides, steps=steps, saving=True, stop=stop)
    box.append(trainer)
    inner = trainer.forward_backward

    def forward_backward(chunks, microbatches, **kw):
        if rank == signal_rank and trainer.state.step + 1 == signal_step:
            os.kill(os.getpid(), signal.SIGUSR2)  # arrives mid-step, as a scheduler's would
        return inner(chunks, microbatches, **kw)

    trainer.forward_backward = forward_backward
    with stop:
        history = trainer.fit()
    return len(history), trainer.state.step, stop.reason, list(EVENTS)


def test_a_signal_on_one_rank_stops_every_rank_after_the_next_step_and_saves_it(tmp_path):
    results = run_world(_run, 4, str(tmp_path), 2, 3, 20)
    assert [r[:2] for r in results] == [(4, 4)] * 4  # every rank: four steps, stopped at 4
    others = "a stop signal on another rank"
    assert [r[2] for r in results] == [others, others, "signal SIGUSR2", others]
    assert (tmp_path / "latest").read_text() == "step_0000004"
    for *_, events in results:
        # posted after steps 1-3 (step 3's saw the signal), each waited for a step later
        assert events == [
            ("post", 1, 0),
            ("wait", 2, 0),
            ("post", 2, 1),
            ("wait", 3, 1),
            ("post", 3, 2),
            ("wait", 4, 2),
        ]


def test_the_host_waits_for_each_stop_all_reduce_a_step_after_posting_it(tmp_path):
    """Never firing, 5 steps: steps 1-4 ask (the run ends after step 5 anyway); no check
    blocks, and each boundary waits only for the all-reduce of the boundary before."""
    for *_, events in run_world(_run, 2, str(tmp_path), None, None, 5):
        posts = [(step, i) for what, step, i in events if what == "post"]
        waits = [(step, i) for what, step, i in events if what == "wait"]
        assert not [e for e in events if e[0] == "blocking"]
        assert posts == [(1, 0), (2, 1), (3, 2), (4, 3)]  # one per step boundary asked
        assert waits == [(2, 0), (3, 1), (4, 2)]  # each a step after its post


def test_one_rank_alone_stops_after_the_step_its_signal_came_in(tmp_path, monkeypatch):
    """No other rank to agree with: the check is local, and blocking costs nothing."""
    monkeypatch.setattr(stop_module, "all_reduce", stop_module.all_reduce)  # put back after
    steps, step, reason, events = _run(0, 1, str(tmp_path), 0, 3, 20)
    assert (steps, step, reason) == (3, 3, "signal SIGUSR2")
    assert [what for what, _, _ in events] == ["blocking"] * 3
    assert (tmp_path / "latest").read_text() == "step_0000003"
