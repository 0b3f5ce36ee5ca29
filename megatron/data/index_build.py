"""The arithmetic of a GPT dataset's three index arrays, written to give exactly upstream Megatron-DeepSpeed's arrays
(commit 4efb479d, megatron/data/gpt_dataset.py) for the same documents, sample count, sequence length and seed.

One ``np.random.RandomState(seed)`` is drawn from in a fixed order: the document shuffle(s), then the sample
shuffle(s). Any change to that order, to an array's length or to which part is shuffled apart changes every sample
a run reads, so tests/unit/data/test_upstream_order.py compares all three arrays with arrays upstream's own code made.
"""

from __future__ import annotations

import numpy as np

from megatron.data.helpers import build_sample_idx

# Upstream's threshold: a last epoch of which less than this share of samples is used is shuffled apart.
LAST_EPOCH_SHARE = 0.80


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The fewest epochs whose tokens give ``num_samples`` samples of seq_length + 1 tokens (consecutive samples share
    one token); at least one."""
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def samples_in(epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Samples that ``epochs`` epochs hold: all the tokens but one, in steps of seq_length."""
    return (epochs * tokens_per_epoch - 1) // seq_length


def separate_last_epoch(epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    """Whether the last epoch is shuffled apart: only when it is used for less than LAST_EPOCH_SHARE of its samples,
    so that the samples a run reads cover the complete epochs evenly instead of a random mix of all of them."""
    if epochs == 1:
        return False
    from_complete = samples_in(epochs - 1, tokens_per_epoch, seq_length)
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - from_complete < int(LAST_EPOCH_SHARE * per_epoch)


def _shuffled_epochs(documents: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    # RandomState.shuffle draws the same swaps for any 1-D dtype; int64 takes numpy's faster pointer-sized path (and
    # the sample index builder wants int64), so the int32 upstream stores is made only at the end.
    doc_idx = np.tile(documents.astype(np.int64), epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_doc_idx(documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    """int64[epochs * len(documents)] (upstream stores it as int32): the documents of all epochs shuffled together,
    or, with ``separate_last``, those of all epochs but the last shuffled together followed by the last epoch
    shuffled on its own."""
    if not separate_last or epochs == 1:
        return _shuffled_epochs(documents, epochs, rng)
    return np.concatenate([_shuffled_epochs(documents, epochs - 1, rng), _shuffled_epochs(documents, 1, rng)])


def build_shuffle_idx(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """[0, num_first) shuffled, then [num_first, total) shuffled; uint32 while the sample count allows it."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_upstream_order(documents: np.ndarray, sizes: np.ndarray, num_samples: int, seq_length: int,
                         seed: int) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx as upstream builds them (the default order)."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    separate = separate_last_epoch(epochs, tokens_per_epoch, seq_length, num_samples)
    doc_idx = build_doc_idx(documents, epochs, rng, separate)
    total = samples_in(epochs, tokens_per_epoch, seq_length)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, total)
    first = samples_in(epochs - 1, tokens_per_epoch, seq_length) if separate else total
    return {"doc_idx": doc_idx.astype(np.int32), "sample_idx": sample_idx,
            "shuffle_idx": build_shuffle_idx(first, total, rng)}


def build_per_epoch_order(documents: np.ndarray, sizes: np.ndarray, num_samples: int, seq_length: int,
                          seed: int) -> dict[str, np.ndarray]:
    """Not upstream's order (opt-in, --per-epoch-doc-shuffle): every epoch is its own permutation of the documents,
    so each document is read once before any is read again; the samples of the complete epochs are shuffled apart
    from those of the last one whatever its share. Kept for runs started with it before upstream's order was the
    default."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(epochs)])
    total = samples_in(epochs, tokens_per_epoch, seq_length)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, total)
    full = max(samples_in(epochs - 1, tokens_per_epoch, seq_length), 0)
    dtype = np.uint32 if total < np.iinfo(np.uint32).max else np.int64
    head, tail = np.arange(full, dtype=dtype), np.arange(full, total, dtype=dtype)
    rng.shuffle(head)
    rng.shuffle(tail)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": np.concatenate([head, tail])}
