"""Warm-up + cosine / linear / constant schedules."""

import pytest

from megatronish.optim.lr_schedule import lr_at


def test_warmup_then_cosine_to_min():
    kw = dict(lr=1.0, min_lr=0.1, warmup=10, decay=110, style="cosine")
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_constant():
    assert lr_at(55, lr=1.0, min_lr=0.0, warmup=5, decay=105, style="linear") == pytest.approx(0.5)
    assert lr_at(1000, lr=0.3, min_lr=0.0, warmup=0, decay=10, style="constant") == 0.3
