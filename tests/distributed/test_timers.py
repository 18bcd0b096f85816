"""Step timers: the Timers class alone, and the max/min breakdown a training run logs."""

import itertools

import pytest
import torch

import megatronish.distributed.timers as timers_module
from megatronish.distributed.timers import TIMER_NAMES, Timers, max_min_over_ranks, timer_metrics
from megatronish.testing import runs
from megatronish.testing.multiproc import run_world
from megatronish.training.progress import ProgressLogger, format_timers


@pytest.fixture
def clock(monkeypatch):
    """perf_counter ticks 1.0 s per call."""
    ticks = itertools.count()
    monkeypatch.setattr(timers_module.time, "perf_counter", lambda: float(next(ticks)))


def test_regions_accumulate_per_key(clock):
    t = Timers("cheap", names=("forward", "backward"))
    for _ in range(3):
        with t.region("forward"):
            pass
    t.start("backward")
    t.stop("backward")
    t.stop("backward")  # not running: ignored
    assert t.totals == {"forward": 3.0, "backward": 1.0}


def test_window_is_per_step_and_reset_starts_a_new_one(clock):
    t = Timers("cheap", names=("forward",))
    for _ in range(4):
        with t.region("forward"):
            pass
        t.end_step()
    assert t.per_step() == {"forward": 1.0}
    t.reset()
    assert t.per_step() == {"forward": 0.0} and t.steps == 0


def test_off_and_paused_time_nothing(clock):
    off = Timers.off()
    with off.region("forward"):
        pass
    assert set(off.totals.values()) == {0.0}
    t = Timers("cheap")
    with t.paused(), t.region("forward"):
        pass
    with t.region("data"):
        pass
    assert t.totals["forward"] == 0.0 and t.totals["data"] == 1.0


def test_detailed_mode_synchronises_around_each_region_and_cheap_never_does():
    calls = []
    detailed = Timers("detailed", sync=lambda: calls.append(1))
    with detailed.region("forward"):
        pass
    assert len(calls) == 2
    with detailed.region(None, "profiler range only"):
        pass
    assert len(calls) == 2
    cheap = Timers("cheap", sync=lambda: calls.append(1))
    with cheap.region("forward"):
        pass
    assert len(calls) == 2


def test_labels_are_formatted_only_while_profiling():
    class NotFormattable:
        def __format__(self, spec):
            raise AssertionError("label formatted although no profile is recording")

    t = Timers("cheap")
    with t.region("forward", "forward mb{} chunk{}", NotFormattable(), 0):
        pass
    t.ranges = True
    with torch.profiler.record_function("outer"), t.region("forward", "forward mb{}", 3):
        pass


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="'fast' is not one of off, cheap, detailed"):
        Timers("fast")


def simulated_world(per_rank: list[dict[str, float]]) -> list[dict[str, tuple[float, float]]]:
    """max_min_over_ranks on every rank, with the all-reduce done by hand over their vectors."""
    sent = []
    for values in per_rank:
        max_min_over_ranks(values, lambda v: sent.append(v.clone()))
    reduced = torch.stack(sent).amax(0)
    return [max_min_over_ranks(v, lambda vec: vec.copy_(reduced)) for v in per_rank]


def test_max_min_over_ranks_with_a_fake_all_reduce():
    per_rank = [
        {"forward": 0.5, "pp_recv_wait": 0.0},
        {"forward": 0.25, "pp_recv_wait": 0.75},
        {"forward": 1.5, "pp_recv_wait": 0.125},
    ]
    results = simulated_world(per_rank)
    assert all(r == results[0] for r in results)  # every rank gets the same answer
    assert results[0] == {"forward": (1.5, 0.25), "pp_recv_wait": (0.75, 0.0)}
    metrics = timer_metrics(results[0])
    assert metrics == {
        "time/forward_max_ms": 1500.0,
        "time/forward_min_ms": 250.0,
        "time/pp_recv_wait_max_ms": 750.0,
        "time/pp_recv_wait_min_ms": 0.0,
    }
    line = format_timers(metrics)
    assert "forward 1500.0/250.0" in line and "pp_recv_wait 750.0/0.00" in line


def test_logger_prints_the_breakdown_and_sends_timers_to_wandb_under_time(capsys):
    class FakeRun:
        logged = []

        def log(self, metrics, step):
            self.logged.append((step, metrics))

    cfg = runs.test_config([], 4)
    logger = ProgressLogger(cfg, enabled=True, run_dir=".")
    logger.wandb_run = FakeRun()
    metrics = {
        "step": 2,
        "loss": 5.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 10.0,
        "step_time_s": 0.5,
        "peak_memory": 0,
        "skipped_steps": 0,
        **timer_metrics({"forward": (0.25, 0.125), "pp_recv_wait": (0.0, 0.0)}),
    }
    logger.log_step(metrics)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  ms/step max/min over ranks: forward 250.0/125.0"
    step, sent = FakeRun.logged[0]
    assert step == 2 and sent["train/loss"] == 5.0
    assert sent["time/forward_max_ms"] == 250.0 and sent["time/pp_recv_wait_min_ms"] == 0.0


class RecordingLogger(ProgressLogger):
    """Keeps every logged step's metrics, on every rank."""

    def __init__(self, cfg):
        super().__init__(cfg, enabled=False, run_dir=".")
        self.records = []

    def log_step(self, metrics):
        self.records.append(dict(metrics))


def logged_run(rank, world, overrides, steps, ckpt_dir=None):
    extra = [f"checkpoint.dir={ckpt_dir}", "checkpoint.interval=2"] if ckpt_dir else []
    overrides = ["logging.log_interval=2", *overrides, *extra]
    trainer = runs.build_trainer(rank, world, overrides, steps, saving=bool(ckpt_dir) or None)
    trainer.logger = RecordingLogger(trainer.cfg)
    trainer.fit()
    return trainer.logger.records


def timer(record, name):
    return record[f"time/{name}_max_ms"], record[f"time/{name}_min_ms"]


def test_pipeline_run_logs_max_and_min_of_every_timer(tmp_path):
    per_rank = run_world(logged_run, 2, ["parallel.pp=2"], 4, str(tmp_path), timeout=180)
    # Logged at steps 1, 2 and 4; the reduction gives every rank the same numbers.
    assert [r["step"] for r in per_rank[0]] == [1, 2, 4]
    strip = [{k: v for k, v in r.items() if k.startswith("time/")} for r in per_rank[0]]
    assert strip == [{k: v for k, v in r.items() if k.startswith("time/")} for r in per_rank[1]]
    for record in per_rank[1]:
        for name in TIMER_NAMES:
            hi, lo = timer(record, name)
            assert hi >= lo >= 0, (name, hi, lo)
        for name in ("data", "forward", "backward", "pp_recv_wait", "pp_send_wait", "optimizer"):
            assert timer(record, name)[1] > 0, name  # every rank ran these regions
        # No rank's timed regions can add up to more than its step: so neither can the minima.
        assert sum(timer(record, n)[1] for n in TIMER_NAMES) <= record["step_time_s"] * 1e3
        assert timer(record, "param_gather") == (0.0, 0.0)  # zero 0 gathers nothing
    # Checkpoint polls and saves run after a step's log, so they count in the next window.
    assert [timer(r, "checkpoint")[1] > 0 for r in per_rank[1]] == [False, True, True]


def test_one_process_logs_no_pipeline_waits_and_no_param_gathers():
    (records,) = [logged_run(0, 1, ["parallel.zero_stage=1"], 2)]
    for record in records:
        assert timer(record, "pp_recv_wait") == timer(record, "pp_send_wait") == (0.0, 0.0)
        hi, lo = timer(record, "forward")
        assert hi == lo > 0  # one rank: max and min are its own value
        assert timer(record, "param_gather") == (0.0, 0.0)  # one rank: nothing to gather
        assert timer(record, "grad_reduce_wait")[0] > 0
