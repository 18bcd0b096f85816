"""A step's loss and grad norm stay on the device until the trainer settles them: what a direct
save, a load and a failing settle do with steps that are not settled yet."""

import math
import os

import pytest
import torch

from megatronish.checkpoint.load import load_into
from megatronish.testing.runs import build_trainer
from megatronish.training.numerics import StepResult, TooManySkippedSteps

QUICK = ["model.num_layers=2", "trainer.micro_batch_size=4", "trainer.global_batch_size=4"]


def nan_grads_in_step(trainer, step: int) -> None:
    """Step ``step``'s grads (and so its global norm) are nan: the step is skipped."""
    first = next(trainer.chunks[0].parameters())
    first.register_hook(lambda g: g * float("nan") if trainer.state.step + 1 == step else g)


def test_a_direct_save_settles_first_and_refuses_inside_a_skip_streak(tmp_path):
    trainer = build_trainer(0, 1, [*QUICK, f"checkpoint.dir={tmp_path}"], steps=3, saving=True)
    nan_grads_in_step(trainer, 1)
    skipped = trainer.train_step()
    assert not skipped.settled
    assert trainer.saver.save(blocking=True) is None  # as the loop: no save in a skip streak
    assert skipped.skipped and trainer.state.skipped_steps == trainer.state.skipped_in_a_row == 1
    assert not os.path.exists(tmp_path / "step_0000001")


def test_a_load_drops_the_steps_it_replaces(tmp_path):
    trainer = build_trainer(0, 1, [*QUICK, f"checkpoint.dir={tmp_path}"], steps=3, saving=True)
    saved = trainer.saver.save(blocking=True)  # step 0
    nan_grads_in_step(trainer, 1)
    nan_grads_in_step(trainer, 2)
    trainer.train_step()
    before = trainer.train_step()  # settles step 1 (a skip streak); step 2 is not settled
    load_into(trainer.checkpoint_parts, saved)
    trainer.settle()
    state = trainer.state
    assert (state.step, state.skipped_steps, state.skipped_in_a_row) == (0, 0, 0)
    assert before not in state.history
    with pytest.raises(RuntimeError, match="step 2 was never settled"):
        _ = before.loss


def test_a_settle_that_raises_has_settled_every_pending_step():
    trainer = build_trainer(0, 1, [*QUICK, "trainer.max_skipped_steps=1"], steps=3)
    nan = torch.full((2,), float("nan"))
    pending = [StepResult(n, 1e-3, nan.clone(), trainer.settle) for n in (1, 2)]
    trainer._unsettled = list(pending)
    with pytest.raises(TooManySkippedSteps, match="stopping at step 1: 1 steps in a row"):
        trainer.settle()
    assert all(r.settled for r in pending) and math.isnan(pending[1].grad_norm)
    assert trainer.state.skipped_steps == 1 and trainer.state.history == []  # stopped at step 1
