"""Non-finite losses and grads: the step is skipped on every rank and leaves the optimizer alone;
``trainer.max_skipped_steps`` skipped steps in a row stop the run before anything is saved."""

import math
import os

import pytest
import torch

from megatronish.config.compose import load_config
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import build_trainer
from megatronish.training.numerics import TooManySkippedSteps
from megatronish.training.progress import ProgressLogger

NAN, INF = float("nan"), float("inf")


def optimizer_state(trainer) -> dict:
    """Copies of everything a step updates on this rank: params, Adam moments, step count."""
    zero, opt = trainer.zero, trainer.optimizer
    params = [(b.param_flat if zero.stage < 3 else b.param_shard).clone() for b in zero.buckets]
    return {
        "params": params,
        "exp_avg": [t.clone() for t in opt.exp_avg],
        "exp_avg_sq": [t.clone() for t in opt.exp_avg_sq],
        "step": opt.step_count,
    }


def identical(a: dict, b: dict) -> bool:
    tensors = ("params", "exp_avg", "exp_avg_sq")
    return a["step"] == b["step"] and all(
        torch.equal(x, y) for k in tensors for x, y in zip(a[k], b[k], strict=True)
    )


def inject_faults(trainer, loss_at=None, grad_steps=(), poison_from=None):
    """Make steps (1-based) non-finite on this rank.

    ``loss_at``: {step: value} replaces the losses this rank reports (its grads stay finite);
    ``grad_steps``: a hook turns the grad of this rank's first parameter into nan;
    ``poison_from``: from that step on, this rank's first parameter is nan (a persistent fault).
    """
    loss_at = loss_at or {}
    first = next(trainer.chunks[0].parameters())
    inner = trainer.forward_backward

    def next_step() -> int:
        return trainer.state.step + 1

    def forward_backward(chunks, microbatches, **kw):
        if poison_from is not None and next_step() == poison_from:
            with torch.no_grad():
                first.fill_(NAN)
        losses = inner(chunks, microbatches, **kw)
        if next_step() in loss_at:
            losses = [torch.full_like(x, loss_at[next_step()]) for x in losses]
        return losses

    trainer.forward_backward = forward_backward
    first.register_hook(lambda g: g * NAN if next_step() in grad_steps else g)


def test_skipped_steps_leave_the_optimizer_untouched_and_are_logged(capsys, tmp_path):
    trainer = build_trainer(0, 1, [], steps=8)
    trainer.logger = ProgressLogger(trainer.cfg, enabled=True, run_dir=str(tmp_path))
    inject_faults(trainer, loss_at={5: NAN, 6: INF}, grad_steps={3})
    skipped = []
    for step in range(1, 9):
        before = optimizer_state(trainer)
        r = trainer.train_step()
        after = optimizer_state(trainer)
        if r.skipped:
            skipped.append(step)
            assert identical(before, after), f"step {step} changed the optimizer state"
        else:
            assert math.isfinite(r.loss) and after["step"] == before["step"] + 1
    assert skipped == [3, 5, 6]
    assert trainer.state.skipped_steps == 3 and trainer.state.skipped_in_a_row == 0
    assert trainer.optimizer.step_count == 5
    out = capsys.readouterr().out
    assert "step 3 skipped: loss" in out and "grad norm nan" in out
    assert "step 6 skipped: loss inf" in out and "(2 in a row, the run stops after 5" in out


def _faults_in_a_layout(rank, world, layout, loss_rank, grad_rank):
    # A short collective timeout: ranks that disagreed about a skip would fail fast, not hang.
    overrides = [*layout, "trainer.max_skipped_steps=3", "parallel.collective_timeout_s=30"]
    trainer = build_trainer(rank, world, overrides, steps=10)
    # Step 2: a nan loss only on one rank that holds the loss (its grads are finite).
    # Step 4: a nan grad on one rank. From step 6: an inf loss on one rank, every step.
    loss_at = {2: NAN, **{s: INF for s in range(6, 11)}} if rank == loss_rank else {}
    inject_faults(trainer, loss_at=loss_at, grad_steps={4} if rank == grad_rank else ())
    flags, untouched, stopped = [], [], None
    while stopped is None:
        before = optimizer_state(trainer)
        try:
            flags.append(trainer.train_step().skipped)
        except TooManySkippedSteps as e:
            flags.append(True)
            stopped = str(e)
        if flags[-1]:
            untouched.append(identical(before, optimizer_state(trainer)))
    return flags, untouched, trainer.state.skipped_steps, trainer.state.step, stopped


@pytest.mark.parametrize(
    "layout, loss_rank, grad_rank",
    [
        # pp=2 x dp=2, ZeRO 0 (grad norm over tp x pp only): ranks 2 and 3 hold the loss;
        # rank 0 is the first stage of dp rank 0, which sees neither fault itself.
        (["parallel.pp=2", "parallel.zero_stage=0"], 3, 1),
        # tp=2 x dp=2, ZeRO 3 with sequence parallelism: every rank holds the loss.
        (["parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=3"], 1, 2),
    ],
    ids=["pp2-dp2-zero0", "tp2-dp2-sp-zero3"],
)
def test_every_rank_skips_the_same_steps_and_stops_together(layout, loss_rank, grad_rank):
    results = run_world(_faults_in_a_layout, 4, layout, loss_rank, grad_rank)
    for flags, untouched, skipped_steps, step, stopped in results:
        assert flags == [False, True, False, True, False, True, True, True]
        assert untouched == [True] * 5
        assert skipped_steps == 5 and step == 8
        assert stopped.startswith("stopping at step 8: 3 steps in a row had a non-finite loss")
        assert "trainer.max_skipped_steps=3" in stopped


def test_the_limit_counts_consecutive_steps_only():
    trainer = build_trainer(0, 1, ["trainer.max_skipped_steps=2"], steps=7)
    inject_faults(trainer, grad_steps={2, 4, 6})
    history = trainer.fit()
    assert [r.skipped for r in history] == [False, True, False, True, False, True, False]
    assert trainer.state.skipped_steps == 3


@pytest.mark.slow
def test_the_limit_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    overrides = ["trainer.max_skipped_steps=3", "checkpoint.interval=2", f"checkpoint.dir={ckpt}"]
    trainer = build_trainer(0, 1, overrides, steps=10, saving=True)
    inject_faults(trainer, poison_from=5)  # a nan parameter: every step from 5 on is skipped
    with pytest.raises(TooManySkippedSteps, match="stopping at step 7: 3 steps in a row"):
        trainer.fit()
    assert [r.skipped for r in trainer.state.history] == [False] * 4 + [True] * 2
    assert (ckpt / "latest").read_text() == "step_0000004"
    assert sorted(os.listdir(ckpt)) == ["latest", "step_0000002", "step_0000004"]  # not step 6


def test_the_entry_point_exits_5_with_one_line(monkeypatch, capsys):
    import megatronish.train as entry

    def run(cfg, stop=None, launch=None):
        raise TooManySkippedSteps("stopping at step 7: 3 steps in a row had a non-finite loss")

    monkeypatch.setattr(entry, "run", run)
    assert entry.main_with_config(load_config(["trainer.device=cpu"])) == entry.EXIT_NONFINITE == 5
    err = capsys.readouterr().err
    assert err == "error: stopping at step 7: 3 steps in a row had a non-finite loss\n"


def test_skip_limit_message_names_the_limit_and_the_way_out():
    from megatronish.training.numerics import skip_limit_message

    text = skip_limit_message(12, 5, NAN, INF)
    assert text.startswith("stopping at step 12: 5 steps in a row")
    assert "trainer.max_skipped_steps=5" in text and "loss inf" in text and "resume" in text
    assert "loss" not in skip_limit_message(12, 5, NAN, None).split("last:")[1]
