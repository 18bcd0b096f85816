"""GPTDataset: packed overlapping windows, seeded shuffles, splits, global-index lookups."""

import pickle

import numpy as np
import pytest
import torch

from megatronish.data.gpt_dataset import GPTDataset, get_batch, split_documents
from megatronish.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 7


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """40 documents of 0..30 tokens; token = 1000 * doc + position (doc 3 is empty)."""
    rng = np.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp("gpt") / "ds")
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in range(40):
            n = 0 if d == 3 else int(rng.integers(1, 31))
            w.add_document(1000 * d + np.arange(n))
    return IndexedDataset(prefix)


def _stream(indexed, order):
    return np.concatenate([indexed[int(d)] for d in order])


def test_windows_overlap_by_one_and_follow_the_shuffled_stream(indexed):
    ds = GPTDataset(indexed, SEQ, seed=1, valid_fraction=0.1)
    stream = _stream(indexed, ds.document_order(0))
    assert ds.samples_per_epoch == len(ds) == (len(stream) - 1) // SEQ
    positions = ds.sample_order(0)
    assert sorted(positions.tolist()) == list(range(ds.samples_per_epoch))
    samples = {}
    for k in range(ds.samples_per_epoch):
        x = ds[k]
        assert x.dtype == torch.long and x.shape == (SEQ + 1,)
        j = int(positions[k])
        assert x.tolist() == stream[j * SEQ : j * SEQ + SEQ + 1].tolist()
        samples[j] = x
    for j in range(ds.samples_per_epoch - 1):
        assert samples[j][-1] == samples[j + 1][0]


def test_document_order_is_shuffled_and_samples_are_shuffled(indexed):
    ds = GPTDataset(indexed, SEQ, seed=1, valid_fraction=0.1)
    assert not np.array_equal(ds.document_order(0), ds.documents)
    assert not np.array_equal(ds.sample_order(0), np.arange(ds.samples_per_epoch))


def test_same_seed_same_samples_different_seed_different(indexed):
    a, b = GPTDataset(indexed, SEQ, seed=5), GPTDataset(indexed, SEQ, seed=5)
    c = GPTDataset(indexed, SEQ, seed=6)
    assert torch.equal(get_batch(a, 0, 20), get_batch(b, 0, 20))
    assert not torch.equal(get_batch(a, 0, 20), get_batch(c, 0, 20))


def test_train_and_valid_splits_are_disjoint(indexed):
    train = GPTDataset(indexed, SEQ, seed=2, split="train", valid_fraction=0.1)
    valid = GPTDataset(indexed, SEQ, seed=2, split="valid", valid_fraction=0.1)
    assert len(valid.documents) == 4
    assert not set(train.documents.tolist()) & set(valid.documents.tolist())
    assert sorted([*train.documents.tolist(), *valid.documents.tolist()]) == list(range(40))
    for ds in (train, valid):
        docs = set((get_batch(ds, 0, 2 * len(ds)) // 1000).unique().tolist())
        assert docs <= set(ds.documents.tolist())


def test_split_sizes():
    assert [len(s) for s in split_documents(2, 0, 0.02)] == [1, 1]
    assert [len(s) for s in split_documents(1, 0, 0.02)] == [1, 0]
    assert [len(s) for s in split_documents(100, 0, 0.0)] == [100, 0]
    assert [len(s) for s in split_documents(1000, 0, 0.02)] == [980, 20]


def test_lookup_is_independent_of_access_order(indexed):
    """Global samples read in order equal those read by any dp partition, in any order."""
    ref = GPTDataset(indexed, SEQ, seed=3)
    total = 3 * ref.samples_per_epoch + 5
    in_order = [ref[g] for g in range(total)]
    for dp in (2, 3):
        for rank in range(dp):
            ds = GPTDataset(indexed, SEQ, seed=3)
            idx = list(range(rank, total, dp))[::-1]  # backwards: crosses epochs, evicts caches
            for g in idx:
                assert torch.equal(ds[g], in_order[g])


def test_later_epochs_reshuffle_and_cover_their_stream(indexed):
    ds = GPTDataset(indexed, SEQ, seed=4)
    spe = ds.samples_per_epoch
    assert not np.array_equal(ds.document_order(0), ds.document_order(1))
    order = ds.document_order(7)
    stream = _stream(indexed, order)
    positions = ds.sample_order(7)
    for k in (0, 1, spe - 1):
        j = int(positions[k])
        assert ds[7 * spe + k].tolist() == stream[j * SEQ : j * SEQ + SEQ + 1].tolist()
    assert ds[10**9].shape == (SEQ + 1,)


def test_pickles_without_copying_the_data(indexed):
    ds = GPTDataset(indexed, SEQ, seed=0)
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    assert torch.equal(pickle.loads(blob)[123], ds[123])


def test_get_batch(indexed):
    ds = GPTDataset(indexed, SEQ, seed=0)
    batch = get_batch(ds, 11, 4)
    assert batch.shape == (4, SEQ + 1) and batch.dtype == torch.long
    assert all(torch.equal(batch[i], ds[11 + i]) for i in range(4))
    assert get_batch(ds, 0, 0).shape == (0, SEQ + 1)


def test_too_few_tokens_is_a_clear_error(indexed):
    with pytest.raises(ValueError, match="fewer than seq_length"):
        GPTDataset(indexed, 10_000, seed=0)
    with pytest.raises(ValueError, match="valid split"):
        GPTDataset(indexed, SEQ, seed=0, split="valid", valid_fraction=0.0)
    with pytest.raises(IndexError):
        GPTDataset(indexed, SEQ, seed=0)[-1]
