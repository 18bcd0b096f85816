"""The plan with document masks: attention FLOPs over the data's documents (the sum of their
squared lengths per window), read from the configured data's ``.idx``."""

import numpy as np
import pytest

from megatronish.data.documents import expected_attention_span
from megatronish.data.indexed import IndexedDatasetWriter
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of
from megatronish.plan.report import plan_report
from megatronish.testing.runs import test_config as tiny_config

LENGTHS = np.array([5] * 40 + [100] * 5 + [1] * 10 + [33] * 7)


def brute_force_span(lengths: np.ndarray, s: int, seed: int) -> float:
    """Documents in the seeded order as one stream of document ids, cut into ``s`` windows."""
    order = np.random.default_rng(seed).permutation(lengths)
    ids = np.repeat(np.arange(order.size), order)
    windows = ids.size // s
    pairs = 0
    for w in range(windows):
        _, counts = np.unique(ids[w * s : (w + 1) * s], return_counts=True)
        pairs += int((counts**2).sum())
    return pairs / (windows * s)


@pytest.mark.parametrize("s", [16, 64, 200])
def test_expected_span_is_the_packed_windows_mean_document_length(s):
    assert expected_attention_span(LENGTHS, s, seed=3) == pytest.approx(
        brute_force_span(LENGTHS, s, 3)
    )
    assert expected_attention_span(np.array([3]), 16) == 16.0  # no whole window: as unmasked


def indexed(tmp_path) -> str:
    prefix = str(tmp_path / "docs")
    writer = IndexedDatasetWriter(prefix, np.int32)
    for n in LENGTHS:
        writer.add_document(np.arange(n) % 7 + 3)
    writer.finalize()
    return prefix


def test_plan_counts_attention_over_the_datas_documents(tmp_path):
    data = ["data.source=indexed", f"data.prefix={indexed(tmp_path)}", "model.seq_length=64"]
    plain = tiny_config(data, 1)
    masked = tiny_config([*data, "data.reset_attention_mask=true"], 1)
    assert spec_of(plain).attended_keys is None
    spec = spec_of(masked, 250)
    assert spec.attended_keys == pytest.approx(expected_attention_span(LENGTHS, 64))
    assert spec.attended_keys < 40
    got = make_plan(spec, layout_from_config(masked, 1))
    whole = make_plan(spec_of(plain, 250), layout_from_config(plain, 1))
    L, h = spec.num_layers, spec.hidden_size
    saved = 12.0 * L * h * (64 - spec.attended_keys) * got.tokens_per_step
    assert got.model_flops_per_step == pytest.approx(whole.model_flops_per_step - saved)
    assert "attention within documents" in plan_report(got)


def test_plan_without_the_data_counts_whole_windows(tmp_path):
    missing = ["data.source=indexed", f"data.prefix={tmp_path / 'none'}"]
    cfg = tiny_config([*missing, "data.reset_attention_mask=true"], 1)
    assert spec_of(cfg, 250).attended_keys is None
