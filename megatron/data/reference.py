"""Pure-numpy references for the C++ index builders in csrc/data/helpers.cpp (used by tests and the bench).

They are written differently from the C++ loops on purpose (prefix sums + searchsorted instead of a walk), so
that agreement between the two is evidence, not a copy checking itself.
"""

from __future__ import annotations

import numpy as np


def build_sample_idx_numpy(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int, dtype: type[np.integer] = np.int64
) -> np.ndarray:
    """``(num_samples+1, 2)`` array of (position in doc_idx, offset in that document) where each sample starts.

    Sample i covers global token positions ``[i*seq_length, (i+1)*seq_length]`` of the documents concatenated
    in doc_idx order (seq_length+1 tokens; the last one is shared with sample i+1).
    """
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)  # ends[j] = first global position after document j
    if num_samples * seq_length + 1 > (int(ends[-1]) if len(ends) else 0):
        raise ValueError("doc_idx holds fewer tokens than num_samples * seq_length + 1")
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    # The first document whose end lies beyond the position holds it; empty documents are skipped naturally.
    pos = np.searchsorted(ends, starts, side="right")
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    out[1:, 0] = pos
    out[1:, 1] = starts - (ends[pos] - lengths[pos])
    return out


def build_blending_indices_numpy(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy weighted interleaving: sample i goes to the dataset furthest below its share of max(i, 1) samples."""
    weights = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(weights), dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(weights * max(i, 1) - taken))  # argmax keeps the first on ties, as the C++ loop does
        dataset_index[i] = d
        dataset_sample_index[i] = taken[d]
        taken[d] += 1
    return dataset_index, dataset_sample_index
