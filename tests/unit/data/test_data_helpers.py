"""The C++ index builders against the numpy reference, the int64 path past 2^31 tokens, and blend proportions."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.reference import build_blending_indices_numpy, build_sample_idx_numpy


def token_position(sample_idx: np.ndarray, sizes: np.ndarray, doc_idx: np.ndarray) -> np.ndarray:
    """Global position (in the doc_idx-ordered stream) of each sample start."""
    before = np.concatenate([[0], np.cumsum(sizes[doc_idx].astype(np.int64))])
    return before[sample_idx[:, 0].astype(np.int64)] + sample_idx[:, 1].astype(np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_sample_idx_matches_reference_on_random_docs(seed):
    rng = np.random.default_rng(seed)
    n_docs = int(rng.integers(1, 300))
    sizes = rng.integers(0, 80, size=n_docs).astype(np.int32)
    sizes[rng.integers(0, n_docs)] = 1 + int(rng.integers(0, 500))  # at least one token, sometimes a long doc
    doc_idx = np.concatenate([rng.permutation(n_docs) for _ in range(3)]).astype(np.int64)
    seq_length = int(rng.integers(1, 100))
    num_samples = (int(sizes[doc_idx].sum()) - 1) // seq_length
    got = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    want = build_sample_idx_numpy(sizes, doc_idx, seq_length, num_samples)
    assert got.dtype == np.int32 and got.shape == (num_samples + 1, 2)
    np.testing.assert_array_equal(got, want)
    # Sample s starts at token s * seq_length of the stream, and every offset lies inside its document.
    np.testing.assert_array_equal(token_position(got, sizes, doc_idx), np.arange(num_samples + 1) * seq_length)
    assert np.all(got[1:, 1] < sizes[doc_idx[got[1:, 0]]])


def test_sample_idx_int64_path_beyond_2_pow_31_tokens():
    # Five near-maximal documents: 10.7e9 tokens in total, described by sizes only (nothing of that size exists).
    sizes = np.array([2**31 - 1, 2**31 - 7, 2**30 + 3, 2**31 - 1, 5], dtype=np.int32)
    doc_idx = np.array([3, 0, 4, 2, 1, 0, 3], dtype=np.int64)
    total = int(sizes[doc_idx].astype(np.int64).sum())
    assert total > 2**33
    assert helpers.sample_idx_needs_int64(sizes, doc_idx)
    seq_length = 2**27 + 12345  # ~100 samples keep the walk fast
    num_samples = (total - 1) // seq_length
    got = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, build_sample_idx_numpy(sizes, doc_idx, seq_length, num_samples))
    positions = token_position(got, sizes, doc_idx)
    np.testing.assert_array_equal(positions, np.arange(num_samples + 1, dtype=np.int64) * seq_length)
    assert positions[-1] > 2**33  # really past the int32 range


def test_sample_idx_refuses_too_few_tokens():
    sizes = np.array([5, 5], dtype=np.int32)
    with pytest.raises(IndexError):  # pybind11 maps std::out_of_range to IndexError
        helpers.build_sample_idx(sizes, np.array([0, 1]), 4, 3)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.9, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.01, 0.49, 0.5]])
def test_blending_indices_match_reference(weights):
    got = helpers.build_blending_indices(np.array(weights), 2000)
    want = build_blending_indices_numpy(np.array(weights), 2000)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_blending_index_is_upstreams_greedy_rule():
    # Sample i goes to the dataset with the largest w * max(i, 1) - taken (upstream's helpers.cpp), the first on a
    # tie. By hand for (0.2, 0.8): i=0 and i=1 both use 1: 1 (gaps .2 .8), then 0 (.2 -.2); i=2: 1 (-.6 .6);
    # i=3: 1 (-.4 .4); i=4: 1 (-.2 .2); i=5: a tie (0 0) -> 0. A rule using i + 1 would give 1, 1, 0, ...
    index, sample = helpers.build_blending_indices(np.array([0.2, 0.8]), 6)
    assert index.tolist() == [1, 0, 1, 1, 1, 0] and sample.tolist() == [0, 0, 1, 2, 3, 1]


class _Constant:
    """A stand-in dataset whose samples say which dataset they came from."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        assert 0 <= i < self.n
        return {"text": np.array([self.tag, i])}


def test_blend_proportions_within_one_percent_over_10k_samples():
    weights = [0.6, 0.25, 0.15]
    blend = BlendableDataset([_Constant(d, 7000) for d in range(3)], [6, 2.5, 1.5], 10_000)  # unnormalized
    samples = [blend[i]["text"] for i in range(len(blend))]
    tags = np.array([s[0] for s in samples])
    share = np.bincount(tags, minlength=3) / len(tags)
    assert np.all(np.abs(share - weights) < 0.01 * np.array(weights))
    # Every dataset is read in order without repeats: sample k of dataset d is its k-th draw.
    for d in range(3):
        assert [s[1] for s in samples if s[0] == d] == list(range(int((tags == d).sum())))
    # The first 1000 samples are already balanced (greedy blend, not a random draw).
    assert np.all(np.abs(np.bincount(tags[:1000], minlength=3) - 1000 * np.array(weights)) <= 1)
