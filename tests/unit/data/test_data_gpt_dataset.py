"""GPTDataset samples, index caching, splits, blending through the builder, and exact resume of the samplers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.data.gpt_builder import build_data_loader, build_train_valid_test_datasets
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.split import split_boundaries
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from megatron.errors import DataError

SEQ = 32


def stream_of(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)


def test_samples_are_windows_of_the_shuffled_document_stream(dataset_prefix, tmp_path):
    indexed = IndexedDataset(dataset_prefix)
    n_docs = indexed.num_documents
    tokens = int(indexed.sizes[:100].sum())
    quiet = {"cache_dir": str(tmp_path), "log": lambda _: None}
    ds = GPTDataset("train", indexed, 0, 100, num_samples=3 * tokens // SEQ, seq_length=SEQ, seed=7, **quiet)
    assert ds.num_epochs == 3 + (3 * tokens // SEQ * SEQ + 1 > 3 * tokens)
    assert len(ds) >= 3 * tokens // SEQ
    # Upstream's order: the documents of all epochs are shuffled together (each one num_epochs times); a last epoch
    # used for less than 80% of its samples is shuffled on its own after the others.
    assert np.all(np.bincount(ds.doc_idx, minlength=100) == ds.num_epochs) and len(ds.doc_idx) == 100 * ds.num_epochs
    last_share = (3 * tokens // SEQ - ((ds.num_epochs - 1) * tokens - 1) // SEQ) / ((tokens - 1) // SEQ)
    if last_share < 0.8:
        assert sorted(ds.doc_idx[-100:].tolist()) == list(range(100))
    assert sorted(ds.doc_idx[:100].tolist()) != list(range(100))  # epochs are mixed, not one permutation each
    stream = stream_of(ds)
    for i in [0, 1, 2, len(ds) // 2, len(ds) - 1]:
        s = int(ds.shuffle_idx[i])
        got = ds[i]["text"]
        assert got.dtype == np.int64 and got.shape == (SEQ + 1,)
        np.testing.assert_array_equal(got, stream[s * SEQ : s * SEQ + SEQ + 1])
    assert sorted(ds.shuffle_idx.tolist()) == list(range(len(ds)))
    assert 100 < n_docs


def test_per_epoch_order_is_opt_in_and_keeps_epochs_apart(dataset_prefix, tmp_path):
    """--per-epoch-doc-shuffle: each epoch of doc_idx is a permutation of the documents on its own (not upstream's
    order, so it must differ from the default and be cached apart from it)."""
    indexed = IndexedDataset(dataset_prefix)
    kwargs = {"num_samples": 3 * int(indexed.sizes[:60].sum()) // SEQ, "seq_length": SEQ, "seed": 7,
              "cache_dir": str(tmp_path), "log": lambda _: None}
    ours = GPTDataset("train", indexed, 0, 60, per_epoch_order=True, **kwargs)
    default = GPTDataset("train", indexed, 0, 60, **kwargs)
    assert ours.num_epochs == default.num_epochs >= 3 and ours.hash != default.hash
    for e in range(ours.num_epochs):
        assert sorted(ours.doc_idx[e * 60 : (e + 1) * 60].tolist()) == list(range(60))
    assert not np.array_equal(ours.doc_idx, default.doc_idx)
    rng = np.random.RandomState(7)  # the former build, by hand: one permutation per epoch from one generator
    np.testing.assert_array_equal(ours.doc_idx, np.concatenate([rng.permutation(60) for _ in range(ours.num_epochs)]))


def test_index_cache_is_reused_and_keyed_by_description(dataset_prefix, tmp_path):
    indexed = IndexedDataset(dataset_prefix)
    logs, barriers = [], []
    kwargs = {"num_samples": 200, "seq_length": SEQ, "cache_dir": str(tmp_path), "log": logs.append}
    kwargs["barrier"] = lambda: barriers.append(1)
    a = GPTDataset("train", indexed, 0, 50, seed=1, **kwargs)
    b = GPTDataset("train", indexed, 0, 50, seed=1, **kwargs)
    c = GPTDataset("train", indexed, 0, 50, seed=2, **kwargs)
    assert len(logs) == 2 and len(barriers) == 3  # b loaded a's files; every construction met the barrier
    assert a.hash == b.hash != c.hash
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    # A rank that does not build and finds no cache must say where the cache must live.
    with pytest.raises(DataError, match="--data-cache-path"):
        GPTDataset("train", indexed, 0, 50, seed=3, build_on_this_rank=False, **kwargs)


def test_split_boundaries():
    assert split_boundaries("969,30,1", 1000) == [0, 969, 999, 1000]
    assert split_boundaries("98/2", 100) == [0, 98, 100, 100]
    assert split_boundaries("1", 7) == [0, 7, 7, 7]
    # The corpus: rounding gives 2211 + 68 + 2 = 2281 of 2282 documents; upstream shifts every boundary by
    # the missing one (train gets 2212), where a clamp of the last boundary alone would give train 2211.
    assert split_boundaries("969,30,1", 2282) == [0, 2212, 2280, 2282]
    assert split_boundaries("1,1,1", 100) == [0, 34, 67, 100]  # 33 + 33 + 33 = 99: all shifted by one


def test_builder_splits_are_disjoint_and_sized(dataset_prefix, tmp_path):
    train, valid, test = build_train_valid_test_datasets(
        [dataset_prefix], "90,8,2", SEQ, 1234, (500, 40, 0), str(tmp_path), 600, log=lambda _: None
    )
    assert test is None and len(train) >= 500 and len(valid) >= 40
    assert set(train.doc_idx.tolist()).isdisjoint(valid.doc_idx.tolist())
    n = IndexedDataset(dataset_prefix).num_documents
    assert max(train.doc_idx) < round(0.9 * n) <= min(valid.doc_idx)


def test_blend_through_builder_within_one_percent(dataset_prefix, tmp_path):
    train, _, _ = build_train_valid_test_datasets(
        ["3", dataset_prefix, "1", dataset_prefix], "1", SEQ, 5, (10_000, 0, 0), str(tmp_path), 600, log=lambda _: None
    )
    # Upstream's sizes: each part gets ceil(10000 x weight x 1.005) samples and the blend holds their sum.
    assert [len(d) >= n for d, n in zip(train.datasets, [7538, 2513], strict=True)] == [True, True]
    assert len(train) == 7538 + 2513
    share = np.bincount(train.dataset_index, minlength=2) / len(train)
    np.testing.assert_allclose(share, [0.75, 0.25], rtol=0.01)
    d, k = int(train.dataset_index[9_999]), int(train.dataset_sample_index[9_999])
    np.testing.assert_array_equal(train[9_999]["text"], train.datasets[d][k]["text"])


def _batches(loader) -> list[torch.Tensor]:
    return [b["text"] for b in loader]


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_restart_at_consumed_samples_gives_same_samples_in_order(dataset_prefix, tmp_path, dataloader_type):
    train, _, _ = build_train_valid_test_datasets(
        [dataset_prefix], "5,95", SEQ, 3, (96, 0, 0), str(tmp_path), 600, log=lambda _: None
    )
    assert 96 <= len(train) < 400  # a small train split keeps the seven passes below fast
    mbs, dp = 2, 2
    gbs = mbs * dp
    full = {
        r: _batches(build_data_loader(train, 0, mbs, r, dp, dataloader_type=dataloader_type, seed=9)) for r in (0, 1)
    }
    assert len(full[0]) == len(train) // gbs
    for steps_done in (1, 5, 11):
        for r in (0, 1):
            loader = build_data_loader(train, steps_done * gbs, mbs, r, dp, dataloader_type=dataloader_type, seed=9)
            resumed = _batches(loader)
            assert len(resumed) == len(full[r]) - steps_done
            for x, y in zip(resumed, full[r][steps_done:], strict=True):
                assert torch.equal(x, y)
    # The two ranks together read every usable sample exactly once.
    samplers = [build_data_loader(train, 0, mbs, r, dp, dataloader_type=dataloader_type).batch_sampler for r in (0, 1)]
    indices = sorted(i for sampler in samplers for batch in sampler for i in batch)
    assert indices == list(range(len(train) // gbs * gbs))


def test_sequential_sampler_slices_each_global_batch():
    s0 = list(MegatronPretrainingSampler(20, 8, 3, 0, 2))
    s1 = list(MegatronPretrainingSampler(20, 8, 3, 1, 2))
    assert s0 == [[8, 9, 10], [14, 15, 16]] and s1 == [[11, 12, 13], [17, 18, 19]]
    assert list(MegatronPretrainingSampler(21, 18, 2, 1, 2, drop_last=False)) == [[20]]


def test_random_sampler_next_epoch_resumes_too():
    full = MegatronPretrainingRandomSampler(24, 0, 2, 1, 2)
    epoch0, epoch1 = list(full), list(full)  # a cyclic loader iterates again for the next epoch
    assert sorted(i for b in epoch0 for i in b) == list(range(12, 24)) and epoch0 != epoch1
    # Upstream's order: rank 1's bucket [12, 24) walked in torch.randperm order seeded with the epoch number.
    for epoch, got in ((0, epoch0), (1, epoch1)):
        perm = (torch.randperm(12, generator=torch.Generator().manual_seed(epoch)) + 12).tolist()
        assert got == [perm[i : i + 2] for i in range(0, 12, 2)]
    resumed = list(MegatronPretrainingRandomSampler(24, 24 + 8, 2, 1, 2))
    assert resumed == epoch1[2:]
    # Without data sharding all ranks walk one permutation of the whole and take every dp-th sample.
    whole = torch.randperm(24, generator=torch.Generator().manual_seed(0)).tolist()
    unsharded = list(MegatronPretrainingRandomSampler(24, 8, 2, 1, 2, data_sharding=False))
    assert unsharded == [whole[8:][1::2][i : i + 2] for i in range(0, 8, 2)]
