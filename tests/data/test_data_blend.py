"""Weighted blends (``data.blend``): Megatron's greedy index, its cache, and training on one."""

import os

import numpy as np
import pytest

import megatronish.data.blend as blend_module
from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.data.blend import blend_indices, cache_key, cached_blend_indices
from megatronish.data.build import build_datasets
from megatronish.data.indexed import IndexedDatasetWriter
from megatronish.data.stdlib_corpus import ensure_stdlib_corpus
from megatronish.testing.multiproc import run_world
from megatronish.testing.runs import SMALL_STDLIB_RUN

WEIGHTS = [0.5, 0.3, 0.2]


def test_greedy_order_by_hand():
    """Megatron's rule: sample g goes to argmax w * max(g, 1) - taken (ties: the lower index)."""
    datasets, samples = blend_indices([3, 1], 8)  # weights are normalised: 0.75, 0.25
    assert datasets.tolist() == [0, 1, 0, 0, 0, 1, 0, 0]
    assert samples.tolist() == [0, 0, 1, 2, 3, 1, 4, 5]


def test_every_prefix_and_window_matches_the_weights():
    n = 20_000
    datasets, samples = blend_indices(WEIGHTS, n)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[datasets], axis=0)  # [n, 3] taken so far
    expected = np.outer(np.arange(1, n + 1), WEIGHTS)
    assert np.abs(counts - expected).max() <= 1.0  # every prefix within one sample
    windows = counts[100:] - counts[:-100]  # every window of 100 samples
    assert np.abs(windows - 100 * np.array(WEIGHTS)).max() <= 2.0
    for d in range(3):  # each dataset is read in order, sample after sample
        assert samples[datasets == d].tolist() == list(range(int((datasets == d).sum())))
    short = blend_indices(WEIGHTS, 500)  # a longer run only appends
    assert np.array_equal(short[0], datasets[:500]) and np.array_equal(short[1], samples[:500])


def test_cache_is_reused_keyed_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    logged = []
    first = cached_blend_indices(WEIGHTS, 1000, str(tmp_path), logged.append)
    files = sorted(os.listdir(tmp_path))
    assert [f.rsplit("-", 1)[1] for f in files] == ["crc32.json", "dataset.npy", "sample.npy"]
    assert logged

    def no_rebuild(*args):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(blend_module, "blend_indices", no_rebuild)
    again = cached_blend_indices([5, 3, 2], 1000, str(tmp_path), logged.append)  # same shares
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert cache_key(WEIGHTS, 1000) == cache_key([5, 3, 2], 1000)
    assert cache_key(WEIGHTS, 1000) != cache_key([0.5, 0.2, 0.3], 1000)
    assert cache_key(WEIGHTS, 1000) != cache_key(WEIGHTS, 1001)
    monkeypatch.undo()

    (tmp_path / files[0]).write_bytes(b"not an npy file")
    logged.clear()
    rebuilt = cached_blend_indices(WEIGHTS, 1000, str(tmp_path), logged.append)
    assert "damaged" in logged[0] and all(np.array_equal(a, b) for a, b in zip(first, rebuilt))
    cached_blend_indices([0.2, 0.3, 0.5], 1000, str(tmp_path), logged.append)
    assert len(os.listdir(tmp_path)) == 6  # other weights: another index


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, stdlib_cache):
    """Two indexed datasets whose tokens tell them apart, and the stdlib corpus's tokenizer."""
    tmp = tmp_path_factory.mktemp("blend")
    _, model = ensure_stdlib_corpus(str(stdlib_cache), 512, 0.5)
    rng = np.random.default_rng(0)
    prefixes = {}
    for name, (lo, hi) in {"web": (10, 200), "code": (300, 500)}.items():
        with IndexedDatasetWriter(str(tmp / name), np.uint16) as w:
            for _ in range(40):
                w.add_document(rng.integers(lo, hi, size=int(rng.integers(20, 90))))
        prefixes[name] = str(tmp / name)
    return tmp, prefixes, model


def _source(sample) -> str:
    return "web" if int(sample.max()) < 200 else "code"


def test_blend_reads_each_dataset_in_proportion(corpora):
    tmp, prefixes, model = corpora
    cfg = {
        "blend": [[0.7, prefixes["web"]], [0.3, prefixes["code"]]],
        "tokenizer_model": model,
        "cache_dir": str(tmp / "cache"),
        "valid_fraction": 0.1,
    }
    train, valid, _ = build_datasets(cfg, 32, 1234, samples=(400, 40), log=lambda m: None)
    sources = [_source(train[g]) for g in range(400)]
    assert sources.count("web") == 280 and sources.count("code") == 120
    web = build_datasets(
        {
            "prefix": prefixes["web"],
            "source": "indexed",
            "tokenizer_model": model,
            "valid_fraction": 0.1,
        },
        32,
        1234,
    )[0]
    g = sources.index("web", 5)  # the blend's web samples are the web dataset's, in order
    assert np.array_equal(train[g].numpy(), web[sources[:g].count("web")].numpy())
    assert len(valid) == 40 and valid.names == ["web", "code"]
    assert train.describe()[0].startswith("web: weight 0.700, 280 samples (")
    with pytest.raises(IndexError, match="raise trainer.max_steps"):
        train[400]
    own = build_datasets(
        {**cfg, "blend_valid": [[1.0, prefixes["code"]]]},
        32,
        1234,
        samples=(400, 40),
        log=lambda m: None,
    )[1]
    assert {_source(own[g]) for g in range(40)} == {"code"}


def test_blend_config_errors_name_the_entry(corpora, tmp_path):
    _, prefixes, model = corpora
    errors = config_errors(
        load_config(
            [
                f"data.blend=[[0.7,{prefixes['web']}],[0,{tmp_path}/x]]",
                f"data.tokenizer_model={model}",
            ]
        ),
        1,
    )
    assert any("data.blend[1] has weight 0" in e for e in errors), errors
    assert any(f"data.blend[1]: {tmp_path}/x.idx does not exist" in e for e in errors), errors
    errors = config_errors(
        load_config([f"data.blend=[0.7,{prefixes['web']}]", f"data.prefix={prefixes['web']}"]), 1
    )
    assert any("must be a [weight, prefix] pair" in e for e in errors)
    assert any("data.blend and data.prefix" in e for e in errors)
    assert any("needs data.tokenizer_model" in e for e in errors)


def _train(rank, world, cfg):
    import megatronish.train as entry

    return [r.loss for r in entry.run(cfg)]


def test_training_on_a_blend_is_the_same_in_every_layout(corpora, tmp_path, capfd):
    """The blend is indexed by the global sample cursor: one rank and two data-parallel ranks
    train on the same samples; the start lists each dataset's samples, eval each one's loss."""
    tmp, prefixes, model = corpora
    run = [
        *SMALL_STDLIB_RUN,
        f"data.blend=[[0.6,{prefixes['web']}],[0.4,{prefixes['code']}]]",
        f"data.tokenizer_model={model}",
        f"data.cache_dir={tmp / 'cache'}",
        "trainer.max_steps=3",
        "trainer.eval_interval=3",
        "trainer.eval_iters=2",
        "checkpoint.dir=null",
    ]
    one = _train(0, 1, load_config([*run, f"out_dir={tmp_path / 'one'}"]))
    out = capfd.readouterr().out
    assert "[data] train blend of 12 samples:" in out and "web: weight 0.600" in out
    assert "| web " in out.split("eval   step      3")[1] and "| code " in out
    two = run_world(_train, 2, load_config([*run, f"out_dir={tmp_path / 'two'}"]), init=False)
    losses = next(r for r in two if r[0] == r[0])
    assert np.allclose(one, losses, rtol=1e-5), (one, losses)


# -- which documents validation reads ------------------------------------------------------------
LABELLED_DOCS = {"a": 12, "b": 16, "c": 20}  # documents per dataset


def _label(k: int, j: int) -> int:
    """The token every position of document ``j`` of dataset ``k`` holds."""
    return 100 + 32 * k + j


def _origins(sample) -> set[tuple[int, int]]:
    """``(dataset, document)`` of every token of a sample."""
    return {divmod(int(t) - 100, 32) for t in sample}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, stdlib_cache):
    """Three datasets whose every token names its dataset and document (:func:`_label`)."""
    tmp = tmp_path_factory.mktemp("labelled")
    _, model = ensure_stdlib_corpus(str(stdlib_cache), 512, 0.5)
    rng = np.random.default_rng(1)
    prefixes = []
    for k, (name, docs) in enumerate(LABELLED_DOCS.items()):
        with IndexedDatasetWriter(str(tmp / name), np.uint16) as w:
            for j in range(docs):
                w.add_document(np.full(int(rng.integers(6, 20)), _label(k, j)))
        prefixes.append(str(tmp / name))
    return tmp, prefixes, model


def test_validation_reads_the_valid_split_or_the_whole_blend_valid_datasets(labelled):
    """Validation sample g is sample ``s`` of dataset ``d`` for Megatron's index of the
    validation weights: of the valid split of each ``data.blend`` dataset, or of the whole
    ``data.blend_valid`` datasets (their own weights); training reads only train splits."""
    from megatronish.data.gpt_dataset import GPTDataset, split_documents
    from megatronish.data.indexed import IndexedDataset

    tmp, (a, b, c), model = labelled
    seq, seed, n_valid, fraction = 8, 7, 40, 0.25
    cfg = {
        "blend": [[0.6, a], [0.4, b]],
        "tokenizer_model": model,
        "valid_fraction": fraction,
        "cache_dir": str(tmp / "cache"),
    }
    train, valid, _ = build_datasets(cfg, seq, seed, samples=(60, n_valid), log=lambda m: None)
    splits = [split_documents(n, seed, fraction) for n in LABELLED_DOCS.values()]
    for g in range(60):  # training: train splits only
        assert all(j in splits[k][0] for k, j in _origins(train[g]))

    def expected(prefixes, weights, split, frac):
        parts = [GPTDataset(IndexedDataset(p), seq, seed, split, frac) for p in prefixes]
        return [parts[d][s] for d, s in zip(*blend_indices(weights, n_valid))]

    want = expected([a, b], [0.6, 0.4], "valid", fraction)
    for g in range(n_valid):
        (k,) = {k for k, _ in _origins(valid[g])}  # one dataset per sample
        assert all(j in splits[k][1] for _, j in _origins(valid[g])), (g, _origins(valid[g]))
        assert np.array_equal(valid[g].numpy(), want[g].numpy()), g

    own = build_datasets(
        {**cfg, "blend_valid": [[0.25, b], [0.75, c]]},
        seq,
        seed,
        samples=(60, n_valid),
        log=lambda m: None,
    )[1]
    want = expected([b, c], [0.25, 0.75], "train", 0.0)
    seen = set()
    for g in range(n_valid):
        seen |= _origins(own[g])
        assert np.array_equal(own[g].numpy(), want[g].numpy()), g
    assert {k for k, _ in seen} == {1, 2}  # b and c, never a
    for k in (1, 2):  # whole datasets: documents of both of their own splits are read
        assert {j for kk, j in seen if kk == k} & set(splits[k][0].tolist())
        assert {j for kk, j in seen if kk == k} & set(splits[k][1].tolist())
    counts = np.bincount(blend_indices([0.25, 0.75], n_valid)[0], minlength=2).tolist()
    assert own.counts() == counts == [10, 30]
