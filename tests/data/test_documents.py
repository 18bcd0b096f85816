"""Packed documents on the host: lengths from EOD tokens, and each microbatch's layout equal to
Megatron-LM's ``get_ltor_masks_and_position_ids`` (rewritten below from its loop form)."""

import numpy as np
import pytest
import torch

from megatronish.config.validate import config_errors
from megatronish.context_parallel.split import split_sequence
from megatronish.data.documents import (
    DocumentPacking,
    boundary_token,
    document_lengths,
    kept_targets,
    loss_divisor,
)
from megatronish.testing import runs
from megatronish.testing.synthetic import PackedPatternTokens

EOD = 2
ALL = {"reset_attention_mask": True, "reset_position_ids": True, "eod_mask_loss": True}


def megatron_layout(tokens: torch.Tensor, eod: int):
    """Megatron-LM's ``_get_ltor_masks_and_position_ids`` (all three options on) for inputs
    ``[b, s]``: (visible ``[b, s, s]`` bool, position ids, loss mask)."""
    b, s = tokens.shape
    visible = torch.tril(torch.ones(b, s, s, dtype=torch.bool))
    positions = torch.arange(s).repeat(b, 1)
    loss_mask = torch.ones(b, s)
    loss_mask[tokens == eod] = 0.0
    for row in range(b):
        eod_index = positions[row, tokens[row] == eod].clone()
        prev = 0
        for i in eod_index.tolist():
            visible[row, i + 1 :, : i + 1] = False
            positions[row, i + 1 :] -= i + 1 - prev
            prev = i + 1
    return visible, positions, loss_mask


def windows(n: int, s: int = 16) -> list[torch.Tensor]:
    data = PackedPatternTokens(250, s, EOD, seed=3)
    return [data[i] for i in range(n)]


def test_lengths_end_at_each_eod_and_sum_to_the_window():
    window = np.array([5, EOD, EOD, 7, 8, EOD, 9])
    assert document_lengths(window, EOD).tolist() == [2, 1, 3, 1]
    assert document_lengths(np.array([4, 5, 6]), EOD).tolist() == [3]  # longer than the window
    assert document_lengths(np.array([4, 5, EOD]), EOD).tolist() == [3]  # ends at the end
    for w in windows(8):
        lengths = document_lengths(w, EOD)
        assert lengths.sum() == w.numel() and (lengths > 0).all()


def test_microbatch_layout_is_megatrons():
    packing = DocumentPacking(eod=EOD, **ALL)
    rows = windows(8)
    samples = [(w, document_lengths(w, EOD)) for w in rows]
    docs = packing.microbatch(samples, cp=1, cp_rank=0, divisor=None)
    inputs = torch.stack(rows)[:, :-1]
    visible, positions, loss_mask = megatron_layout(inputs, EOD)
    ids = docs.ids
    s = inputs.shape[1]
    ours = (ids[:, :, None] == ids[:, None, :]) & torch.tril(torch.ones(s, s, dtype=torch.bool))
    assert torch.equal(ours, visible)
    assert torch.equal(docs.positions, positions)
    assert torch.equal(docs.loss_weights, loss_mask)
    kept = sum(kept_targets(n, s) for _, n in samples)
    assert kept == int(loss_mask.sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ranks_hold_their_chunks_of_the_layout_and_the_whole_ids(cp):
    packing = DocumentPacking(eod=EOD, **ALL)
    samples = [(w, document_lengths(w, EOD)) for w in windows(4)]
    whole = packing.microbatch(samples, 1, 0, 2.5)
    for rank in range(cp):
        local = packing.microbatch(samples, cp, rank, 2.5)
        assert torch.equal(local.ids, whole.ids)  # keys: the whole sequence's documents
        for name in ("positions", "loss_weights"):
            want = split_sequence(getattr(whole, name), 1, cp, rank)
            assert torch.equal(getattr(local, name), want), name
        assert local.loss_divisor == 2.5


def test_each_option_alone_sets_only_its_fields():
    samples = [(w, document_lengths(w, EOD)) for w in windows(2)]
    for key in ALL:
        docs = DocumentPacking(eod=EOD, **{key: True}).microbatch(samples, 1, 0, 1.0)
        present = {
            "ids": docs.ids is not None,
            "positions": docs.positions is not None,
            "loss": docs.loss_weights is not None,
        }
        assert sum(present.values()) == 1, (key, present)


def test_loss_divisor_makes_the_mean_over_the_global_batch():
    # 2 dp ranks x 2 cp ranks x 3 microbatches, 90 kept tokens: summed over every microbatch
    # of every rank, divided by dp*cp*m (the grads' and the reported loss's averaging) = 1/90
    d = loss_divisor(90, 4, 3)
    assert 1 / (d * 4 * 3) == pytest.approx(1 / 90)
    assert loss_divisor(0, 2, 1) == 0.5  # nothing kept: a zero loss, not a division by zero


def test_options_off_pack_nothing_and_boundaries_are_checked():
    assert DocumentPacking.from_config({}, 0) is None
    packing = DocumentPacking.from_config({"eod_mask_loss": True}, 5)
    assert packing.eod == 5 and packing.eod_mask_loss and not packing.reset_attention_mask
    cfg = {"reset_position_ids": True, "document_boundaries": "7"}
    assert DocumentPacking.from_config(cfg, 5).eod == 7
    assert boundary_token(3, None) == 3
    with pytest.raises(ValueError, match="no end-of-document id"):
        DocumentPacking.from_config({"reset_attention_mask": True}, None)
    with pytest.raises(ValueError, match="data.document_boundaries='bos'"):
        boundary_token("bos", 1)


def test_config_refuses_an_unknown_document_boundary():
    cfg = runs.test_config(["data.document_boundaries=bos", "data.reset_attention_mask=true"], 1)
    errors = config_errors(cfg, 1, data=False)
    assert any("data.document_boundaries='bos'" in e for e in errors), errors
    ok = runs.test_config(["data.document_boundaries=11", "data.reset_attention_mask=true"], 1)
    assert not config_errors(ok, 1, data=False)
