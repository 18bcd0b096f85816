"""Every way a run ends leaves no process-group thread running when the entry point returns.

gloo's worker threads outliving ``main`` abort the process at interpreter exit (see
megatronish/distributed/shutdown.py and test_exit_abort.py). Each case runs
``megatronish.train.main_with_config`` in a forked 2-rank world that starts its own process group,
as under torchrun, ends the run one way, and reads this process's threads from /proc/self/task
right after ``main_with_config`` returned.
"""

import contextlib
import gc
import io
import json
import os
import time

import pytest

from megatronish.config.compose import load_config
from megatronish.testing.multiproc import WorldError, run_world
from megatronish.testing.runs import SMALL_STDLIB_RUN

SMALL = [*SMALL_STDLIB_RUN, "trainer.max_steps=3"]
TIMEOUT_S = 2  # parallel.collective_timeout_s of the cases where a peer hangs


@pytest.fixture(scope="module")
def cache_dir(stdlib_cache):
    return stdlib_cache


def _fault(rank: int, fault: str) -> None:
    """Patch this forked rank so that its run ends the way ``fault`` names."""
    from megatronish.training.trainer import Trainer

    step = Trainer.train_step

    def nonfinite_loss(self, losses):
        import torch

        return torch.tensor(float("nan"))  # every rank holds the loss (dp=2): each sees it

    def leave_at_step_2(self):
        if self.state.step == 1 and rank == 1:
            raise SystemExit(9)  # this rank leaves mid-run; its peer is in a collective
        return step(self)

    def hang_at_step_2(self):
        if self.state.step == 1 and rank == 1:
            time.sleep(3 * TIMEOUT_S)  # alive but silent: the peer's collective times out
            raise SystemExit(9)
        return step(self)

    if fault == "nonfinite":
        Trainer._mean_loss = nonfinite_loss
    elif fault in ("peer_gone", "peer_hangs"):
        Trainer.train_step = leave_at_step_2 if fault == "peer_gone" else hang_at_step_2


def _main(rank, world, cfg, fault, err_dir):
    import megatronish.train as entry
    from megatronish.distributed.shutdown import process_group_threads
    from megatronish.distributed.topology import Topology

    _fault(rank, fault)
    err_path = os.path.join(err_dir, f"rank{rank}.err")  # kept if the rank ends the process
    start = time.monotonic()
    with open(err_path, "w") as err, contextlib.redirect_stderr(err):
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                code = entry.main_with_config(cfg)
            except SystemExit as e:
                code = f"left with {e.code}"
    seconds = time.monotonic() - start
    gc.collect()
    left = sum(isinstance(o, Topology) for o in gc.get_objects())  # the run's objects went too
    with open(err_path) as f:
        return code, process_group_threads(), f.read(), seconds, left


def _indexed_with_a_bad_idx(cache_dir, tmp_path):
    """data=indexed overrides whose .idx is not an index (the tokenizer is the cached one)."""
    model = next(cache_dir.rglob("*.model"))
    prefix = tmp_path / "broken"
    (tmp_path / "broken.idx").write_bytes(b"not an index" * 10)
    (tmp_path / "broken.bin").write_bytes(b"\0" * 64)
    return ["data=indexed", f"data.prefix={prefix}", f"data.tokenizer_model={model}"]


CASES = {
    # name: (extra overrides, fault, exit code on rank 0, exit code on rank 1)
    "success": ([], "none", 0, 0),
    "stop request": (["trainer.exit_after_minutes=1e-9"], "none", 4, 4),
    "config error found after start-up": (["model.vocab_size=300"], "none", 2, 2),
    "data error": (None, "none", 3, 3),
    "checkpoint error": (["checkpoint.resume=/nonexistent/step_0000007"], "none", 3, 3),
    "too many skipped steps": (["trainer.max_skipped_steps=1"], "nonfinite", 5, 5),
    "a peer leaves mid-run": ([], "peer_gone", 6, "left with 9"),
    "a peer hangs": (
        [f"parallel.collective_timeout_s={TIMEOUT_S}"],
        "peer_hangs",
        6,
        "left with 9",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_no_process_group_thread_outlives_main(case, cache_dir, tmp_path):
    extra, fault, *codes = CASES[case]
    if extra is None:
        extra = _indexed_with_a_bad_idx(cache_dir, tmp_path)
    cfg = load_config(
        [*SMALL, f"data.cache_dir={cache_dir}", f"out_dir={tmp_path / 'out'}", *extra]
    )
    try:
        results = run_world(_main, 2, cfg, fault, str(tmp_path), init=False, timeout=120)
    except WorldError as e:  # e.g. a rank that ended its process itself: what it said
        said = {p.name: p.read_text()[-2000:] for p in sorted(tmp_path.glob("rank*.err"))}
        raise AssertionError(f"{e}\nstderr: {said}") from e
    for rank, (code, threads, err, _, topologies) in enumerate(results):
        assert code == codes[rank], f"rank {rank}: {err[-2000:]}"
        assert threads == [], f"rank {rank} still runs {threads} after main returned"
        assert topologies == 0, f"rank {rank} keeps its Topology (and model) alive"
        assert "Traceback" not in err, err
    if fault == "peer_hangs":  # rank 0 waited for the collective timeout, then little more
        assert results[0][3] < 30, results[0]
    if case == "success":
        ckpt = tmp_path / "out" / "checkpoints"
        assert (ckpt / "latest").read_text() == "step_0000003"
        meta = json.loads((ckpt / "step_0000003" / "metadata.json").read_text())
        assert meta["tokenizer"] == {"bos_token_id": 1, "eos_token_id": 2}  # the run's own
    assert os.environ.get("RANK") is None  # the forked ranks' environment stayed there


def _stuck_in_an_op(rank, world):
    import torch

    from megatronish.distributed.comm import all_reduce
    from megatronish.distributed.shutdown import shutdown_process_groups
    from megatronish.distributed.topology import Topology

    topo = Topology.build(tp=1, dp=2, pp=1, rank=rank)
    all_reduce(torch.ones(1), topo.dp_group)
    if rank == 0:
        time.sleep(3)  # never joins rank 1's next op; leaving ends it
        return None
    work = all_reduce(torch.ones(4), topo.dp_group, async_op=True)  # noqa: F841 - in flight
    topo.close()
    start = time.monotonic()
    why = shutdown_process_groups(wait_s=1.0)
    return why, time.monotonic() - start


def test_shutting_down_beside_an_op_that_cannot_finish_waits_a_bounded_time():
    _, (why, seconds) = run_world(_stuck_in_an_op, 2, timeout=60)
    # The entry point then exits at once with its code (os._exit), naming the reason.
    assert (
        why
        == "destroying the process groups did not finish within 1 s (a peer rank is gone or hung)"
    )
    assert seconds < 3, seconds


def _held_group(rank, world):
    import torch

    from megatronish.distributed.comm import all_reduce
    from megatronish.distributed.shutdown import shutdown_process_groups
    from megatronish.distributed.topology import Topology

    topo = Topology.build(tp=1, dp=2, pp=1, rank=rank)
    all_reduce(torch.ones(4), topo.dp_group)
    held = topo.dp_group.pg  # as torch's profiler holds the groups whose ops it recorded
    topo.close()
    start = time.monotonic()
    why = shutdown_process_groups(wait_s=30.0)
    del held
    return why, time.monotonic() - start


def test_groups_something_still_holds_are_reported_at_once():
    """A group still referenced (torch 2.13's profiler keeps those whose ops it recorded; whether
    it still does at exit depends on its timing) keeps its threads after destroy_process_group:
    nothing to wait for, the entry point is told at once and ends the process."""
    for why, seconds in run_world(_held_group, 2, timeout=90):
        assert why is not None and why.startswith("torch still holds "), why
        assert seconds < 10, seconds  # not the 30 s a wait for the threads would take
