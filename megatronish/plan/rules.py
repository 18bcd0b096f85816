"""What the planner checks of a config: the trainer's rules
(:func:`~megatronish.config.validate.config_errors`) except the ``data`` section's, since it
reads no data (a plan can be made before the dataset exists), and the vocabulary it plans
with (:mod:`megatronish.plan.vocab`)."""

from __future__ import annotations

from megatronish.config.schema import TrainConfig
from megatronish.config.validate import config_errors, vocab_errors
from megatronish.plan.vocab import PlannedVocab, VocabError, planned_vocab


def planning_errors(cfg: TrainConfig, world_size: int) -> tuple[list[str], PlannedVocab | None]:
    """``(problems, vocabulary)``: every rule ``cfg`` breaks that the planner checks, and the
    vocabulary to plan with (None when there are problems)."""
    errors = config_errors(cfg, world_size, data=False)
    if errors:
        return errors, None
    try:
        vocab = planned_vocab(cfg)
    except VocabError as e:
        return [str(e)], None
    errors = vocab_errors(cfg, vocab.tokenizer or vocab.size)
    return errors, None if errors else vocab
