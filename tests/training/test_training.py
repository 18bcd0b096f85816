"""The single-process trainer and plain data parallelism (zero 0) against one process."""

import math

import pytest

from megatronish.testing.compare import assert_parity, max_relative_loss_gap
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import PARITY_STEPS, losses_of, train_layout


@pytest.fixture(scope="module")
def reference():
    return [train_layout(0, 1, [], PARITY_STEPS)]


@pytest.mark.slow
def test_short_run_lowers_the_loss():
    losses = train_layout(0, 1, ["trainer.global_batch_size=16"], 30).losses
    assert losses[0] == pytest.approx(math.log(250), abs=0.3)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_training_is_deterministic(reference):
    again = [train_layout(0, 1, [], PARITY_STEPS)]
    assert losses_of(again) == losses_of(reference)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_one_process(reference, world):
    assert_parity(reference, run_world(train_layout, world, [], PARITY_STEPS))


def test_gradient_accumulation_matches_one_big_microbatch(reference):
    big = [train_layout(0, 1, ["trainer.micro_batch_size=8"], PARITY_STEPS)]
    assert max_relative_loss_gap(losses_of(reference), losses_of(big)) < 1e-5


def test_evaluation_runs_without_dropout_and_leaves_training_on():
    """Validation losses come from the model in eval mode: with dropout configured they equal
    the dropout-free model's, every time; the next training step trains with dropout again."""
    from megatronish.testing.runs import build_trainer
    from megatronish.testing.synthetic import PatternTokens

    dropout = ["model.hidden_dropout=0.3", "model.attention_dropout=0.3"]
    losses = []
    for overrides in (dropout, []):
        trainer = build_trainer(0, 1, overrides, 1)  # the same initial weights either way
        trainer.valid_data = PatternTokens(250, 16, seed=99)
        losses.append([trainer.evaluate(), trainer.evaluate()])
        assert all(c.training is False for c in trainer.chunks)
        trainer.train_step()
        assert all(c.training for c in trainer.chunks)
    assert losses[0][0] == losses[0][1] == losses[1][0]
